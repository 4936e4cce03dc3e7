"""The command line: a thin click layer over `convert.convert`, the recipes, calibration, eval
and the audit.

Only click is imported at start-up, so `kconvert --help` answers at once; each command imports
what it runs (torch and compressed-tensors take seconds). Every command reports errors the same
way (`KconvertCommand`): a usage error exits 2 (click's message), bad input is one line and
exit 1, an internal error keeps its traceback, says it is a bug, and exits 3.
"""

from __future__ import annotations

import click

from kconvert.cli.base import KconvertGroup
from kconvert.cli.convert import (
    densify,
    dequant,
    int4_to_mxfp4,
    int4_to_nvfp4,
    quantize,
    reap,
    run_recipe,
    sparsify,
)
from kconvert.cli.inspect import inspect_cmd
from kconvert.cli.tools import audit, calibrate_cmd, eval_cmd
from kconvert.version import __version__


@click.group(cls=KconvertGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__)
def main() -> None:
    """Convert and compress Kimi-K2 family MoE checkpoints shard by shard."""


for command in (int4_to_nvfp4, int4_to_mxfp4, quantize, dequant, reap, sparsify, densify,
                run_recipe, calibrate_cmd, eval_cmd, audit, inspect_cmd):
    main.add_command(command)
