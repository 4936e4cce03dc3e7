"""The commands that write a converted checkpoint: a thin layer over the Python API
(kconvert.api, kconvert.driver.commands). Each command is a recipe plus option groups
(kconvert.cli.conversion_options); an option's value reaches the stages by its name, as a
setting or as what the command prepares from the source."""

from __future__ import annotations

import time

import click

from kconvert.cli.base import KconvertCommand, apply_options, exit_status, given_options
from kconvert.cli.conversion_options import (
    DEQUANT_OPTIONS,
    METHOD_KINDS,
    QUANTIZE_METHOD_OPTIONS,
    QUANTIZE_OPTIONS,
    RUN_CONTROL_OPTIONS,
    RUN_OPTIONS,
    SPARSIFY_CALIBRATION_OPTIONS,
    SPARSIFY_OPTIONS,
    method_options,
    prune_options,
)
from kconvert.common.options import REAP_SAMPLES, SPARSEGPT_SAMPLES
from kconvert.io.early_read import start_early_read


def _run(recipe_name: str, src: str, dst: str, params: dict) -> None:
    """The options given on the command line (defaults are the API's), then the conversion
    through the Python API; its summary line unless --quiet, or with --json one JSON object on
    stdout (messages go to stderr), which on failure carries the error."""
    run = {k: params.pop(k) for k in RUN_CONTROL_OPTIONS}
    if not (run["dry_run"] or run["stream"]):
        start_early_read(src)  # the disk reads SRC's first bytes while torch imports
    from kconvert.api import run_recipe

    as_json = params.pop("as_json")
    given = set(given_options(click.get_current_context()))
    options = {k: v for k, v in params.items() if k in given}
    if not as_json:
        result = run_recipe(recipe_name, src, dst, **run, **options, echo=click.echo)
        if result.manifest is not None and not run["quiet"]:
            click.echo(result.summary_line())
        return
    from kconvert.common import events
    from kconvert.driver.run_summary import RunSummary, WrittenBytes

    messages: list[str] = []

    def note(message: str) -> None:
        messages.append(message)
        click.echo(message, err=True)

    start = time.perf_counter()
    written = WrittenBytes()
    unsubscribe = events.subscribe(written, timings=True)
    try:
        summary = run_recipe(recipe_name, src, dst, **run, **options, echo=note).to_summary()
    except Exception as exc:
        # The same error then reaches KconvertCommand, which prints it and sets the exit code.
        click.echo(RunSummary.failed(recipe_name, src, run["dry_run"], str(exc),
                                     time.perf_counter() - start, messages,
                                     written.total, exit_status(exc)).model_dump_json())
        raise
    finally:
        unsubscribe()
    click.echo(summary.model_dump_json())


def conversion_command(name: str, summary: str, options: list) -> click.Command:
    """The command `name`: the built-in recipe of that name on SRC into DST, with `options`
    (stage options by name) and the run controls."""

    @click.command(name, cls=KconvertCommand, help=summary)
    @click.argument("src")
    @click.argument("dst")
    @apply_options(options + RUN_OPTIONS)
    def command(src: str, dst: str, **params) -> None:
        _run(name, src, dst, params)

    return command


int4_to_nvfp4 = conversion_command(
    "int4-to-nvfp4", "INT4 pack-quantized SRC -> NVFP4 DST in one pass (dequant + quantize).",
    QUANTIZE_OPTIONS + QUANTIZE_METHOD_OPTIONS)
int4_to_mxfp4 = conversion_command(
    "int4-to-mxfp4", "INT4 pack-quantized SRC -> MXFP4 DST in one pass (AMD Quark's layout by "
                     "default; dequant + quantize).", QUANTIZE_OPTIONS)
mxfp4_to_nvfp4 = conversion_command(
    "mxfp4-to-nvfp4", "MXFP4 SRC (compressed-tensors or Quark) -> NVFP4 DST, its codes kept: "
                      "exact wherever NVFP4 holds the scales (--cast exact).", QUANTIZE_OPTIONS)
quantize = conversion_command("quantize", "Any SRC -> NVFP4 or MXFP4 (--format) on the "
                                          "targeted modules; --method gptq for NVFP4.",
                              QUANTIZE_OPTIONS + QUANTIZE_METHOD_OPTIONS)
dequant = conversion_command(
    "dequant", "Quantized SRC -> BF16 (or F32) DST, quantization_config removed.",
    DEQUANT_OPTIONS)
reap = conversion_command(
    "reap", "Prune routed experts of SRC: REAP saliency from --data or --stats, or a given "
            "--plan.", prune_options(REAP_SAMPLES, "With --data: sequences."))
sparsify = conversion_command(
    "sparsify", "Paired-4:8 routed experts of SRC (BF16, INT4 or NVFP4) -> p48 NVFP4 DST, one "
                "pass.", [*method_options("Mask selection:", ("sparsify",)), *SPARSIFY_OPTIONS,
                          *SPARSIFY_CALIBRATION_OPTIONS, *QUANTIZE_OPTIONS])
densify = conversion_command(
    "densify", "pair-bitmask p48 SRC -> dense NVFP4 DST (stock compressed-tensors layout), "
               "lossless.", [])


@click.command("run", cls=KconvertCommand)
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@apply_options([
    *QUANTIZE_OPTIONS,
    *prune_options(None, f"With --data: sequences [default: {REAP_SAMPLES} for a prune stage's "
                         f"REAP calibration, {SPARSEGPT_SAMPLES} for SparseGPT and GPTQ]."),
    *method_options("The method of the recipe's first stage that takes one:", METHOD_KINDS),
    *SPARSIFY_OPTIONS, *RUN_OPTIONS])
def run_recipe(recipe: str, src: str, dst: str, **params) -> None:
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST.

    --stats and --data serve every stage that needs calibration: REAP's saliency, Wanda's
    column norms, SparseGPT's and GPTQ's inputs. An option that no stage of RECIPE takes is an
    error."""
    _run(recipe, src, dst, params)
