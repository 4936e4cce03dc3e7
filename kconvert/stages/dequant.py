"""The `dequant` stage: every quantized module decoded, written BF16 (or F32)."""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.formats import DenseCodec
from kconvert.stages.base import ModuleWork, Stage
from kconvert.stages.records import DequantRecord


@dataclass(frozen=True)
class Dequant(Stage):
    """Every quantized module (INT4, NVFP4, FP8) is decoded; alone, it writes BF16, or F32
    (`dtype`), which holds INT4's q * scale exactly: a lossless intermediate."""

    dtype: str = "BF16"
    name: str = "dequant"

    def claim(self, m: ModuleWork) -> None:
        if m.codec.quantized:
            m.out_codec = DenseCodec
            m.dense_dtype = self.dtype
            m.stages.append(self.name)

    def record(self) -> DequantRecord:
        return DequantRecord(dtype=self.dtype)
