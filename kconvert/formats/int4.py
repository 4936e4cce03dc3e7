"""compressed-tensors pack-quantized INT4 (docs/formats.md §1): what Kimi-K2-Thinking ships."""

from __future__ import annotations

import torch

from kconvert.errors import KconvertError
from kconvert.formats.base import Codec, Encoded, EncodeSpec, ParamRules
from kconvert.formats.ct_config import weight_problems
from kconvert.io.shards import DTYPES


class Int4Codec(Codec):
    """compressed-tensors pack-quantized INT4 (formats.md §1): what Kimi-K2-Thinking ships."""

    name = "int4-pack-quantized"
    params = ("weight_packed", "weight_scale", "weight_shape")
    description = "INT4 pack-quantized"
    grid = "int4"
    default_group_size = 32
    ct_format = "pack-quantized"

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        out, inp = shape
        return {"weight_packed": (frozenset({"I32"}), (out, inp // 8)),
                "weight_scale": (frozenset({"BF16", "F16", "F32"}), (out, inp // group_size)),
                "weight_shape": (frozenset({"I32", "I64"}), (2,))}

    @classmethod
    def scheme_problems(cls, where, scheme, m):
        return weight_problems(where, scheme, m, "int")

    @classmethod
    def logical_shape(cls, infos, shape_value):
        packed, scale = infos["weight_packed"].shape, infos["weight_scale"].shape
        if shape_value is None or len(shape_value) != 2:
            info = infos["weight_shape"]
            raise KconvertError("weight_shape is not [out, in]", file=info.file.name,
                                tensor=info.name)
        out, inp = shape_value
        ok = (
            packed == (out, inp // 8) and inp % 8 == 0 and len(scale) == 2 and scale[0] == out
            and scale[1] > 0 and inp % scale[1] == 0
        )
        if not ok:
            raise KconvertError(
                f"weight_shape {list(shape_value)} disagrees with weight_packed {list(packed)} "
                f"and weight_scale {list(scale)}",
                file=infos["weight_packed"].file.name, tensor=infos["weight_packed"].name,
            )
        return out, inp

    @classmethod
    def decode(cls, t, shape):
        """Exact q * scale in fp32 (compressed-tensors rounds this product to bf16)."""
        packed, scale = t["weight_packed"], t["weight_scale"]
        b, out, words = packed.shape
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
        # In place where possible: 2 live temporaries of the item's size instead of 3.
        codes = (packed.unsqueeze(-1) >> shifts).bitwise_and_(0xF).sub_(8)  # low nibble first
        groups = scale.shape[-1]
        q = codes.reshape(b, out, groups, -1).float()
        del codes
        return q.mul_(scale.float().unsqueeze(-1)).reshape(b, out, words * 8)

    @classmethod
    def encode(cls, w, spec: EncodeSpec, *, amax=None, codes=None) -> Encoded:
        """fp32 weights [B, out, in] as compressed-tensors' symmetric INT4 writes them
        (formats.md §1): per group of `spec.group_size` (default 32) inputs scale = amax / 7.5
        (its `calculate_qparams`; an all-zero group gets fp32's eps), stored in
        `spec.dtypes["weight_scale"]` (BF16 unless given), and codes round(w / stored scale)
        (ties to even) clamped to -8..7, packed low nibble first: weight_packed [B, out, in/8]
        int32, weight_scale [B, out, in/group] and weight_shape [B, 2] (out, in), I64 unless
        `spec.dtypes` says I32 (Kimi's)."""
        b, out, inp = w.shape
        group_size = spec.group(cls)
        if inp % group_size or group_size % 8:
            raise KconvertError(f"INT4 groups of {group_size} do not divide {inp} inputs into "
                                "whole words")
        g = w.float().reshape(b, out, inp // group_size, group_size)
        scale = g.abs().amax(-1) / 7.5
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale).to(
            DTYPES[spec.dtypes.get("weight_scale", "BF16")])
        q = torch.round(g / scale.float().unsqueeze(-1)).clamp_(-8, 7).to(torch.int64) + 8
        words = (q.reshape(b, out, inp // 8, 8) << torch.arange(0, 32, 4, device=w.device)).sum(-1)
        packed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        shape = torch.tensor([out, inp], dtype=DTYPES[spec.dtypes.get("weight_shape", "I64")],
                             device=w.device).expand(b, 2)
        return Encoded({"weight_packed": packed, "weight_scale": scale, "weight_shape": shape})
