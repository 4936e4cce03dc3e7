"""DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (docs/formats.md §4)."""

from __future__ import annotations

from kconvert.formats.base import Codec, ParamRules


class Fp8BlockCodec(Codec):
    """DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (formats.md §4)."""

    name = "fp8-block"
    params = ("weight", "weight_scale_inv")
    weight_dtypes = frozenset({"F8_E4M3"})
    description = "FP8 block"
    quant_method = "fp8"

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        out, inp = shape
        return {"weight": (frozenset({"F8_E4M3"}), (out, inp)),
                "weight_scale_inv": (frozenset({"F32"}), (-(-out // 128), -(-inp // 128)))}

    @classmethod
    def scheme_problems(cls, where, scheme, m):
        blocks = scheme.get("weight_block_size", [128, 128])
        if list(blocks) == [128, 128]:
            return []
        return [f"{where} weight_block_size {blocks}; the FP8-block decode kconvert knows is "
                "128x128"]

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight"].shape)

    @classmethod
    def decode(cls, t, shape):
        w, s = t["weight"].float(), t["weight_scale_inv"].float()
        _, out, inp = w.shape
        s = s.repeat_interleave(128, dim=1)[:, :out].repeat_interleave(128, dim=2)[:, :, :inp]
        return w * s  # despite the name, the scale multiplies
