"""The command line: a thin click layer over `convert.convert`, the recipes, calibration, eval
and the audit.

Only click is imported at start-up, so `kconvert --help` answers at once; each command imports
what it runs (torch and compressed-tensors take seconds). Every command reports errors the same
way (`KconvertCommand`): a usage error exits 2 (click's message), bad input is one line and
exit 1, an internal error keeps its traceback, says it is a bug, and exits 3.

`run` is the program (`kconvert`, `python -m kconvert`): the command, then an exit without the
interpreter's teardown, which takes a second or two once torch and transformers are imported
(their modules and objects freed one by one) and changes nothing a finished command wrote.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import click

from kconvert.cli.base import KconvertGroup
from kconvert.cli.convert import (
    densify,
    dequant,
    int4_to_mxfp4,
    int4_to_nvfp4,
    mxfp4_to_nvfp4,
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


for command in (int4_to_nvfp4, int4_to_mxfp4, mxfp4_to_nvfp4, quantize, dequant, reap, sparsify,
                densify, run_recipe, calibrate_cmd, eval_cmd, audit, inspect_cmd):
    main.add_command(command)


# CUDA's caching allocator by default keeps fixed-size segments, which the data-driven
# commands' layer-by-layer tensors of varying sizes fragment: a 4-rank GPTQ run on H200s failed
# to allocate 11.8 GiB with 27 GiB reserved but unallocated inside its budget
# (benchmarks/results/multi_gpu_H200x4_2026-11-27_gptq_reap_eval.json). Growable segments leave
# no such holes; a value the user set is kept.
CUDA_ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def use_cuda_allocator_defaults() -> None:
    """Set CUDA_ALLOCATOR's variable unless the environment has it (torch reads it when CUDA
    first allocates, after this)."""
    name, value = CUDA_ALLOCATOR
    os.environ.setdefault(name, value)


def run() -> None:
    """`kconvert`: the command line, then `exit_now` with its exit status."""
    use_cuda_allocator_defaults()
    try:
        main()  # click's standalone mode always ends in SystemExit
    except SystemExit as exc:
        exit_now(exc.code)


def exit_now(code: int | str | None) -> None:
    """Exit with `code` as sys.exit would, skipping the interpreter's teardown: the exit
    handlers run (logging's flush, torch.distributed's shutdown) and stdout and stderr are
    flushed first. While a thread that the interpreter would wait for still runs, the
    ordinary exit is taken instead."""
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others:
        sys.exit(code)
    if isinstance(code, str):  # sys.exit's message
        print(code, file=sys.stderr)
    status = 0 if code is None else code if isinstance(code, int) else 1
    ranks = sys.modules.get("kconvert.common.distributed")  # loaded where a command used it
    if status and ranks is not None:
        ranks.mark_failed()  # leave the process group at once: the others' collectives fail
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or a closed stream
            status = status or 1
    os._exit(status)
