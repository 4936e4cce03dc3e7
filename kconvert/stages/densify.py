"""The `densify` stage: pair-bitmask p48 NVFP4 back to the dense compressed-tensors layout."""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.engine.stage import Stage, StageRecord
from kconvert.formats import dense_storage
from kconvert.formats.linear import ModuleWork
from kconvert.stages.base import StageKind


class DensifyRecord(StageRecord):
    pass


@dataclass(frozen=True)
class Densify(Stage):
    """pair-bitmask p48 NVFP4 -> the dense compressed-tensors layout, byte for byte."""

    name: str = "densify"

    def claim(self, m: ModuleWork) -> None:
        dense = dense_storage(m.codec)
        if dense is not None:
            m.out_codec = dense
            m.group_size = m.shape[1] // m.params["weight_scale"].shape[1]
            m.repack = True
            m.stages.append(self.name)

    def record(self) -> DensifyRecord:
        return DensifyRecord()


KIND = StageKind(Densify.name, lambda _settings, _input: Densify(), DensifyRecord)
