"""A conversion command from its options: the checks the options must pass, what the recipe's
stages need prepared from the opened source (a pruning plan, SparseGPT's calibration), then
`convert.convert`. The Python API (kconvert.api) and the command line (kconvert.cli.convert)
both run conversions through `run_conversion`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kconvert import convert
from kconvert.errors import UsageError
from kconvert.io.checkpoint import Checkpoint
from kconvert.manifest import Manifest
from kconvert.options import (
    BATCH_SIZE,
    ONLY_WITH,
    REAP_SAMPLES,
    SEED,
    SEQ_LEN,
    SPARSEGPT_SAMPLES,
)
from kconvert.recipes import Recipe, check_options, load_recipe
from kconvert.stages import KINDS


def run_conversion(recipe_name: str, src: str, dst: str, options: Mapping[str, object],
                   run: convert.RunControl, revision: str | None = None,
                   echo: Callable[[str], None] = print) -> Manifest | None:
    """Run the recipe `recipe_name` on SRC into DST with the stage options given by name
    (StageKind.options; None or absent: not given). Returns the manifest (None on a dry run)."""
    given = {k: v for k, v in options.items() if v is not None}
    known = {o for kind in KINDS.values() for o in kind.options}
    unknown = sorted(set(given) - known)
    if unknown:
        raise UsageError(f"unknown option {unknown[0]!r}; options: {', '.join(sorted(known))}")
    recipe = load_recipe(recipe_name)
    check_options(recipe, given)
    for option, needs in ONLY_WITH.items():
        if option in given and not set(needs) & set(given):
            raise UsageError(f"--{option.replace('_', '-')} applies only with "
                             + " or ".join(f"--{n}" for n in needs))
    settings = {k: v for k, v in given.items()
                if any(k in kind.settings for kind in KINDS.values())}
    # Through the module, so that a test can stand in for convert.convert.
    return convert.convert(src, dst, recipe, settings, run, revision=revision, echo=echo,
                   prepare=_preparer(recipe, given, run.device))


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


def _calibration(options: dict, samples: int) -> tuple[int, int, int, int]:
    """(samples, seq_len, batch_size, seed), the defaults where not given."""
    return (options.get("samples") or samples, options.get("seq_len") or SEQ_LEN,
            options.get("batch_size") or BATCH_SIZE, options.get("seed", SEED))


def _prune_maker(recipe: Recipe, options: dict, device: str) -> Callable[[Checkpoint], object]:
    """The Prune stage from --plan, or a plan from --stats or --data (REAP calibration, with
    router repair in the same pass when --repair or the recipe asks for it)."""
    plan, stats, data = options.get("plan"), options.get("stats"), options.get("data")
    if sum(x is not None for x in (plan, stats, data)) > 1:
        raise UsageError("give only one of --plan, --stats and --data")
    if plan is None and stats is None and data is None:
        raise UsageError("give --data FILE, --stats DIR or --plan FILE")
    repair = options.get("repair") or next(
        (s["repair"] for s in recipe.stages if s["stage"] == "prune" and "repair" in s), "none")
    if repair != "none" and data is None:
        raise UsageError(f"repair {repair} fits the router during calibration: give --data FILE")
    compensate = options.get("compensate") or next(
        (s["compensate"] for s in recipe.stages if s["stage"] == "prune" and "compensate" in s),
        "none")
    if compensate != "none" and data is None:
        raise UsageError(f"compensate {compensate} re-fits matrices during calibration: give "
                         "--data FILE")

    def make(ckpt: Checkpoint):
        from kconvert.calibrate.data import load_calibration_data
        from kconvert.calibrate.run import calibrate
        from kconvert.calibrate.stats import save_stats
        from kconvert.devices import pick_device
        from kconvert.pruning.plan import load_plan
        from kconvert.pruning.reap import (
            check_plan_keep,
            keep_count,
            plan_from_scores,
            prune_stage,
            scores_from_stats,
            scores_of,
        )
        from kconvert.pruning.repair import RepairSettings, RouterRepair, with_repair

        if plan is not None:
            loaded = load_plan(plan)
            check_plan_keep(loaded, ckpt, options.get("keep"), options.get("prune_ratio"), plan)
            return prune_stage(loaded, ckpt)
        keep = keep_count(ckpt, options.get("keep"), options.get("prune_ratio"))
        criterion = options.get("criterion") or "reap"
        fixer = None
        if stats is not None:
            scores = scores_from_stats(stats)
        else:
            samples, seq_len, batch_size, seed = _calibration(options, REAP_SAMPLES)
            ids = load_calibration_data(data, ckpt.root, samples, seq_len, seed)
            dev = pick_device(device)
            if repair != "none" or compensate != "none":
                fixer = RouterRepair(ckpt, ids, RepairSettings(repair, keep, criterion,
                                                               compensate=compensate), dev,
                                     batch_size=batch_size)
            measured = calibrate(ckpt, ids, dev, batch_size, on_weights=fixer)
            if options.get("save_stats"):
                save_stats(measured, options["save_stats"])
            scores = scores_of(measured)
        made = plan_from_scores(scores, keep, criterion, ckpt.identity)
        if fixer is None:
            return prune_stage(made, ckpt)
        return prune_stage(with_repair(made, fixer), ckpt, fixer.rows, fixer.matrices)

    return make


def _sparsegpt_maker(recipe: Recipe, options: dict, device: str, prunes: bool
                     ) -> Callable[[Checkpoint], object] | None:
    """SparseGPT's calibration from --data when the run's sparsify method is sparsegpt; None
    otherwise (without --data the stage itself refuses sparsegpt, as it refuses wanda without
    --stats)."""
    recipe_methods = [s.get("method", "magnitude") for s in recipe.stages
                      if s["stage"] == "sparsify"]
    method = options.get("method") or next(iter(recipe_methods), None)
    data, stats = options.get("data"), options.get("stats")
    if not prunes:  # else --data and --stats also serve the pruning plan
        for option, value, user in (("data", data, "sparsegpt"), ("stats", stats, "wanda")):
            if value is not None and method != user:
                raise UsageError(f"--{option} serves --method {user}; this run's sparsify "
                                 f"method is {method}")
    if method != "sparsegpt" or data is None:
        return None

    def make(ckpt: Checkpoint):
        from kconvert.devices import pick_device
        from kconvert.stages.sparsify import SparsegptCalibration

        samples, seq_len, batch_size, seed = _calibration(options, SPARSEGPT_SAMPLES)
        return SparsegptCalibration.from_file(ckpt, data, samples, seq_len, batch_size, seed,
                                              pick_device(device))

    return make

