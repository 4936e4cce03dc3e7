"""The `dequant` stage: every quantized module decoded, written BF16 (or F32)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError
from kconvert.formats import DenseCodec
from kconvert.formats.linear import ModuleWork
from kconvert.stages.base import StageKind


class DequantRecord(StageRecord):
    dtype: str = Field(description="BF16, or F32 (INT4's q * scale exactly)")


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


def build(settings: dict, _input: None) -> Dequant:
    dtype = settings.get("dtype", "BF16")
    if dtype not in DenseCodec.OUTPUT_DTYPES:
        raise KconvertError(f"dequant dtype must be one of {list(DenseCodec.OUTPUT_DTYPES)}")
    return Dequant(dtype)


KIND = StageKind(Dequant.name, build, DequantRecord, settings=("dtype",), decodes=True)
