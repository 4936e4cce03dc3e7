"""The commands that write a converted checkpoint: a thin layer over `kconvert.convert` and
the recipes."""

from __future__ import annotations

import click

from kconvert.cli.base import (
    ONLY_WITH,
    PRUNE_OPTIONS,
    REAP_SAMPLES,
    SPARSEGPT_SAMPLES,
    SPARSIFY_OPTIONS,
    KconvertCommand,
    apply_options,
    calibration_options,
    given_options,
    prune_options,
    quant_options,
    run_options,
    sparsify_options,
)


def _go(recipe_name: str, src: str, dst: str, overrides: dict, revision, prepare=None,
        **run) -> None:
    """Check the given options against the recipe, then convert."""
    from kconvert.convert import RunControl, convert, summary_line
    from kconvert.recipes import check_options, load_recipe

    given = given_options(click.get_current_context())
    recipe = load_recipe(recipe_name)
    check_options(recipe, given)
    for option, needs in ONLY_WITH.items():
        if option in given and not set(needs) & set(given):
            raise click.UsageError(f"--{option.replace('_', '-')} applies only with "
                                   + " or ".join(f"--{n}" for n in needs))
    manifest = convert(src, dst, recipe, overrides, RunControl(**run), revision=revision,
                       echo=click.echo, prepare=prepare)
    if manifest is not None and not run["quiet"]:
        click.echo(summary_line(manifest, dst))


@click.command("int4-to-nvfp4", cls=KconvertCommand)
@click.argument("src")
@click.argument("dst")
@quant_options
@run_options
def int4_to_nvfp4(src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """INT4 pack-quantized SRC -> NVFP4 DST in one pass (dequant + quantize)."""
    _go("int4-to-nvfp4", src, dst,
        {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats}, revision, **run)


@click.command(cls=KconvertCommand)
@click.argument("src")
@click.argument("dst")
@quant_options
@run_options
def quantize(src, dst, fmt, block_scale, act_stats, targets, revision, **run):
    """Any SRC -> NVFP4 on the targeted modules."""
    _go("quantize", src, dst,
        {"format": fmt, "block_scale": block_scale, "targets": targets,
         "act_stats": act_stats}, revision, **run)


@click.command(cls=KconvertCommand)
@click.argument("src")
@click.argument("dst")
@click.option("--dtype", type=click.Choice(["BF16", "F32"]), default="BF16", show_default=True,
              help="F32 keeps INT4's q * scale exactly (a lossless intermediate).")
@run_options
def dequant(src, dst, dtype, revision, **run):
    """Quantized SRC -> BF16 (or F32) DST, quantization_config removed."""
    _go("dequant", src, dst, {"dtype": dtype}, revision, **run)


def _pruning(keep, prune_ratio, criterion, plan_file, stats, data, samples, seq_len, batch_size,
             seed, save_stats_dir, device):
    """prepare(ckpt) for convert(): the Prune stage from a plan file, statistics or data."""
    if sum(x is not None for x in (plan_file, stats, data)) > 1:
        raise click.UsageError("give only one of --plan, --stats and --data")
    if plan_file is None and stats is None and data is None:
        return None

    def prepare(ckpt):
        from kconvert.calibrate.data import load_calibration_data
        from kconvert.calibrate.run import calibrate
        from kconvert.calibrate.stats import save_stats
        from kconvert.devices import pick_device
        from kconvert.pruning.plan import load_plan
        from kconvert.pruning.reap import (
            keep_count,
            plan_from_scores,
            prune_stage,
            scores_from_stats,
            scores_of,
        )

        if plan_file is not None:
            return {"prune": prune_stage(load_plan(plan_file), ckpt)}
        n = keep_count(ckpt, keep, prune_ratio)
        if stats is not None:
            scores = scores_from_stats(stats)
        else:
            ids = load_calibration_data(data, ckpt.root, samples or REAP_SAMPLES, seq_len, seed)
            measured = calibrate(ckpt, ids, pick_device(device), batch_size)
            if save_stats_dir:
                save_stats(measured, save_stats_dir)
            scores = scores_of(measured)
        return {"prune": prune_stage(plan_from_scores(scores, n, criterion, ckpt.identity),
                                     ckpt)}

    return prepare


@click.command(cls=KconvertCommand)
@click.argument("src")
@click.argument("dst")
@prune_options(REAP_SAMPLES, "With --data: sequences.")
@run_options
def reap(src, dst, revision, **opts):
    """Prune routed experts of SRC: REAP saliency from --data or --stats, or a given --plan."""
    prune = {k: opts.pop(k) for k in PRUNE_OPTIONS}
    prepare = _pruning(**prune, device=opts["device"])
    if prepare is None:
        raise click.UsageError("give --data FILE, --stats DIR or --plan FILE")
    _go("reap", src, dst, {}, revision, prepare=prepare, **opts)


def _sparsifying(recipe_name: str, sparse: dict, stats, data, samples, seq_len, batch_size,
                 seed, device, prune_prepare=None):
    """Overrides for the sparsify stage, and prepare(ckpt) for what needs the source:
    SparseGPT's calibration pass (and a pruning plan, when the recipe prunes too)."""
    from kconvert.recipes import load_recipe

    overrides = {k: v for k, v in sparse.items() if v is not None}
    if "group_size" in overrides:
        overrides["group_size"] = int(overrides["group_size"])
    overrides["stats"] = stats
    recipe_methods = [s.get("method", "magnitude") for s in load_recipe(recipe_name).stages
                      if s["stage"] == "sparsify"]
    method = overrides.get("method", next(iter(recipe_methods), None))
    # Without --data, the stage itself refuses sparsegpt (as it refuses wanda without --stats).
    sparsegpt_data = method == "sparsegpt" and data is not None
    if prune_prepare is None:  # else --data and --stats also serve the pruning plan
        for option, value, user in (("data", data, "sparsegpt"), ("stats", stats, "wanda")):
            if value is not None and method != user:
                raise click.UsageError(f"--{option} serves --method {user}; this run's sparsify "
                                       f"method is {method}")

    def prepare(ckpt):
        from kconvert.calibrate.data import load_calibration_data
        from kconvert.devices import pick_device
        from kconvert.sparsity.sparsegpt import CalibrationHessians
        from kconvert.stages.sparsify import data_record

        out = prune_prepare(ckpt) if prune_prepare is not None else {}
        if sparsegpt_data:
            n = samples or SPARSEGPT_SAMPLES
            ids = load_calibration_data(data, ckpt.root, n, seq_len, seed)
            out["hessians"] = CalibrationHessians(ckpt, ids, pick_device(device), batch_size)
            out["data_record"] = data_record(data, n, seq_len, seed)
        return out

    return overrides, prepare


@click.command(cls=KconvertCommand)
@click.argument("src")
@click.argument("dst")
@sparsify_options
@click.option("--stats", type=click.Path(exists=True, file_okay=False), default=None,
              help="`kconvert calibrate` output: Wanda's input column norms.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration JSONL for SparseGPT (run layer by layer beside the conversion).")
@apply_options(calibration_options(SPARSEGPT_SAMPLES, "With --data: sequences."))
@quant_options
@run_options
def sparsify(src, dst, pattern, method, group_size, storage, stats, data, samples, seq_len,
             batch_size, seed, fmt, block_scale, act_stats, targets, revision, **run):
    """Paired-4:8 routed experts of SRC (BF16, INT4 or NVFP4) -> p48 NVFP4 DST, one pass."""
    sparse = {"pattern": pattern, "method": method, "group_size": group_size,
              "storage": storage}
    overrides, prepare = _sparsifying("sparsify", sparse, stats, data, samples, seq_len,
                                      batch_size, seed, run["device"])
    overrides.update({"format": fmt, "block_scale": block_scale, "targets": targets,
                      "act_stats": act_stats})
    _go("sparsify", src, dst, overrides, revision, prepare=prepare, **run)


@click.command(cls=KconvertCommand)
@click.argument("src")
@click.argument("dst")
@run_options
def densify(src, dst, revision, **run):
    """pair-bitmask p48 SRC -> dense NVFP4 DST (stock compressed-tensors layout), lossless."""
    _go("densify", src, dst, {}, revision, **run)


@click.command("run", cls=KconvertCommand)
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@quant_options
@prune_options(None, f"With --data: sequences [default: {REAP_SAMPLES} for a prune stage's "
                      f"REAP calibration, {SPARSEGPT_SAMPLES} for SparseGPT].")
@sparsify_options
@run_options
def run_recipe(recipe, src, dst, fmt, block_scale, act_stats, targets, revision, **opts):
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST.

    --stats and --data serve every stage that needs calibration: REAP's saliency, Wanda's
    column norms, SparseGPT's inputs. An option that no stage of RECIPE takes is an error."""
    from kconvert.recipes import load_recipe

    prune = {k: opts.pop(k) for k in PRUNE_OPTIONS}
    sparse = {k: opts.pop(k) for k in SPARSIFY_OPTIONS}
    calib = {k: prune[k] for k in ("stats", "data", "samples", "seq_len", "batch_size", "seed")}
    kinds = set(load_recipe(recipe).kinds)
    prune_prepare = _pruning(**prune, device=opts["device"]) if "prune" in kinds else None
    if "sparsify" not in kinds:
        calib.update(stats=None, data=None)  # calibration serves the pruning plan only
    overrides, prepare = _sparsifying(recipe, sparse, **calib, device=opts["device"],
                                      prune_prepare=prune_prepare)
    overrides.update({"format": fmt, "block_scale": block_scale, "targets": targets,
                      "act_stats": act_stats})
    _go(recipe, src, dst, overrides, revision, prepare=prepare, **opts)
