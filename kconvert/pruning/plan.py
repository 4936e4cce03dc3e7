"""Expert-pruning plans: which routed experts of each MoE layer a pruned checkpoint keeps.

A plan is JSON (`manifests/plan.schema.json` is generated from the models below:
`python -m kconvert.pruning.plan > manifests/plan.schema.json`; a test keeps the two in step):

    {"criterion": "reap",
     "layers": {"1": {"keep": [0, 3, 7, ...], "saliency": [...], "frequency": [...]}, ...}}

`keep` lists SOURCE expert ids in ascending source order; the expert at position i of `keep`
becomes expert i of the pruned layer, its router row is source row keep[i] and its
`e_score_correction_bias` entry source entry keep[i] (reap.md, "Pruning rewrite").
`saliency` and `frequency`, when given, have one value per SOURCE expert. With router repair
(`repair`), a layer's `repair` records the rows written instead (their hashes and the bias
values) and the errors that justified them. Layer keys are
decimal decoder-layer indices. Unknown extra fields are kept (a pruner may record more).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kconvert.errors import KconvertError, invalid_fields

PLAN_SCHEMA_ID = "kconvert-plan/1"
PLAN_FILE = "reap-plan.json"  # the plan a pruning run writes into its output


class LayerRepair(BaseModel):
    """Router repair of one pruned MoE layer (reap.md, "Router repair"): the rows written, and
    the block-output mean squared errors against the unpruned block on the calibration tokens
    (fit and held-out), before (the source rows sliced) and after repair."""

    method: str = Field(description="bias (e_score_correction_bias only) or router (kept gate "
                                    "rows and bias)")
    applied: bool = Field(description="false: repair did not lower the held-out error, so the "
                                      "source rows were written unchanged")
    fit_tokens: int
    heldout_tokens: int
    fit_mse_before: float
    fit_mse_after: float
    heldout_mse_before: float
    heldout_mse_after: float
    gate_rows_xxh3: list[str] = Field(
        description="per NEW expert: xxh3-64 (hex) of the written gate row's bytes (source dtype)")
    bias: list[float] = Field(
        description="per NEW expert: the written e_score_correction_bias entry (F32, exact)")

    @model_validator(mode="after")
    def _one_per_row(self) -> LayerRepair:
        if len(self.gate_rows_xxh3) != len(self.bias):
            raise ValueError(f"{len(self.gate_rows_xxh3)} gate row hashes but "
                             f"{len(self.bias)} bias entries")
        return self


class LearnedCompensation(BaseModel):
    """Learned compensation of one pruned MoE layer (reap.md, "Learned compensation"): the
    kept experts' gate, up and down trained against the unpruned block from the closed form's
    result, and the block-output mean squared errors of the routed experts' part before
    (the closed form's matrices as written) and after (the learned ones as written)."""

    applied: bool = Field(description="false: training did not lower the held-out error, so "
                                      "the closed form's matrices were written")
    steps: int = Field(description="Adam steps per batch of kept experts")
    lr: float = Field(description="the step, as a fraction of each matrix's RMS")
    batch: int = Field(description="kept experts trained together (block coordinate descent)")
    fit_mse_before: float
    fit_mse_after: float
    heldout_mse_before: float
    heldout_mse_after: float


class LayerCompensation(BaseModel):
    """Closed-form compensation of one pruned MoE layer (reap.md, "Compensation"): the
    down_proj matrices re-fitted by least squares, and the block-output mean squared errors
    against the unpruned block (fit and held-out tokens) before and after."""

    method: str = Field(description="shared (the shared expert's down_proj), down (the shared "
                                    "expert's and every kept expert's down_proj) or learned "
                                    "(down, then the kept experts trained: `learned`)")
    applied: bool = Field(description="false: the re-fit did not lower the held-out error, so "
                                      "the source matrices were written unchanged")
    fit_tokens: int
    heldout_tokens: int
    ridge: float = Field(description="the ridge (relative to the mean Gram diagonal) this layer's "
                                     "re-fit used: of those tried, the lowest held-out error")
    fit_mse_before: float
    fit_mse_after: float
    heldout_mse_before: float
    heldout_mse_after: float
    matrices_xxh3: dict[str, str] = Field(
        default_factory=dict, description="OUTPUT tensor name -> xxh3-128 (hex) of its bytes "
                                          "as written, for every parameter of every re-fitted "
                                          "matrix (in the source's format: a BF16 weight, or "
                                          "e.g. INT4's weight_packed, weight_scale and "
                                          "weight_shape); empty when not applied")
    block_scale: str | None = Field(
        default=None, description="the block-scale rule (amax | mse) the quantized re-fitted "
                                  "matrices were encoded with; absent: all dense")
    learned: LearnedCompensation | None = Field(
        default=None, description="--compensate learned: the training from the closed form's "
                                  "result and its own guard")


class PruneLayer(BaseModel):
    """The plan for one MoE layer."""

    model_config = ConfigDict(extra="allow")

    keep: list[int] = Field(
        description="source expert ids kept, strictly ascending; new id i <- source id keep[i]")
    saliency: list[float] | None = Field(
        default=None, description="per SOURCE expert: the score the criterion ranked by "
                                  "(REAP: mean over routed tokens of gate weight x ||expert out||)")
    frequency: list[float] | None = Field(
        default=None, description="per SOURCE expert: how often it was routed on the calibration "
                                  "data (count or fraction)")
    repair: LayerRepair | None = Field(
        default=None, description="router repair of this layer; absent: the source rows keep[i]")
    compensation: LayerCompensation | None = Field(
        default=None, description="down_proj re-fit of this layer (learned: and the kept "
                                  "experts' training); absent: source matrices")
    rule: str | None = Field(
        default=None, description="how `keep` was chosen where no criterion score could be: "
                                  "'uncalibrated-lowest-ids' for a multi-token-prediction "
                                  "layer the calibration does not run (docs/mtp.md); absent: "
                                  "by the plan's criterion")

    @field_validator("keep")
    @classmethod
    def _ascending(cls, keep: list[int]) -> list[int]:
        if not keep:
            raise ValueError("keep is empty: a layer must keep at least one expert")
        if keep[0] < 0:
            raise ValueError(f"keep has a negative expert id {keep[0]}")
        for a, b in itertools.pairwise(keep):
            if b <= a:
                raise ValueError(f"keep must be strictly ascending source ids; {a} then {b}")
        return keep

    @model_validator(mode="after")
    def _per_source_lengths(self) -> PruneLayer:
        lengths = {name: len(v) for name, v in (("saliency", self.saliency),
                                                ("frequency", self.frequency)) if v is not None}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"saliency and frequency have different lengths {lengths}")
        if self.repair is not None and len(self.repair.bias) != len(self.keep):
            raise ValueError(f"repair records {len(self.repair.bias)} rows but keep has "
                             f"{len(self.keep)}")
        for name, n in lengths.items():
            if self.keep[-1] >= n:
                raise ValueError(f"keep names expert {self.keep[-1]} but {name} has only {n} "
                                 "entries (one per source expert)")
        return self


class PrunePlan(BaseModel):
    """An expert-pruning plan for a Kimi-K2 / DeepSeek-V3 MoE checkpoint."""

    model_config = ConfigDict(extra="allow")

    schema_id: str = Field(default=PLAN_SCHEMA_ID, description="format version of this file")
    criterion: str | None = Field(
        default=None, description="how experts were ranked: reap, frequency, router_l2, ...")
    routing: str | None = Field(
        default=None, description="routing convention used for the statistics, e.g. 'model' "
                                  "(sigmoid + e_score_correction_bias top-k, as served) or "
                                  "'softmax' (the REAP reference code's approximation)")
    source: dict | None = Field(default=None, description="identity of the source checkpoint")
    repair: str | None = Field(
        default=None, description="router repair method (bias or router); absent: none, every "
                                  "router row and bias entry is the source's")
    compensation: str | None = Field(
        default=None, description="compensation (shared, down or learned); absent: none, every "
                                  "expert matrix is the source's")
    n_routed_experts: int | None = Field(
        default=None, description="routed experts per layer in the SOURCE")
    layers: dict[str, PruneLayer] = Field(
        description="decimal decoder-layer index -> that layer's plan; every MoE layer is listed")

    @field_validator("layers")
    @classmethod
    def _layer_keys(cls, layers: dict[str, PruneLayer]) -> dict[str, PruneLayer]:
        for key in layers:
            if not key.isdigit():
                raise ValueError(f"layer key {key!r} is not a decimal layer index")
        return layers

    @model_validator(mode="after")
    def _within_source(self) -> PrunePlan:
        if self.n_routed_experts is not None:
            for key, layer in self.layers.items():
                if layer.keep[-1] >= self.n_routed_experts:
                    raise ValueError(f"layer {key} keeps expert {layer.keep[-1]} but the source "
                                     f"has {self.n_routed_experts} routed experts")
        return self

    def keep(self, layer: int) -> list[int] | None:
        entry = self.layers.get(str(layer))
        return None if entry is None else entry.keep


def parse_plan(data: dict | str | bytes, where: str = "plan") -> PrunePlan:
    try:
        if isinstance(data, dict):
            return PrunePlan.model_validate(data)
        return PrunePlan.model_validate_json(data)
    except ValidationError as exc:
        raise KconvertError(f"invalid plan: {invalid_fields(exc)}", file=where) from exc


def load_plan(path: str | Path) -> PrunePlan:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KconvertError(f"cannot read plan: {exc}", file=str(path)) from exc
    return parse_plan(text, str(path))


def plan_json_schema() -> dict:
    return PrunePlan.model_json_schema()


if __name__ == "__main__":
    print(json.dumps(plan_json_schema(), indent=2, sort_keys=True))
