"""The fused CPU kernel and the torch path (the GPU's) write the same NVFP4 bytes."""

from __future__ import annotations

import pytest
import torch

from kconvert import nvfp4


def _kimi_style(out: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-7, 8, (out, inp), generator=g).float()
    s = (torch.rand(out, inp // 32, generator=g) * 0.004 + 0.001).to(torch.bfloat16).float()
    return (q.reshape(out, -1, 32) * s.unsqueeze(-1)).reshape(out, inp)


@pytest.mark.parametrize("mode", ["amax", "mse"])
def test_fused_cpu_kernel_equals_torch_path(mode):
    g = torch.Generator().manual_seed(3)
    w = torch.stack([_kimi_style(96, 512, 1), torch.randn(96, 512, generator=g) * 0.02,
                     torch.randn(96, 512, generator=g) * 1e-6])
    w[0, 0, :16] = 0  # an all-zero block (scale 0.125, as compressed-tensors writes)
    w[1, 2, 3] = -1e-12  # a negative value that rounds to zero: nibble 0x8
    w[2, 5, :] = -0.0
    amax = w.abs().amax(dim=(1, 2))
    fused = nvfp4.quantize(w, amax, mode, fused_cpu=True)
    eager = nvfp4.quantize(w, amax, mode, fused_cpu=False)
    assert torch.equal(fused.packed, eager.packed)
    assert torch.equal(fused.block_scale.view(torch.uint8), eager.block_scale.view(torch.uint8))
    assert torch.equal(fused.global_scale, eager.global_scale)
    torch.testing.assert_close(fused.err_sq, eager.err_sq, rtol=1e-9, atol=0)
    torch.testing.assert_close(fused.ref_sq, eager.ref_sq, rtol=1e-9, atol=0)
    # The comparison can fail: another block-scale rule gives other bytes.
    other = nvfp4.quantize(w, amax, "amax" if mode == "mse" else "mse", fused_cpu=False)
    assert not torch.equal(other.block_scale.view(torch.uint8),
                           eager.block_scale.view(torch.uint8))
