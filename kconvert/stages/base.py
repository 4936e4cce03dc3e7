"""The stage kind: how recipes and commands name a stage, what they may set, what it prepares
from the opened source, and how it is built.

A conversion is a list of stages (their hooks: kconvert.engine.stage.Stage). At plan time each
stage may claim a source module and say how it leaves: decoded and re-encoded by an output
codec, or (when no stage claims it) copied byte for byte. The engine then decodes only what
some stage claimed, runs the stages' weight transforms on the fp32 values, and encodes with the
module's output codec. Each stage module declares its `StageKind` (KIND); kconvert.stages.KINDS
lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import create_model

from kconvert.common.options import calibration_run
from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError, UsageError
from kconvert.gpu.budget import GpuRequest
from kconvert.gpu.parts import GpuWork
from kconvert.gpu.plan import GpuPlan
from kconvert.gpu.shapes import Shapes
from kconvert.io.checkpoint import Checkpoint
from kconvert.methods import Method
from kconvert.methods.hessians import Calibration
from kconvert.plugins.methods import METHODS
from kconvert.plugins.registry import Declaration

# The command-line options that say which calibration data a command reads and how it runs
# (REAP's saliency for a prune stage, a data-driven method's inputs for the others).
CALIBRATION_OPTIONS = ("data", "samples", "seq_len", "batch_size", "seed", "allow_short_data")
# What a plug-in's need is given by (kconvert.plugins.registry.NEEDS).
NEED_OPTIONS = {"data": "calibration data: --data FILE",
                "stats": "--stats DIR (from `kconvert calibrate`)"}


@dataclass(frozen=True)
class StageKind:
    """A kind of stage, as a recipe's `stage = "..."` and the command line name it."""

    name: str
    # (settings, input) -> the stage; `settings` holds only the settings given (recipe, then
    # command line), so the defaults live here, and so do the checks of their values.
    build: Callable[[dict[str, Any], Any], Stage]
    # What the stage's record() returns: its entry in the manifest's options (RunRecord).
    record_type: type[StageRecord]
    # Recipe keys, which are also long command-line options with `_` for `-` (`block_scale` is
    # --block-scale); the command line wins over the recipe.
    settings: tuple[str, ...] = ()
    # Command-line options only, from which a command prepares the stage's input out of the
    # opened source (a pruning plan checked against it, calibration inputs).
    input_options: tuple[str, ...] = ()
    # What a command prepares (an instance is handed to `build`); None: the stage takes none.
    input_type: type | None = None
    # (the recipe's [[stages]] tables with the options given laid over them (`stage_settings`),
    # this stage's index among them) -> None: raises for settings that are wrong or do not go
    # together, from the options alone, so that a command refuses them before it reads
    # anything (its calibration data included). `build` runs the same check on its settings.
    check: Callable[[tuple[dict[str, Any], ...], int], None] | None = None
    # (kind, why): a stage kind that must come later in the same recipe.
    followed_by: tuple[str, str] | None = None
    # What it does to the modules it claims, for the recipe's order and the manifest's
    # summary: decodes them all (a later stage may not encode before it), decides values a
    # later encode writes (`encodes`), quantizes them (their error is measured and counted),
    # makes them paired-4:8 sparse.
    decodes: bool = False
    encodes: bool = False
    quantizes: bool = False
    sparsifies: bool = False
    # (the recipe's [[stages]] tables with the options given laid over them (`stage_settings`),
    # the options given by name, the run's GPU request: its device, and the budget resolved
    # once for the run) ->
    # make(ckpt), which makes the stage's input (an input_type) from the opened source, or None
    # when this run needs none. Called once per run before the source is opened, so the
    # options are checked before anything is read.
    prepare: Callable[[tuple[dict, ...], dict[str, Any], GpuRequest],
                      Callable[[Checkpoint], Any] | None] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """Every option name the kind takes, recipe settings and command-line inputs."""
        return self.settings + self.input_options


class MethodStage(Stage):
    """A stage whose claimed modules get their values from a method (kconvert.methods): the
    engine's hooks that are the method's (its layer order, work-item size, GPU footprint and
    plan, its files and its close) go to it."""

    method: Method

    @property
    def ordered_layers(self) -> bool:  # type: ignore[override]
        return self.method.ordered_layers

    def input_files(self) -> list[str]:
        return self.method.input_files()

    def close(self) -> None:
        self.method.close()

    def work_elems(self, device: torch.device) -> int | None:
        return self.method.work_elems(device)

    def gpu_work(self, shapes: Shapes) -> GpuWork | None:
        return self.method.gpu_work(shapes)

    def use_gpu_plan(self, plan: GpuPlan) -> None:
        self.method.use_gpu_plan(plan)


def stage_settings(stages: tuple[dict, ...], given: dict[str, Any],
                   kinds: dict[str, StageKind]) -> tuple[dict[str, Any], ...]:
    """Each [[stages]] table with the options given by name laid over it: a given setting
    goes to the first stage of the recipe that takes it (`--method` of a p48 recipe is its
    sparsify stage's: one meaning per command), a command-line input to every stage that
    takes it."""
    out, placed = [], set()
    for spec in stages:
        kind = kinds[spec["stage"]]
        mine = {k: v for k, v in given.items()
                if v is not None and k in kind.settings and k not in placed}
        placed |= set(mine)
        inputs = {k: v for k, v in given.items() if v is not None and k in kind.input_options}
        out.append({**spec, **mine, **inputs})
    return tuple(out)


def named_method(stage: str, name: str | None) -> Declaration:
    """The method `name` of stage kind `stage` (None: the kind's default); a name that is not
    one of the kind's is a usage error."""
    try:
        return METHODS.named(stage, name, "method")
    except KconvertError as exc:
        raise UsageError(str(exc)) from exc


def method_settings(stage: str, settings: dict[str, Any]) -> tuple[type[Method], dict]:
    """The method a stage's settings name (its kind's default where none) and the settings that
    are that method's own; a setting of another of the stage's methods is refused."""
    declared = named_method(stage, settings.get("method"))
    mine = declared.settings.model_fields
    for key in METHODS.setting_names(stage):
        if key not in mine and settings.get(key) is not None:
            users = [n for n, d in METHODS.of(stage).items() if key in d.settings.model_fields]
            raise UsageError(f"--{key.replace('_', '-')} serves --method {' or '.join(users)}; "
                             f"this {stage} stage's method is {declared.name}")
    own = declared.check({k: settings[k] for k in mine if settings.get(k) is not None})
    return declared.load(), own


def with_method_records(base: type[StageRecord], stage: str) -> type[StageRecord]:
    """Stage kind `stage`'s record: `base` (the stage's own fields) and the fields its
    methods declare they record (kconvert.plugins.registry.Declaration.record), each optional:
    a method sets only its own."""
    return create_model(base.__name__, __base__=base, __module__=base.__module__,
                        **METHODS.record_fields(stage))


def check_needs(method: type[Method], calibration: Calibration | None, stats: str | None
                ) -> None:
    """A method built without what it needs (a recipe run through the Python API without the
    option): the error names the option."""
    have = {"data": calibration, "stats": stats}
    if method.needs is not None and have[method.needs] is None:
        raise KconvertError(f"--method {method.name} needs {NEED_OPTIONS[method.needs]}")


def _uses(table: dict[str, Any], option: str) -> bool:
    """Whether the stage of a table laid over by `stage_settings` uses a given --data or
    --stats: a stage with methods when its method needs it, another when it takes it."""
    if METHODS.of(table["stage"]):
        return METHODS.named(table["stage"], table.get("method"), "method").needs == option
    return option in table


def prepare_method(stage: str) -> Callable[[tuple[dict, ...], dict[str, Any], GpuRequest],
                                          Callable[[Checkpoint], Calibration] | None]:
    """StageKind.prepare of a stage kind whose method may need calibration data: the method's
    calibration from --data (None for a method that needs none). Refuses --data or --stats that
    neither this run's method nor another stage of the recipe uses, and a method without
    what it needs."""

    def prepare(stages: tuple[dict, ...], options: dict[str, Any], gpu: GpuRequest
                ) -> Callable[[Checkpoint], Calibration] | None:
        tables = [t for t in stages if t["stage"] == stage]
        if not tables:
            return None
        method = named_method(stage, tables[0].get("method"))
        for option, need in (("data", "data"), ("stats", "stats")):
            if options.get(option) is None or method.needs == need:
                continue
            # an option none of this kind's methods takes is another stage kind's to judge
            if not any(m.needs == need for m in METHODS.of(stage).values()) or any(
                    _uses(t, option) for t in stages if t["stage"] != stage):
                continue
            # the message is the same whichever stage kind of the recipe finds it first
            users = [n for t in stages for n, m in METHODS.of(t["stage"]).items()
                     if m.needs == need]
            chosen = ", ".join(f"{t['stage']} method is "
                               f"{METHODS.named(t['stage'], t.get('method'), 'method').name}"
                               for t in stages if METHODS.of(t["stage"]))
            raise UsageError(f"--{option} serves --method {' or '.join(users)}; this run's "
                             f"{chosen}")
        if method.needs == "stats" and tables[0].get("stats") is None:
            raise UsageError(f"--method {method.name} needs {NEED_OPTIONS['stats']}")
        if method.needs != "data":
            return None
        if options.get("data") is None:
            raise UsageError(f"--method {method.name} needs {NEED_OPTIONS['data']}")

        def make(ckpt: Checkpoint) -> Calibration:
            from kconvert.calibrate.data import shortfall

            samples, seq_len, batch_size, seed = calibration_run(options,
                                                                 method.load().samples)
            # the data's checks before any work (vocabulary, --samples x --seq-len filled)
            return Calibration.from_file(
                ckpt, options["data"], samples, seq_len, batch_size, seed, gpu.device,
                shortfall(bool(options.get("allow_short_data")),
                          options.get("echo") or (lambda _message: None)))

        return make

    return prepare
