"""The commands that write a converted checkpoint: a thin layer over `kconvert.convert` and
the recipes. Each command is a recipe plus option groups (kconvert.cli.base); an option's value
reaches the stages by its name, as a setting or as what the command prepares from the source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING

import click

from kconvert.cli.base import (
    DEQUANT_OPTIONS,
    ONLY_WITH,
    QUANTIZE_OPTIONS,
    REAP_SAMPLES,
    RUN_OPTIONS,
    SPARSEGPT_SAMPLES,
    SPARSIFY_CALIBRATION_OPTIONS,
    SPARSIFY_OPTIONS,
    KconvertCommand,
    apply_options,
    given_options,
    prune_options,
)

if TYPE_CHECKING:  # at run time these are imported by the command that runs (they need torch)
    from kconvert.io.checkpoint import Checkpoint
    from kconvert.recipes import Recipe


def _run(recipe_name: str, src: str, dst: str, params: dict) -> None:
    """Check the given options against the recipe, prepare what its stages need from the
    source, then convert."""
    from kconvert.convert import RunControl, convert, summary_line
    from kconvert.recipes import check_options, load_recipe
    from kconvert.stages import KINDS

    given = given_options(click.get_current_context())
    recipe = load_recipe(recipe_name)
    check_options(recipe, given)
    for option, needs in ONLY_WITH.items():
        if option in given and not set(needs) & set(given):
            raise click.UsageError(f"--{option.replace('_', '-')} applies only with "
                                   + " or ".join(f"--{n}" for n in needs))
    revision = params.pop("revision")
    run = RunControl(**{f.name: params.pop(f.name) for f in fields(RunControl)})
    settings = {k: v for k, v in params.items()
                if any(k in kind.settings for kind in KINDS.values())}
    prepare = _preparer(recipe, params, run.device)
    manifest = convert(src, dst, recipe, settings, run, revision=revision, echo=click.echo,
                       prepare=prepare)
    if manifest is not None and not run.quiet:
        click.echo(summary_line(manifest, dst))


def _preparer(recipe: Recipe, options: dict, device: str
              ) -> Callable[[Checkpoint], dict[str, object]] | None:
    """prepare(ckpt) for convert(): by stage kind, what the recipe's stages need from the
    opened source (the Prune stage of a plan, SparseGPT's calibration); None if nothing."""
    makers = {}
    if "prune" in recipe.kinds:
        makers["prune"] = _prune_maker(recipe, options, device)
    if "sparsify" in recipe.kinds:
        sparsegpt = _sparsegpt_maker(recipe, options, device, prunes="prune" in recipe.kinds)
        if sparsegpt is not None:
            makers["sparsify"] = sparsegpt
    if not makers:
        return None
    return lambda ckpt: {kind: make(ckpt) for kind, make in makers.items()}


def _prune_maker(recipe: Recipe, options: dict, device: str) -> Callable[[Checkpoint], object]:
    """The Prune stage from --plan, or a plan from --stats or --data (REAP calibration, with
    router repair in the same pass when --repair or the recipe asks for it)."""
    plan, stats, data = options["plan"], options["stats"], options["data"]
    if sum(x is not None for x in (plan, stats, data)) > 1:
        raise click.UsageError("give only one of --plan, --stats and --data")
    if plan is None and stats is None and data is None:
        raise click.UsageError("give --data FILE, --stats DIR or --plan FILE")
    repair = options["repair"] or next(
        (s["repair"] for s in recipe.stages if s["stage"] == "prune" and "repair" in s), "none")
    if repair != "none" and data is None:
        raise click.UsageError(f"repair {repair} fits the router during calibration: give "
                               "--data FILE")

    def make(ckpt: Checkpoint):
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
        from kconvert.pruning.repair import RepairSettings, RouterRepair, with_repair

        if plan is not None:
            return prune_stage(load_plan(plan), ckpt)
        keep = keep_count(ckpt, options["keep"], options["prune_ratio"])
        fixer = None
        if stats is not None:
            scores = scores_from_stats(stats)
        else:
            ids = load_calibration_data(data, ckpt.root, options["samples"] or REAP_SAMPLES,
                                        options["seq_len"], options["seed"])
            dev = pick_device(device)
            fixer = None if repair == "none" else RouterRepair(
                ckpt, ids, RepairSettings(repair, keep, options["criterion"]), dev,
                batch_size=options["batch_size"])
            measured = calibrate(ckpt, ids, dev, options["batch_size"], on_weights=fixer)
            if options["save_stats"]:
                save_stats(measured, options["save_stats"])
            scores = scores_of(measured)
        made = plan_from_scores(scores, keep, options["criterion"], ckpt.identity)
        if fixer is None:
            return prune_stage(made, ckpt)
        return prune_stage(with_repair(made, fixer), ckpt, fixer.rows)

    return make


def _sparsegpt_maker(recipe: Recipe, options: dict, device: str, prunes: bool
                     ) -> Callable[[Checkpoint], object] | None:
    """SparseGPT's calibration from --data when the run's sparsify method is sparsegpt; None
    otherwise (without --data the stage itself refuses sparsegpt, as it refuses wanda without
    --stats)."""
    recipe_methods = [s.get("method", "magnitude") for s in recipe.stages
                      if s["stage"] == "sparsify"]
    method = options["method"] or next(iter(recipe_methods), None)
    data, stats = options["data"], options["stats"]
    if not prunes:  # else --data and --stats also serve the pruning plan
        for option, value, user in (("data", data, "sparsegpt"), ("stats", stats, "wanda")):
            if value is not None and method != user:
                raise click.UsageError(f"--{option} serves --method {user}; this run's sparsify "
                                       f"method is {method}")
    if method != "sparsegpt" or data is None:
        return None

    def make(ckpt: Checkpoint):
        from kconvert.devices import pick_device
        from kconvert.stages.sparsify import SparsegptCalibration

        return SparsegptCalibration.from_file(
            ckpt, data, options["samples"] or SPARSEGPT_SAMPLES, options["seq_len"],
            options["batch_size"], options["seed"], pick_device(device))

    return make


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
    QUANTIZE_OPTIONS)
quantize = conversion_command("quantize", "Any SRC -> NVFP4 on the targeted modules.",
                              QUANTIZE_OPTIONS)
dequant = conversion_command(
    "dequant", "Quantized SRC -> BF16 (or F32) DST, quantization_config removed.",
    DEQUANT_OPTIONS)
reap = conversion_command(
    "reap", "Prune routed experts of SRC: REAP saliency from --data or --stats, or a given "
            "--plan.", prune_options(REAP_SAMPLES, "With --data: sequences."))
sparsify = conversion_command(
    "sparsify", "Paired-4:8 routed experts of SRC (BF16, INT4 or NVFP4) -> p48 NVFP4 DST, one "
                "pass.", SPARSIFY_OPTIONS + SPARSIFY_CALIBRATION_OPTIONS + QUANTIZE_OPTIONS)
densify = conversion_command(
    "densify", "pair-bitmask p48 SRC -> dense NVFP4 DST (stock compressed-tensors layout), "
               "lossless.", [])


@click.command("run", cls=KconvertCommand)
@click.argument("recipe")
@click.argument("src")
@click.argument("dst")
@apply_options(QUANTIZE_OPTIONS + prune_options(
    None, f"With --data: sequences [default: {REAP_SAMPLES} for a prune stage's REAP "
          f"calibration, {SPARSEGPT_SAMPLES} for SparseGPT].") + SPARSIFY_OPTIONS + RUN_OPTIONS)
def run_recipe(recipe: str, src: str, dst: str, **params) -> None:
    """Run RECIPE (a pipelines/ name or a .toml path) on SRC into DST.

    --stats and --data serve every stage that needs calibration: REAP's saliency, Wanda's
    column norms, SparseGPT's inputs. An option that no stage of RECIPE takes is an error."""
    _run(recipe, src, dst, params)
