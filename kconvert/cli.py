"""The command line: a thin click layer over `convert.convert` and the recipes."""

from __future__ import annotations

import sys

import click

from kconvert import __version__
from kconvert.convert import RunControl, convert
from kconvert.errors import KconvertError
from kconvert.pipeline import load_recipe
from kconvert.plan import load_plan
from kconvert.reap import CRITERIA, keep_count, plan_from_scores, prune_stage, scores_from_stats


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


def _go(recipe_name: str, src: str, dst: str, overrides: dict, revision, prepare=None,
        **run) -> None:
    try:
        recipe = load_recipe(recipe_name)
        manifest = convert(src, dst, recipe, overrides, RunControl(**run), revision=revision,
                           echo=click.echo, prepare=prepare)
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


def _prune_options(f):
    options = [
        click.option("--keep", type=int, default=None, help="Routed experts to keep per layer."),
        click.option("--prune-ratio", type=float, default=None,
                     help="Fraction of routed experts to drop (instead of --keep)."),
        click.option("--criterion", type=click.Choice(sorted(CRITERIA)), default="reap",
                     show_default=True, help="How experts are ranked."),
        click.option("--plan", "plan_file", type=click.Path(exists=True, dir_okay=False),
                     default=None, help="Apply this plan file instead of computing one."),
        click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
                     help="Calibration statistics from `kconvert calibrate`."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _pruning(keep, prune_ratio, criterion, plan_file, stats):
    """prepare(ckpt) for convert(): the Prune stage from a plan file or from statistics."""
    if plan_file is None and stats is None:
        return None

    def prepare(ckpt):
        if plan_file is not None:
            plan = load_plan(plan_file)
        else:
            n = keep_count(ckpt.text_config.get("n_routed_experts", 0), keep, prune_ratio)
            plan = plan_from_scores(scores_from_stats(stats), n, criterion, ckpt.identity)
        return {"prune": prune_stage(plan, ckpt)}

    return prepare


@main.command()
@click.argument("src")
@click.argument("dst")
@_prune_options
@_run_options
def reap(src, dst, keep, prune_ratio, criterion, plan_file, stats, revision, **run):
    """Prune routed experts of SRC by REAP saliency (from --stats) or a given --plan."""
    prepare = _pruning(keep, prune_ratio, criterion, plan_file, stats)
    if prepare is None:
        raise click.UsageError("give --plan FILE or --stats DIR (with --keep or --prune-ratio)")
    _go("reap", src, dst, {}, revision, prepare=prepare, **run)


@main.command("run")
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@_quant_options
@_prune_options
@_run_options
def run_recipe(recipe, src, dst, fmt, block_scale, act_stats, targets, keep, prune_ratio,
               criterion, plan_file, stats, revision, **run):
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST."""
    overrides = {"format": fmt, "block_scale": block_scale, "targets": targets,
                 "act_stats": act_stats}
    _go(recipe, src, dst, overrides, revision,
        prepare=_pruning(keep, prune_ratio, criterion, plan_file, stats), **run)


if __name__ == "__main__":
    main()
