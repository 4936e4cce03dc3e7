"""Plain floating-point linears (BF16 in Kimi; F32 as a lossless intermediate)."""

from __future__ import annotations

from typing import ClassVar

from kconvert.formats.base import Codec, Encoded, EncodeSpec, ParamRules, ParamSpec
from kconvert.io.shards import DTYPES

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


class DenseCodec(Codec):
    """Plain floating-point `weight` (BF16 in Kimi)."""

    name = "bf16"
    params = ("weight",)
    weight_dtypes = frozenset({"BF16", "F16", "F32"})
    quantized = False
    description = "unquantized (no scale tensors)"
    grid = "bf16"
    router_form = True
    # What a decoded module may be written as (F32 holds INT4's q * scale exactly).
    OUTPUT_DTYPES: ClassVar[tuple[str, ...]] = ("BF16", "F32")

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        return {"weight": (FLOAT_DTYPES, None)}

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight"].shape)

    @classmethod
    def decode(cls, t, shape):
        return t["weight"].float()

    @classmethod
    def specs(cls, shape, input_scale=False, group_size=None) -> list[ParamSpec]:
        return [("weight", "BF16", shape)]

    @classmethod
    def output_specs(cls, shape, spec, input_scale):
        """The weight in `spec.dtypes["weight"]` (BF16 unless given), as `encode` writes it."""
        return [("weight", spec.dtypes.get("weight", "BF16"), shape)]

    @classmethod
    def encode(cls, w, spec: EncodeSpec, *, amax=None, codes=None) -> Encoded:
        """The weights rounded to `spec.dtypes["weight"]` (BF16 unless given); no error is
        recorded (a dense output is the decoded source)."""
        return Encoded({"weight": w.to(DTYPES[spec.dtypes.get("weight", "BF16")])})
