"""The `sparsify` stage (paired-4:8 on routed experts, docs/p48.md).

Sparsify claims the routed experts' gate/up/down (shared experts are never sparsified) and its
method (kconvert.methods) transforms their decoded fp32 weights before the quantize stage
encodes them: magnitude and wanda choose each chunk's pairs by a score, sparsegpt prunes and
quantizes jointly on calibration inputs (kconvert.methods.sparsegpt). Every mask is chosen per
chunk before any block scale, so NVFP4's block scales are computed after the mask (a pruned
outlier never inflates a scale); pruned pairs are +0.0, encoded 0x00.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from kconvert.common.options import SPARSIFY_STORAGES
from kconvert.engine.stage import StageRecord
from kconvert.errors import KconvertError
from kconvert.formats.linear import ModuleWork
from kconvert.methods import Method, MethodInputs
from kconvert.methods.hessians import Calibration
from kconvert.model.names import Role
from kconvert.plugins.methods import METHODS
from kconvert.stages.base import (
    CALIBRATION_OPTIONS,
    MethodStage,
    StageKind,
    check_needs,
    method_settings,
    prepare_method,
    with_method_records,
)
from kconvert.stages.quantize import FORMAT, Quantize, check_sparse_form

GROUP_SIZES = (16, 32)


class SparsifyStageRecord(StageRecord):
    """The sparsify stage's own fields; SparsifyRecord adds its methods'."""

    pattern: Literal["p48"]
    method: str = Field(description="the mask selection method")
    group_size: int
    storage: str = Field(description="dense | pair-bitmask")
    targets: list[str] = Field(description="roles made paired-4:8 sparse")


SparsifyRecord = with_method_records(SparsifyStageRecord, "sparsify")


@dataclass(frozen=True)
class Sparsify(MethodStage):
    method: Method = field(compare=False)
    group_size: int = 16
    storage: str = "dense"
    name: str = "sparsify"

    def __post_init__(self) -> None:
        check_blocks(self.group_size, self.storage)


    def claim(self, m: ModuleWork) -> None:
        if m.tn.role is not Role.ROUTED_EXPERT:
            return
        if m.shape[1] % self.group_size:
            raise KconvertError(f"input dimension {m.shape[1]} is not a whole number of "
                                f"{self.group_size}-element scale blocks", tensor=m.module)
        m.group_size = self.group_size
        m.storage = self.storage
        m.transform = self.method
        m.stages.append(self.name)

    def record(self) -> SparsifyRecord:
        # `pattern` and `targets` are what `kconvert audit` keys its p48 check on.
        return SparsifyRecord(pattern="p48", group_size=self.group_size, storage=self.storage,
                              targets=[Role.ROUTED_EXPERT.value], **self.method.record())






def check_blocks(group_size: int, storage: str) -> None:
    """A paired-4:8 block size and storage kconvert writes (docs/p48.md)."""
    if group_size not in GROUP_SIZES:
        raise KconvertError(f"--group-size must be one of {GROUP_SIZES}")
    if storage not in SPARSIFY_STORAGES:
        raise KconvertError(f"unknown --storage {storage!r}; choose from {SPARSIFY_STORAGES}")


def check(tables: tuple[dict, ...], at: int) -> None:
    """The sparsify stage `tables[at]`'s settings, from the options alone (StageKind.check):
    its blocks must be a form the format of the quantize stage after it writes."""
    settings = tables[at]
    if settings.get("pattern", "p48") != "p48":
        raise KconvertError(f"unknown sparsity pattern {settings['pattern']!r}; only p48")
    group_size = settings.get("group_size", Sparsify.group_size)
    storage = settings.get("storage", Sparsify.storage)
    check_blocks(group_size, storage)
    method_settings(Sparsify.name, settings)
    quantize = next((t for t in tables[at + 1:] if t["stage"] == Quantize.name), None)
    if quantize is not None:
        check_sparse_form(quantize.get("format", FORMAT), group_size, storage)


def build(settings: dict, calibration: Calibration | None) -> Sparsify:
    check((settings,), 0)
    method, own = method_settings(Sparsify.name, settings)
    check_needs(method, calibration, settings.get("stats"))
    inputs = MethodInputs(frozenset({Role.ROUTED_EXPERT}), calibration, settings.get("stats"),
                          own)
    return Sparsify(method=method(inputs),
                    group_size=settings.get("group_size", Sparsify.group_size),
                    storage=settings.get("storage", Sparsify.storage))


KIND = StageKind(Sparsify.name, build, SparsifyRecord, check=check,
                 settings=("pattern", "method", "group_size", "storage", "stats",
                           *METHODS.setting_names(Sparsify.name)),
                 input_options=CALIBRATION_OPTIONS, input_type=Calibration,
                 prepare=prepare_method(Sparsify.name),
                 followed_by=("quantize", "p48 output is NVFP4"), encodes=True,
                 sparsifies=True)
