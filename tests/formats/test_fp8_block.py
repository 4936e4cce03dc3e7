"""FP8-block (Kimi-K2-Instruct / DeepSeek-V3) decode against compressed-tensors' dequantizer."""

from __future__ import annotations

import torch
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
    FP8BlockDequantizer,
)

from kconvert.formats.fp8_block import Fp8BlockCodec


def test_fp8_block_decode_matches_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    out, inp = 300, 200  # not multiples of 128: exercises the ragged last blocks
    w = (torch.randn(out, inp, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) * 1e-3 + 1e-4
    ours = Fp8BlockCodec.decode({"weight": w[None], "weight_scale_inv": s[None]}, (out, inp))[0]
    theirs = FP8BlockDequantizer(targets=["re:.*"], dtype=torch.float32).process(
        {"m.weight": w.clone(), "m.weight_scale_inv": s.clone()})["m.weight"]
    assert theirs.shape == ours.shape
    assert torch.equal(ours, theirs.float())
    # A wrong scale layout (transposed blocks) would not pass: the check can fail.
    wrong = Fp8BlockCodec.decode({"weight": w[None], "weight_scale_inv": s.flip(0)[None]},
                                 (out, inp))[0]
    assert not torch.equal(wrong, theirs.float())
