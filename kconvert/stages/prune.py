"""The `prune` stage: drop the routed experts a plan does not keep, renumber the rest."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import torch
from pydantic import Field

from kconvert.errors import KconvertError
from kconvert.model.names import Role, TensorName
from kconvert.pruning.plan import PLAN_FILE
from kconvert.stages.base import CALIBRATION_OPTIONS, Stage, StageKind, StageRecord


class PruneRecord(StageRecord):
    kept_per_layer: int
    layers: int = Field(description="MoE layers the plan covers")
    plan: str = Field(description="sha256 of the plan file written as reap-plan.json")
    repair: str | None = Field(default=None, description="router repair method (bias or "
                               "router); absent: none")
    compensate: str | None = Field(default=None, description="down_proj compensation (shared "
                                   "or down); absent: none")


@dataclass(frozen=True)
class Prune(Stage):
    """Drop the routed experts a plan does not keep and renumber the rest 0..N-1.

    Kept experts keep their bytes (whatever their format) under new ids; the router's gate
    rows and e_score_correction_bias entries are sliced to the kept ids, in the same order,
    or, with router repair, replaced by the repaired rows the plan records.
    """

    keep: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, kept source ids ascending)
    plan_json: str = ""  # the plan file's text, written to DST as reap-plan.json
    repair: str = "none"
    compensate: str = "none"
    # (output name, tensor) of every repaired router and re-fitted down_proj
    replaced: tuple[tuple[str, torch.Tensor], ...] = field(default=(), compare=False)
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
        text_config["n_routed_experts"] = self.kept
        text_config["n_group"] = 1
        text_config["topk_group"] = 1

    def record(self) -> PruneRecord:
        record = PruneRecord(kept_per_layer=self.kept, layers=len(self.keep),
                             plan=hashlib.sha256(self.plan_json.encode()).hexdigest())
        if self.repair != "none":  # left unset otherwise: manifests without repair unchanged
            record.repair = self.repair
        if self.compensate != "none":
            record.compensate = self.compensate
        return record

    def output_files(self) -> dict[str, str]:
        return {PLAN_FILE: self.plan_json}


REPAIRS = ("none", "bias", "router")  # kconvert.pruning.repair fits REPAIRS[1:]
COMPENSATIONS = ("none", "shared", "down")  # kconvert.pruning.compensate


def build(settings: dict, prune: Prune | None) -> Prune:
    # The plan is data, not a recipe setting: the command makes the stage from a plan checked
    # against the opened source (kconvert.pruning.reap.prune_stage), repaired as `repair` says.
    if prune is None:
        raise KconvertError("a prune stage needs a plan (kconvert reap ... --plan FILE | "
                            "--stats DIR | --data FILE)")
    repair = settings.get("repair", "none")
    if repair not in REPAIRS:
        raise KconvertError(f"prune: repair {repair!r} is not one of {list(REPAIRS)}")
    if repair != prune.repair:
        raise KconvertError(f"prune: repair {repair!r} asked, but the plan's router rows are "
                            f"repaired by {prune.repair!r} (router repair needs --data)")
    compensate = settings.get("compensate", "none")
    if compensate not in COMPENSATIONS:
        raise KconvertError(f"prune: compensate {compensate!r} is not one of "
                            f"{list(COMPENSATIONS)}")
    if compensate != prune.compensate:
        raise KconvertError(f"prune: compensate {compensate!r} asked, but the plan's matrices "
                            f"are {prune.compensate!r} (compensation needs --data)")
    return prune


KIND = StageKind(Prune.name, build, PruneRecord, input_type=Prune,
                 settings=("repair", "compensate"),
                 input_options=("keep", "prune_ratio", "criterion", "plan", "stats",
                                *CALIBRATION_OPTIONS, "save_stats"))
