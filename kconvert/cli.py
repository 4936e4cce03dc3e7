"""The command line: a thin click layer over `convert.convert` and the recipes."""

from __future__ import annotations

import sys

import click

from kconvert import __version__
from kconvert.audit import audit
from kconvert.calibrate import calibrate, calibrate_cmd, load_calibration_data, save_stats
from kconvert.convert import RunControl, convert, pick_device
from kconvert.errors import KconvertError
from kconvert.pipeline import load_recipe
from kconvert.plan import load_plan
from kconvert.reap import (
    CRITERIA,
    keep_count,
    plan_from_scores,
    prune_stage,
    scores_from_stats,
    scores_of,
)
from kconvert.sparsegpt import CalibrationHessians
from kconvert.sparsify import METHODS, STORAGES, data_record


def _run_options(f):
    options = [
        click.option("--revision", default=None, help="Hub revision when SRC is a repo id."),
        click.option("--device", default="auto", show_default=True,
                     help="auto | cpu | cuda | cuda:N"),
        click.option("--resume", is_flag=True, help="Continue an interrupted run into DST."),
        click.option("--trust-complete", is_flag=True,
                     help="With --resume: keep finished shards without re-hashing them."),
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
@click.option("--dtype", type=click.Choice(["BF16", "F32"]), default="BF16", show_default=True,
              help="F32 keeps INT4's q * scale exactly (a lossless intermediate).")
@_run_options
def dequant(src, dst, dtype, revision, **run):
    """Quantized SRC -> BF16 (or F32) DST, quantization_config removed."""
    _go("dequant", src, dst, {"dtype": dtype}, revision, **run)


PRUNE_OPTIONS = ("keep", "prune_ratio", "criterion", "plan_file", "stats", "data", "samples",
                 "seq_len", "batch_size", "seed", "save_stats_dir")


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
        click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Calibrate on this JSONL first (as `kconvert calibrate --data`)."),
        click.option("--samples", default=1024, show_default=True,
                     help="With --data: sequences."),
        click.option("--seq-len", default=2048, show_default=True,
                     help="With --data: tokens per sequence."),
        click.option("--batch-size", default=8, show_default=True,
                     help="With --data: sequences per step."),
        click.option("--seed", default=0, show_default=True, help="With --data: data order."),
        click.option("--save-stats", "save_stats_dir", type=click.Path(file_okay=False),
                     default=None,
                     help="With --data: also keep the statistics here, for reuse."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _pruning(keep, prune_ratio, criterion, plan_file, stats, data, samples, seq_len, batch_size,
             seed, save_stats_dir, device):
    """prepare(ckpt) for convert(): the Prune stage from a plan file, statistics or data."""
    if sum(x is not None for x in (plan_file, stats, data)) > 1:
        raise click.UsageError("give only one of --plan, --stats and --data")
    if plan_file is None and stats is None and data is None:
        return None

    def prepare(ckpt):
        if plan_file is not None:
            return {"prune": prune_stage(load_plan(plan_file), ckpt)}
        n = keep_count(ckpt.text_config.get("n_routed_experts", 0), keep, prune_ratio)
        if stats is not None:
            scores = scores_from_stats(stats)
        else:
            ids = load_calibration_data(data, ckpt.root, samples, seq_len, seed)
            measured = calibrate(ckpt, ids, pick_device(device), batch_size)
            if save_stats_dir:
                save_stats(measured, save_stats_dir)
            scores = scores_of(measured)
        return {"prune": prune_stage(plan_from_scores(scores, n, criterion, ckpt.identity),
                                     ckpt)}

    return prepare


@main.command()
@click.argument("src")
@click.argument("dst")
@_prune_options
@_run_options
def reap(src, dst, revision, **opts):
    """Prune routed experts of SRC: REAP saliency from --data or --stats, or a given --plan."""
    prune = {k: opts.pop(k) for k in PRUNE_OPTIONS}
    prepare = _pruning(**prune, device=opts["device"])
    if prepare is None:
        raise click.UsageError("give --data FILE, --stats DIR or --plan FILE")
    _go("reap", src, dst, {}, revision, prepare=prepare, **opts)


SPARSIFY_OPTIONS = ("pattern", "method", "group_size", "storage")


def _sparsify_options(f):
    options = [
        click.option("--pattern", type=click.Choice(["p48"]), default=None,
                     help="Sparsity pattern: paired-4:8 [default: p48]."),
        click.option("--method", type=click.Choice(METHODS), default=None,
                     help="Mask selection: magnitude (data-free), wanda (--stats), sparsegpt "
                          "(--data) [default: magnitude]."),
        click.option("--group-size", type=click.Choice(["16", "32"]), default=None,
                     help="Elements per FP8 block scale: 16 loads on stock vLLM, 32 is what "
                          "sparse FP4 kernels read [default: 16]."),
        click.option("--storage", type=click.Choice(STORAGES), default=None,
                     help="dense (zeros inside weight_packed) or pair-bitmask (kept bytes + "
                          "4-bit masks, ~0.65x) [default: dense]."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _sparsifying(sparse: dict, stats, data, samples, seq_len, batch_size, seed, device,
                 prune_prepare=None):
    """Overrides for the sparsify stage, and prepare(ckpt) for what needs the source:
    SparseGPT's calibration pass (and a pruning plan, when the recipe prunes too)."""
    overrides = {k: v for k, v in sparse.items() if v is not None}
    if "group_size" in overrides:
        overrides["group_size"] = int(overrides["group_size"])
    overrides["stats"] = stats
    # Without --data, the stage itself refuses sparsegpt (as it refuses wanda without --stats).
    sparsegpt_data = overrides.get("method") == "sparsegpt" and data is not None

    def prepare(ckpt):
        out = prune_prepare(ckpt) if prune_prepare is not None else {}
        if sparsegpt_data:
            ids = load_calibration_data(data, ckpt.root, samples, seq_len, seed)
            out["hessians"] = CalibrationHessians(ckpt, ids, pick_device(device), batch_size)
            out["data_record"] = data_record(data, samples, seq_len, seed)
        return out

    return overrides, prepare


@main.command()
@click.argument("src")
@click.argument("dst")
@_sparsify_options
@click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
              help="`kconvert calibrate` output: Wanda's input column norms.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration JSONL for SparseGPT (run layer by layer beside the conversion).")
@click.option("--samples", default=128, show_default=True, help="With --data: sequences.")
@click.option("--seq-len", default=2048, show_default=True, help="With --data: tokens each.")
@click.option("--batch-size", default=8, show_default=True, help="With --data: per step.")
@click.option("--seed", default=0, show_default=True, help="With --data: data order.")
@_quant_options
@_run_options
def sparsify(src, dst, pattern, method, group_size, storage, stats, data, samples, seq_len,
             batch_size, seed, fmt, block_scale, act_stats, targets, revision, **run):
    """Paired-4:8 routed experts of SRC (BF16, INT4 or NVFP4) -> p48 NVFP4 DST, one pass."""
    sparse = {"pattern": pattern, "method": method, "group_size": group_size,
              "storage": storage}
    overrides, prepare = _sparsifying(sparse, stats, data, samples, seq_len, batch_size, seed,
                                      run["device"])
    overrides.update({"format": fmt, "block_scale": block_scale, "targets": targets,
                      "act_stats": act_stats})
    _go("sparsify", src, dst, overrides, revision, prepare=prepare, **run)


@main.command()
@click.argument("src")
@click.argument("dst")
@_run_options
def densify(src, dst, revision, **run):
    """pair-bitmask p48 SRC -> dense NVFP4 DST (stock compressed-tensors layout), lossless."""
    _go("densify", src, dst, {}, revision, **run)


@main.command("run")
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@_quant_options
@_prune_options
@_sparsify_options
@_run_options
def run_recipe(recipe, src, dst, fmt, block_scale, act_stats, targets, revision, **opts):
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST.

    --stats and --data serve every stage that needs calibration: REAP's saliency, Wanda's
    column norms, SparseGPT's inputs."""
    prune = {k: opts.pop(k) for k in PRUNE_OPTIONS}
    sparse = {k: opts.pop(k) for k in SPARSIFY_OPTIONS}
    calib = {k: prune[k] for k in ("stats", "data", "samples", "seq_len", "batch_size", "seed")}
    try:
        kinds = {s.get("stage") for s in load_recipe(recipe).stages}
    except KconvertError:
        kinds = set()  # _go reports the bad recipe
    prune_prepare = _pruning(**prune, device=opts["device"]) if "prune" in kinds else None
    if "sparsify" not in kinds:
        calib.update(stats=None, data=None)  # calibration serves the pruning plan only
    overrides, prepare = _sparsifying(sparse, **calib, device=opts["device"],
                                      prune_prepare=prune_prepare)
    overrides.update({"format": fmt, "block_scale": block_scale, "targets": targets,
                      "act_stats": act_stats})
    _go(recipe, src, dst, overrides, revision, prepare=prepare, **opts)


main.add_command(calibrate_cmd)
main.add_command(audit)

if __name__ == "__main__":
    main()
