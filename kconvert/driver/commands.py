"""A conversion command from its options: the checks the options must pass, what each stage
kind of the recipe prepares from the opened source (StageKind.prepare), then the driver
(`convert.convert`). The Python API (kconvert.api) and the command line (kconvert.cli.convert)
both run conversions through `run_conversion`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kconvert.common.options import ONLY_WITH
from kconvert.driver import convert
from kconvert.driver.recipes import Recipe, check_format, check_options, load_recipe
from kconvert.errors import UsageError
from kconvert.gpu.budget import GpuRequest
from kconvert.io.checkpoint import Checkpoint
from kconvert.records.manifest import Manifest
from kconvert.stages import KINDS
from kconvert.stages.base import stage_settings
from kconvert.stages.quantize import parse_targets


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
    check_run_control(run)
    if given.get("keep") is not None and given.get("prune_ratio") is not None:
        raise UsageError("give --keep N or --prune-ratio R, not both")
    if "targets" in given:
        parse_targets(given["targets"])
    recipe = load_recipe(recipe_name)
    check_options(recipe, given)
    check_format(recipe, given.get("format"))
    check_stages(recipe, given)
    if run.stream and "data" in given:
        raise UsageError("--stream reads each source shard once, as it arrives, and --data "
                         "calibrates on the source (every shard) before or beside the "
                         "conversion, which would read it twice: download the model first (run "
                         "without --stream), or give --stats from `kconvert calibrate` (or "
                         "--plan) instead of --data")
    for option, needs in ONLY_WITH.items():
        if option in given and not set(needs) & set(given):
            raise UsageError(f"--{option.replace('_', '-')} applies only with "
                             + " or ".join(f"--{n.replace('_', '-')}" for n in needs))
    settings = {k: v for k, v in given.items()
                if any(k in kind.settings for kind in KINDS.values())}
    # One GpuRequest for the run: a stage's preparation (REAP's calibration) and the
    # conversion after it share the budget it resolves.
    gpu = GpuRequest(run.device, run.gpu_memory)
    # Through the module, so that a test can stand in for convert.convert.
    # What a stage's preparation gets beside the options: the run's DST (REAP's spill lives
    # in its state folder), whether it is a dry run (nothing is calibrated) and where its
    # notes go.
    prepared = {**given, "dst": str(dst), "dry_run": run.dry_run, "echo": echo}
    return convert.convert(src, dst, recipe, settings, run, revision=revision, echo=echo,
                           prepare=preparer(recipe, prepared, gpu), gpu=gpu,
                           forward="data" in given)


def check_stages(recipe: Recipe, given: dict[str, object]) -> None:
    """Each stage's settings with the options given, checked from the options alone
    (StageKind.check): before any stage's preparation reads its data."""
    tables = stage_settings(recipe.stages, given, KINDS)
    for at, table in enumerate(tables):
        check = KINDS[table["stage"]].check
        if check is not None:
            check(tables, at)


def check_run_control(run: convert.RunControl) -> None:
    """Run controls that do not go together (usage errors, exit 2)."""
    if run.resume and run.overwrite:
        raise UsageError("give --resume or --overwrite, not both")
    if run.trust_complete and not run.resume:
        raise UsageError("--trust-complete applies only with --resume")


def preparer(recipe: Recipe, options: dict, gpu: GpuRequest
             ) -> Callable[[Checkpoint], dict[str, object]] | None:
    """prepare(ckpt) for the driver: by stage kind, what the recipe's stages make from the
    opened source (StageKind.prepare, which checks the options now); None if nothing."""
    makers = {}
    tables = stage_settings(recipe.stages, options, KINDS)
    for name, kind in KINDS.items():
        if name in recipe.kinds and kind.prepare is not None:
            make = kind.prepare(tables, options, gpu)
            if make is not None:
                makers[name] = make
    if not makers:
        return None
    return lambda ckpt: {kind: make(ckpt) for kind, make in makers.items()}
