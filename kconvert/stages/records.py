"""What each stage records in the manifest, as typed models: the `options` of
kconvert-manifest.json are a RunRecord. The resume fingerprint hashes them, and `kconvert
audit` reads them (the p48 pattern and its targets, the kept expert count, the plan's hash).

A record holds the options that decide the output bytes; a field that was not set is left out
of the file (a record is dumped with exclude_unset), so adding an optional field changes no
existing manifest.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict:
        return self.model_dump(mode="json", exclude_unset=True)


class DequantRecord(StageRecord):
    dtype: str = Field(description="BF16, or F32 (INT4's q * scale exactly)")


class QuantizeRecord(StageRecord):
    targets: list[str] = Field(description="roles made NVFP4")
    format: str = Field(description="compressed-tensors | modelopt")
    block_scale: str = Field(description="FP8 block-scale rule: amax | mse")
    act_stats: str | None = Field(description="activation statistics file (W4A4), or None")


class PruneRecord(StageRecord):
    kept_per_layer: int
    layers: int = Field(description="MoE layers the plan covers")
    plan: str = Field(description="sha256 of the plan file written as reap-plan.json")


class SparsifyRecord(StageRecord):
    pattern: Literal["p48"]
    method: str = Field(description="magnitude | wanda | sparsegpt")
    group_size: int
    storage: str = Field(description="dense | pair-bitmask")
    targets: list[str] = Field(description="roles made paired-4:8 sparse")
    stats: str | None = Field(default=None, description="xxh3 of Wanda's stats.safetensors")
    percdamp: float | None = None
    blocksize: int | None = None
    data: dict | None = Field(default=None, description="SparseGPT's calibration data")


class DensifyRecord(StageRecord):
    pass


class RunRecord(BaseModel):
    """The manifest's `options`: the recipe and what each of its stages recorded."""

    model_config = ConfigDict(extra="forbid")

    recipe: str
    dequant: DequantRecord | None = None
    quantize: QuantizeRecord | None = None
    prune: PruneRecord | None = None
    sparsify: SparsifyRecord | None = None
    densify: DensifyRecord | None = None
