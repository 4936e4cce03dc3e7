"""DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (docs/formats.md §4)."""

from __future__ import annotations

from kconvert.formats.base import Codec


class Fp8BlockCodec(Codec):
    """DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (formats.md §4)."""

    name = "fp8-block"
    params = ("weight", "weight_scale_inv")

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight"].shape)

    @classmethod
    def decode(cls, t, shape):
        w, s = t["weight"].float(), t["weight_scale_inv"].float()
        _, out, inp = w.shape
        s = s.repeat_interleave(128, dim=1)[:, :out].repeat_interleave(128, dim=2)[:, :, :inp]
        return w * s  # despite the name, the scale multiplies
