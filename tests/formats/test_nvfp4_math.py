"""NVFP4 packing and E2M1 rounding checked against compressed-tensors (formats.md §2).

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criterion covered: I (NVFP4 check vector and E2M1 tie points).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
)
from compressed_tensors.quantization.utils import generate_gparam

from kconvert.formats import nvfp4
from oracles import (
    E2M1,
    NVFP4_CHECK_BYTES,
    NVFP4_CHECK_VALUES,
    TIE_POINTS,
    ct_reference_compress,
    u8,
)

# ------------------------------------------------------------------------------ I: NVFP4 math


def test_nvfp4_check_vector_packing():
    """formats.md §2: [.5,-1,6,0,-0,3,-6,1.5] -> A1 07 58 3F (even element in the low nibble)."""
    values = torch.tensor(NVFP4_CHECK_VALUES)
    nibbles = torch.tensor([E2M1.index(abs(v)) for v in NVFP4_CHECK_VALUES], dtype=torch.uint8)
    nibbles |= torch.signbit(values).to(torch.uint8) << 3  # -0 is written 0x8
    packed = nvfp4.pack_codes(nibbles)
    assert bytes(packed.tolist()) == NVFP4_CHECK_BYTES
    # compressed-tensors packs the same values to the same bytes.
    assert bytes(pack_fp4_to_uint8(values[None]).flatten().tolist()) == NVFP4_CHECK_BYTES
    assert torch.equal(nvfp4.unpack_codes(packed), nibbles)


def _tie_rows(step: float) -> torch.Tensor:
    """Blocks whose values divided by the block's step land exactly on E2M1 cut points."""
    ties = list(TIE_POINTS)
    block0 = [6.0, *ties, *[-t for t in ties], -0.0]  # block amax 6 -> scale 448, y = x / step
    near = [6.0, -0.1, 0.1, -0.25, 0.2, 4.9, 5.1, -5.1, 0.3, 0.7, 1.3, 1.7, 2.4, 2.6, 3.4, 3.6]
    row = torch.tensor(block0) * step
    # row/4: scale 112, same y; an all-zero block gets CT's 0.125 scale (formats.md §2).
    blocks = [row, -row, row / 4, torch.tensor(near) * step, torch.zeros(16)]
    return torch.stack([torch.cat(blocks), torch.cat(blocks[::-1])])


def _quantize_paths() -> list:
    """nvfp4.quantize's CPU paths: the fused numba kernel and the torch path (the GPU's)."""
    if "fused_cpu" in inspect.signature(nvfp4.quantize).parameters:
        return [pytest.param({"fused_cpu": True}, id="fused"),
                pytest.param({"fused_cpu": False}, id="torch")]
    return [pytest.param({}, id="default")]


@pytest.mark.parametrize("path", _quantize_paths())
@pytest.mark.parametrize("amax", [6.0, 0.75, 96.0])
def test_nvfp4_tie_points_match_compressed_tensors(amax, path):
    """E2M1 rounding on every cut point (and its negative) equals CT's cast_to_fp4, byte for byte.

    With amax = 6*2^k the global scale is 448/2^k and a block of amax 6*2^k gets the scale
    448 exactly, so x / (scale/gs) = x / 2^k is exact and lands on the cut points.
    """
    step = amax / 6.0
    w = _tie_rows(step)
    assert w.abs().max().item() == amax
    q = nvfp4.quantize(w[None], torch.tensor([amax]), scale_rule="amax", **path)
    gs = generate_gparam(w.min(), w.max())
    assert torch.equal(q.global_scale.reshape(1), gs)
    ref = ct_reference_compress(w, gs)
    assert torch.equal(u8(q.block_scales[0]), u8(ref["weight_scale"]))
    assert torch.equal(q.packed[0], ref["weight_packed"])
    # And the decoded tie points are where formats.md says they go.
    decoded = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale)[0]
    first = decoded[0, 1:8] / step
    assert first.tolist() == list(TIE_POINTS.values())
    assert (decoded[0, 8:15] / step).tolist() == [-v for v in TIE_POINTS.values()]
