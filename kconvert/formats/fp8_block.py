"""DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (docs/formats.md §4)."""

from __future__ import annotations

import torch

from kconvert.formats.base import Codec, Encoded, EncodeSpec, ParamRules

BLOCK = 128  # rows and columns per scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class Fp8BlockCodec(Codec):
    """DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (formats.md §4)."""

    name = "fp8-block"
    params = ("weight", "weight_scale_inv")
    weight_dtypes = frozenset({"F8_E4M3"})
    description = "FP8 block"
    grid = "fp8-block"
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
        return w * _per_element(s, out, inp)  # despite the name, the scale multiplies

    @classmethod
    def encode(cls, w, spec: EncodeSpec, *, amax=None, codes=None) -> Encoded:
        """fp32 weights [B, out, in] as DeepSeek-V3's FP8 checkpoints store them (formats.md
        §4): per 128 x 128 block (the last ones partial) scale = block amax / 448 in fp32
        (1.0 for an all-zero block), weight = float8_e4m3fn(w / scale), round to nearest."""
        b, out, inp = w.shape
        rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
        padded = torch.zeros(b, rows * BLOCK, cols * BLOCK, dtype=torch.float32, device=w.device)
        padded[:, :out, :inp] = w
        block_amax = padded.abs().reshape(b, rows, BLOCK, cols, BLOCK).amax(dim=(2, 4))
        scale = torch.where(block_amax > 0, block_amax / FP8_MAX, torch.ones_like(block_amax))
        weight = (w.float() / _per_element(scale, out, inp)).to(torch.float8_e4m3fn)
        err = (weight.float() * _per_element(scale, out, inp) - w).square()
        return Encoded({"weight": weight, "weight_scale_inv": scale},
                       err.sum((1, 2), dtype=torch.float64),
                       w.double().square().sum((1, 2)))


def _per_element(scale: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """Block scales [B, rows/128, in/128] (rounded up) spread over every element [B, out, in]."""
    spread = scale.repeat_interleave(BLOCK, dim=1)[:, :out]
    return spread.repeat_interleave(BLOCK, dim=2)[:, :, :inp]
