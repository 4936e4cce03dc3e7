"""Plain floating-point linears (BF16 in Kimi; F32 as a lossless intermediate)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kconvert.formats.base import Codec, ParamRules, ParamSpec

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


class DenseCodec(Codec):
    """Plain floating-point `weight` (BF16 in Kimi)."""

    name = "bf16"
    params = ("weight",)
    weight_dtypes = frozenset({"BF16", "F16", "F32"})
    quantized = False
    description = "unquantized (no scale tensors)"

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        return {"weight": (FLOAT_DTYPES, None)}

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight"].shape)

    @classmethod
    def decode(cls, t, shape):
        return t["weight"].float()

    DTYPES: ClassVar[dict[str, torch.dtype]] = {"BF16": torch.bfloat16, "F32": torch.float32}

    @staticmethod
    def specs(shape: tuple[int, int], dtype: str = "BF16") -> list[ParamSpec]:
        return [("weight", dtype, shape)]

    @classmethod
    def encode(cls, w: torch.Tensor, dtype: str = "BF16") -> dict[str, torch.Tensor]:
        return {"weight": w.to(cls.DTYPES[dtype])}
