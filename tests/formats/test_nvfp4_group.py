"""NVFP4 with blocks of 32 and the building blocks of a column-by-column (SparseGPT) encoder:
choose_block_codes / fake_quantize agree exactly with quantize / dequantize."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams

from kconvert.formats import nvfp4


def _weights(seed: int) -> torch.Tensor:
    """[2, 24, 512]: Kimi-style INT4 values (codes -7..7, group 32) and Gaussian BF16 ones."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-7, 8, (24, 512), generator=g).float()
    s = (torch.rand(24, 16, generator=g) * 0.004 + 0.001).to(torch.bfloat16).float()
    kimi = (q.reshape(24, 16, 32) * s.unsqueeze(-1)).reshape(24, 512)
    gauss = (torch.randn(24, 512, generator=g) * 0.02).to(torch.bfloat16).float()
    return torch.stack([kimi, gauss])


@pytest.mark.parametrize("fused_cpu", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("block", nvfp4.BLOCK_SIZES)
@pytest.mark.parametrize("rule", ["amax", "mse"])
def test_choose_and_fake_quantize_equal_quantize_and_dequantize(rule, block, fused_cpu):
    w = _weights(0)
    b, m, k = w.shape
    amax = w.abs().amax(dim=(1, 2))
    q = nvfp4.quantize(w, amax, rule, fused_cpu=fused_cpu, group_size=block)
    blocks = w.reshape(b * m, k // block, block)
    row_gs = nvfp4.global_scale(amax).repeat_interleave(m).unsqueeze(-1)
    codes = nvfp4.choose_block_codes(blocks, row_gs, rule)
    assert codes.dtype == torch.uint8 and codes.shape == (b * m, k // block)
    assert torch.equal(codes.reshape(b, m, -1), q.block_scales.view(torch.uint8))
    fake = nvfp4.fake_quantize(blocks, codes, row_gs).reshape(b, m, k)
    assert torch.equal(fake, nvfp4.dequantize(q.packed, q.block_scales, q.global_scale))
    assert not torch.equal(fake, w)
    # Rounding is per element: one column of every block at a time gives the same values.
    column = nvfp4.fake_quantize(blocks[:, :, 3:4], codes, row_gs)
    assert torch.equal(column, fake.reshape(b * m, k // block, block)[:, :, 3:4])


def test_block32_amax_is_compressed_tensors_with_32_element_scales():
    """Block 32 = one compressed-tensors scale per 32 elements (from the 32-element min/max),
    each element then encoded exactly as compressed-tensors' compressor encodes it."""
    w = _weights(1)[1]
    amax = w.abs().amax()
    q = nvfp4.quantize(w[None], amax[None], "amax", group_size=32)
    gs = nvfp4.global_scale(amax[None])
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    blocks = w.reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights,
                                 global_scale=gs)
    codes = scale.to(torch.float8_e4m3fn).view(torch.uint8)  # fp8 values held in fp32
    assert torch.equal(q.block_scales[0].view(torch.uint8), codes)
    # The compressor takes only 16-element groups: give both halves their block's scale.
    ref = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale.repeat_interleave(2, -1), "weight_global_scale": gs},
        scheme)
    assert torch.equal(q.packed[0], ref["weight_packed"])
    # Not a relayout of block 16: other scales, other bytes.
    q16 = nvfp4.quantize(w[None], amax[None], "amax", group_size=16)
    assert not torch.equal(q16.packed, q.packed)


@pytest.mark.parametrize("fused_cpu", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("block", nvfp4.BLOCK_SIZES)
def test_pruned_pairs_are_zero_bytes(block, fused_cpu):
    """+0.0 weights encode to nibble 0x0, so a pruned p48 pair is the byte 0x00 (p48.md)."""
    w = _weights(2)
    pruned = torch.zeros((*w.shape[:2], w.shape[2] // 8, 4), dtype=torch.bool)
    pruned[..., 1] = pruned[..., 3] = True  # pairs 1 and 3 of every chunk of 8
    w = w.reshape(*pruned.shape, 2).masked_fill(pruned.unsqueeze(-1), 0.0).reshape(w.shape)
    for rule in ("amax", "mse"):
        q = nvfp4.quantize(w, w.abs().amax(dim=(1, 2)), rule, fused_cpu=fused_cpu, group_size=block)
        pairs = q.packed.reshape(pruned.shape)
        assert (pairs[pruned] == 0).all()
        assert (pairs[~pruned] != 0).float().mean() > 0.9


def test_dequantize_reads_the_block_size_off_the_shapes():
    w = _weights(3)
    amax = w.abs().amax(dim=(1, 2))
    for block in nvfp4.BLOCK_SIZES:
        q = nvfp4.quantize(w, amax, "mse", group_size=block)
        err = (nvfp4.dequantize(q.packed, q.block_scales, q.global_scale) - w).double().square()
        torch.testing.assert_close(err.sum((1, 2)), q.err_sq, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="block"):
        nvfp4.quantize(w, amax, group_size=64)
    with pytest.raises(ValueError, match="do not divide"):
        nvfp4.dequantize(q.packed, q.block_scales[:, :, :-1], q.global_scale)
