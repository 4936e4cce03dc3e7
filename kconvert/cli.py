"""The command line: a thin click layer over `convert.convert` and the recipes."""

from __future__ import annotations

import sys

import click

from kconvert import __version__
from kconvert.convert import RunControl, convert
from kconvert.errors import KconvertError
from kconvert.pipeline import load_recipe


def _run_options(f):
    options = [
        click.option("--revision", default=None, help="Hub revision when SRC is a repo id."),
        click.option("--device", default="auto", show_default=True,
                     help="auto | cpu | cuda | cuda:N"),
        click.option("--resume", is_flag=True, help="Continue an interrupted run into DST."),
        click.option("--overwrite", is_flag=True, help="Replace a non-empty DST."),
        click.option("--dry-run", is_flag=True,
                     help="Print what each tensor role becomes and the output size; "
                          "write nothing."),
        click.option("--quiet", is_flag=True, help="No progress bar."),
        click.option("--readers", default=4, show_default=True, help="Reader threads."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _quant_options(f):
    options = [
        click.option("--format", "fmt", type=click.Choice(["compressed-tensors", "modelopt"]),
                     default=None, help="NVFP4 on-disk flavour [default: compressed-tensors]."),
        click.option("--block-scale", type=click.Choice(["amax", "mse"]), default=None,
                     help="FP8 block-scale rule: amax (compressed-tensors/ModelOpt bytes) or mse "
                          "(min block error) [default: mse]."),
        click.option("--act-stats", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Calibration statistics JSON {\"input_amax\": {module: amax}}: "
                          "listed modules become W4A4 with input scales."),
        click.option("--targets", default=None,
                     help="Comma list of experts,shared_experts,dense_mlp,attention "
                          "[default: experts]."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _go(recipe_name: str, src: str, dst: str, overrides: dict, revision, **run) -> None:
    try:
        recipe = load_recipe(recipe_name)
        manifest = convert(src, dst, recipe, overrides, RunControl(**run), revision=revision,
                           echo=click.echo)
    except KconvertError as exc:
        click.echo(f"kconvert: error: {exc}", err=True)
        sys.exit(2)
    if manifest is not None and not run["quiet"]:
        s = manifest.summary
        click.echo(f"wrote {dst}: {s['tensors']} tensors, {s['quantized_modules']} quantized "
                   f"modules, mean relative MSE {s['rel_mse_mean']:.3e}")


@click.group()
@click.version_option(__version__)
def main() -> None:
    """Convert and compress Kimi-K2 family MoE checkpoints shard by shard."""


@main.command("int4-to-nvfp4")
@click.argument("src")
@click.argument("dst")
@_quant_options
@_run_options
def int4_to_nvfp4(src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """INT4 pack-quantized SRC -> NVFP4 DST in one pass (dequant + quantize)."""
    _go("int4-to-nvfp4", src, dst,
        {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats}, revision, **run)


@main.command()
@click.argument("src")
@click.argument("dst")
@_quant_options
@_run_options
def quantize(src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """Any SRC -> NVFP4 on the targeted modules."""
    _go("quantize", src, dst,
        {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats}, revision, **run)


@main.command()
@click.argument("src")
@click.argument("dst")
@_run_options
def dequant(src, dst, revision, **run):
    """Quantized SRC -> BF16 DST, quantization_config removed."""
    _go("dequant", src, dst, {}, revision, **run)


@main.command("run")
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@_quant_options
@_run_options
def run_recipe(recipe, src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST."""
    _go(recipe, src, dst, {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats},
        revision, **run)
if __name__ == "__main__":
    main()
