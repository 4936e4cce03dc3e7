"""The `prune` stage: drop the routed experts a plan does not keep, renumber the rest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError, UsageError
from kconvert.gpu.budget import GpuRequest
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.arch import arch_of
from kconvert.model.expert_parallel import even_counts_near, splits_on_common_ep, uneven_ep_reason
from kconvert.model.names import Role, TensorName
from kconvert.plugins.pruning import (
    COMPENSATIONS,
    CRITERIA,
    NO_COMPENSATION,
    NO_REPAIR,
    PRUNE,
    REPAIRS,
)
from kconvert.plugins.registry import Declaration, Registry
from kconvert.pruning.plan import PLAN_FILE, PruneLayer, PrunePlan, load_plan
from kconvert.pruning.reap import (
    compensated_tensors,
    moe_layers,
    repaired_tensors,
    routing_limits,
)
from kconvert.stages.base import CALIBRATION_OPTIONS, StageKind

if TYPE_CHECKING:
    from kconvert.pruning.kinds import CompensationKind, RepairKind


def _kind(registry: Registry, option: str, name: str) -> Declaration:
    """The declared kind `name` of `registry` (--OPTION), or the error a recipe's unknown one
    gets."""
    found = registry.get(PRUNE[0], name)
    if found is None:
        raise KconvertError(f"prune: {option} {name!r} is not one of "
                            f"{list(registry.names(PRUNE[0]))}")
    return found


def repair_kind(name: str) -> type[RepairKind]:
    return _kind(REPAIRS, "repair", name).load()


def compensation_kind(name: str) -> type[CompensationKind]:
    return _kind(COMPENSATIONS, "compensate", name).load()


class PruneRecord(StageRecord):
    kept_per_layer: int
    layers: int = Field(description="MoE layers the plan covers")
    plan: str = Field(description="sha256 of the plan file written as reap-plan.json")
    repair: str | None = Field(default=None, description="router repair method (bias or "
                               "router); absent: none")
    compensate: str | None = Field(default=None, description="down_proj compensation (shared "
                                   "or down); absent: none")
    data: dict | None = Field(default=None, description="--data: the calibration data (sha256, "
                              "seed) and what of it was used (samples: sequences, padded last "
                              "one included; seq_len; tokens: real tokens); absent: a plan or "
                              "statistics given")


@dataclass(frozen=True)
class Prune(Stage):
    """Drop the routed experts a plan does not keep and renumber the rest 0..N-1.

    Kept experts keep their bytes (whatever their format) under new ids; the router's gate
    rows and e_score_correction_bias entries are sliced to the kept ids, in the same order,
    or, with router repair, replaced by the repaired rows the plan records.
    """

    keep: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, kept source ids ascending)
    plan_json: str = ""  # the plan file's text, written to DST as reap-plan.json
    repair: str = NO_REPAIR.name  # the repair and compensation kinds, by name
    compensate: str = NO_COMPENSATION.name
    # (output name, tensor) of every repaired router and re-fitted down_proj
    replaced: tuple[tuple[str, torch.Tensor], ...] = field(default=(), compare=False)
    # the directory the re-fitted matrices were spilled to (under DST's state folder), removed
    # when the run ends
    spill: Path | None = field(default=None, compare=False)
    # --data: what identifies the calibration data and what of it was used (PruneRecord.data)
    data: dict | None = None
    # the layers whose repair / compensation the guard applied or refused (`summary`)
    outcomes: tuple[tuple[str, int], ...] = ()
    name: str = "prune"

    @cached_property
    def _new_id(self) -> dict[int, dict[int, int]]:
        return {layer: {old: new for new, old in enumerate(ids)} for layer, ids in self.keep}

    @cached_property
    def _rows(self) -> dict[int, tuple[int, ...]]:
        return dict(self.keep)

    @property
    def kept(self) -> int:
        return len(self.keep[0][1])

    def rename(self, tn: TensorName) -> tuple[str | None, tuple[int, ...] | None]:
        if tn.layer not in self._new_id:
            return tn.name, None
        if tn.role is Role.ROUTED_EXPERT:
            new = self._new_id[tn.layer].get(tn.expert)
            return (None, None) if new is None else (tn.with_expert(new).name, None)
        if tn.role in (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS):
            return tn.name, self._rows[tn.layer]
        return tn.name, None

    def replaced_rows(self) -> dict[str, torch.Tensor]:
        return dict(self.replaced)

    def edit_config(self, text_config: dict) -> None:
        # Group-limited routing needs equal experts per group; kept ids rarely are, so routing
        # falls back to one group (Kimi already has n_group = topk_group = 1).
        arch = arch_of(text_config)  # DeepSeek-V3's key names or Kimi-K3's
        text_config[arch.experts_key] = self.kept
        text_config[arch.groups_key] = 1
        text_config["topk_group"] = 1

    def record(self) -> PruneRecord:
        record = PruneRecord(kept_per_layer=self.kept, layers=len(self.keep),
                             plan=hashlib.sha256(self.plan_json.encode()).hexdigest())
        if repair_kind(self.repair).fits:  # unset otherwise: manifests without repair unchanged
            record.repair = self.repair
        if compensation_kind(self.compensate).refits:
            record.compensate = self.compensate
        if self.data is not None:
            record.data = self.data
        return record

    def summary(self) -> dict[str, int]:
        return dict(self.outcomes)

    def output_files(self) -> dict[str, str]:
        return {PLAN_FILE: self.plan_json}

    def close(self) -> None:
        if self.spill is not None:
            shutil.rmtree(self.spill, ignore_errors=True)


def build(settings: dict, prune: Prune | None) -> Prune:
    # The plan is data, not a recipe setting: `prepare` makes the stage from a plan checked
    # against the opened source (prune_stage), repaired as `repair` says.
    if prune is None:
        raise KconvertError("a prune stage needs a plan (kconvert reap ... --plan FILE | "
                            "--stats DIR | --data FILE)")
    repair = settings.get("repair", NO_REPAIR.name)
    repair_kind(repair)
    if repair != prune.repair:
        raise KconvertError(f"prune: repair {repair!r} asked, but the plan's router rows are "
                            f"repaired by {prune.repair!r} (router repair needs --data)")
    compensate = settings.get("compensate", NO_COMPENSATION.name)
    compensation_kind(compensate)
    if compensate != prune.compensate:
        raise KconvertError(f"prune: compensate {compensate!r} asked, but the plan's matrices "
                            f"are {prune.compensate!r} (compensation needs --data)")
    return prune


def prune_stage(plan: PrunePlan, ckpt: Checkpoint,
                rows: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                matrices: dict[str, torch.Tensor] | None = None) -> Prune:
    """Check a plan against the checkpoint and make the stage that applies it. `rows`: per
    layer the repaired router (gate rows, bias) to write, which the plan's repair records
    describe; `matrices`: output name -> re-fitted down_proj, which its compensation records
    hash; a plan with such records needs them (they are not in the plan file)."""
    text = ckpt.text_config
    n_routed, top_k = routing_limits(ckpt)
    layers = moe_layers(ckpt)
    planned = {int(k): v.keep for k, v in plan.layers.items()}
    extra = sorted(set(planned) - set(layers))
    if extra:
        raise KconvertError(f"plan names layers {extra} that have no routed experts")
    for layer, count in layers.items():
        if layer not in planned:
            kind = ("MTP/nextn layer" if layer >= text.get("num_hidden_layers", layer + 1)
                    else "MoE layer")
            raise KconvertError(f"{kind} {layer} is not in the plan; every MoE layer (MTP "
                                "included) must be pruned the same way", tensor=f"layers.{layer}")
        if count != n_routed:
            raise KconvertError(f"layer {layer} has {count} routed experts, config says "
                                f"{n_routed}", tensor=f"layers.{layer}")
        if planned[layer][-1] >= count:
            raise KconvertError(f"plan keeps expert {planned[layer][-1]} of layer {layer}, which "
                                f"has {count}", tensor=f"layers.{layer}")
    sizes = {len(k) for k in planned.values()}
    if len(sizes) != 1:
        raise KconvertError(f"plan keeps different numbers of experts per layer {sorted(sizes)}; "
                            "config.json has one expert count")
    kept = sizes.pop()
    if kept < top_k:
        raise KconvertError(f"cannot keep {kept} experts: fewer than "
                            f"{arch_of(text).top_k_key}={top_k}")
    plan_json = json.dumps(plan.model_dump(mode="json", exclude_none=True), indent=1,
                           sort_keys=True)
    return Prune(keep=tuple((layer, tuple(planned[layer])) for layer in layers),
                 plan_json=plan_json, repair=plan.repair or NO_REPAIR.name,
                 compensate=plan.compensation or NO_COMPENSATION.name,
                 replaced=repaired_tensors(plan, ckpt, rows or {})
                 + compensated_tensors(plan, matrices or {}), outcomes=guard_outcomes(plan))


@dataclass(frozen=True)
class Guard:
    """A re-fit whose guard the plan records per layer: the summary's keys
    (`KEY_applied_layers`, `KEY_refused_layers`), its name in the closing line and what a
    refused layer keeps."""

    key: str
    name: str
    kept: str
    record: Callable[[PruneLayer], object]


GUARDS = (Guard("repair", "router repair", "the source's", lambda v: v.repair),
          Guard("compensation", "compensation", "the source's", lambda v: v.compensation),
          Guard("learned", "learned compensation", "the closed form's",
                lambda v: v.compensation and v.compensation.learned))


def guard_outcomes(plan: PrunePlan) -> tuple[tuple[str, int], ...]:
    """For the manifest's summary: the layers whose router repair, compensation and learned
    compensation the guard applied, and those it refused (their source rows / matrices
    written; for learned compensation the closed form's)."""
    out = []
    for guard in GUARDS:
        what = guard.key
        records = [r for v in plan.layers.values() if (r := guard.record(v)) is not None]
        if records:
            applied = sum(r.applied for r in records)
            out += [(f"{what}_applied_layers", applied),
                    (f"{what}_refused_layers", len(records) - applied)]
    return tuple(out)


def prepare(stages: tuple[dict, ...], options: dict, gpu: GpuRequest
            ) -> Callable[[Checkpoint], Prune]:
    """The Prune stage from --plan, or a plan from --stats or --data (REAP calibration, with
    router repair and compensation in the same pass when --repair, --compensate or the recipe
    asks for them, its micro-batch within the run's GPU memory budget, `gpu`'s;
    kconvert.stages.prune_data). The options are checked now, before the source is opened;
    `options` also holds the run's `dst`, `dry_run` and `echo` (kconvert.driver.commands)."""
    plan, stats, data = options.get("plan"), options.get("stats"), options.get("data")
    repair = options.get("repair") or next(
        (s["repair"] for s in stages if s["stage"] == Prune.name and "repair" in s),
        NO_REPAIR.name)
    compensate = options.get("compensate") or next(
        (s["compensate"] for s in stages if s["stage"] == Prune.name and "compensate" in s),
        NO_COMPENSATION.name)
    # what needs --data first: the message names the option that needs it
    if _kind(REPAIRS, "repair", repair).needs == "data" and data is None:
        raise UsageError(f"--repair {repair} fits the router during REAP's calibration, which "
                         "needs calibration data: give --data FILE")
    if _kind(COMPENSATIONS, "compensate", compensate).needs == "data" and data is None:
        raise UsageError(f"--compensate {compensate} re-fits matrices during REAP's calibration, "
                         "which needs calibration data: give --data FILE")
    if sum(x is not None for x in (plan, stats, data)) > 1:
        raise UsageError("give only one of --plan, --stats and --data")
    if plan is None and stats is None and data is None:
        raise UsageError("give --data FILE, --stats DIR or --plan FILE")

    def make(ckpt: Checkpoint) -> Prune:
        from kconvert.pruning.reap import (
            check_plan_keep,
            keep_count,
            mtp_moe_layers,
            note_mtp_layers,
            plan_from_scores,
            scores_from_stats,
        )
        from kconvert.stages import prune_data

        echo = options.get("echo") or (lambda _message: None)
        if plan is not None:
            loaded = load_plan(plan)
            check_plan_keep(loaded, ckpt, options.get("keep"), options.get("prune_ratio"), plan)
            planned = prune_stage(loaded, ckpt)
            check_ep_split(planned.kept, ckpt, bool(options.get("allow_uneven_ep")), echo)
            return planned
        keep = keep_count(ckpt, options.get("keep"), options.get("prune_ratio"))
        # before the statistics are read or the calibration runs
        check_ep_split(keep, ckpt, bool(options.get("allow_uneven_ep")), echo)
        criterion = options.get("criterion") or CRITERIA.default(PRUNE[0]).name
        if stats is not None:
            scores = scores_from_stats(stats)
            made = plan_from_scores(scores, keep, criterion, ckpt.identity,
                                    mtp_moe_layers(ckpt))
            prune_data.note_unrouted(made, scores, echo)
            note_mtp_layers(made, echo)
            return prune_stage(made, ckpt)
        made = prune_data.from_data(ckpt, options, gpu, keep, criterion, repair_kind(repair),
                                    compensation_kind(compensate), echo)
        try:
            stage = prune_stage(made.plan, ckpt, made.rows, made.matrices)
        except BaseException:
            if made.spill is not None:
                shutil.rmtree(made.spill, ignore_errors=True)
            raise
        if made.placeholders is not None:  # a dry run: what the run would repair or re-fit
            stage = dataclasses.replace(stage, repair=repair, compensate=compensate,
                                        replaced=made.placeholders)
        return dataclasses.replace(stage, spill=made.spill, data=made.data)

    return make


def check_ep_split(kept: int, ckpt: Checkpoint, allow: bool, echo: Callable[[str], None]
                   ) -> None:
    """A keep that no common expert-parallel size divides is a usage error naming the sizes
    that do and the nearest counts that every common size divides; with --allow-uneven-ep
    (`allow`) a warning line through `echo`."""
    if splits_on_common_ep(kept):
        return
    n_routed, top_k = routing_limits(ckpt)
    instead = " or ".join(map(str, even_counts_near(kept, top_k, n_routed)))
    message = f"keep {kept}: {uneven_ep_reason(kept)}"
    if allow:
        echo(f"kconvert: warning: {message}; engines refuse to split it across GPUs "
             "(--allow-uneven-ep)")
        return
    raise UsageError(f"{message}; keep {instead}, or pass --allow-uneven-ep" if instead else
                     f"{message}; pass --allow-uneven-ep")


KIND = StageKind(Prune.name, build, PruneRecord, input_type=Prune, prepare=prepare,
                 settings=("repair", "compensate"),
                 input_options=("keep", "prune_ratio", "allow_uneven_ep", "criterion", "plan",
                                "stats", *CALIBRATION_OPTIONS, "save_stats"))
