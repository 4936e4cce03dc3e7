"""NVFP4 in ModelOpt's arithmetic (nvfp4.ARITHMETIC "modelopt") gives ModelOpt's own
NVFP4QTensor bytes, block scales and weight_scale_2 exactly, on the torch path and in the CPU
kernels, for plain weights, Kimi's INT4 grid, all-zero blocks and values on rounding
boundaries; compressed-tensors' arithmetic does not, on those boundaries."""

from __future__ import annotations

import pytest
import torch

# nvidia-modelopt is a test dependency (pyproject.toml's test extra): the oracle's absence
# fails the suite, it never skips it.
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from kconvert.formats import nvfp4


def _weights(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(3, 32, 256, generator=g) * torch.rand(3, 32, 1, generator=g) * 4
    codes = torch.randint(-7, 8, (3, 32, 256), generator=g).float()
    kimi = codes * (torch.rand(3, 32, 8, generator=g) * 0.01).repeat_interleave(32, -1)
    zeros = plain.clone()
    zeros[:, :, 16:48] = 0.0  # whole blocks of zeros: ModelOpt scales them 1.0
    return [plain, kimi, zeros]


def _modelopt(w: torch.Tensor, amax: torch.Tensor):
    out = [NVFP4QTensor.quantize(w[i], 16, weights_scaling_factor_2=amax[i].float() / 2688.0)
           for i in range(w.shape[0])]
    return (torch.stack([q._quantized_data for q, _, _ in out]),
            torch.stack([s.view(torch.uint8) for _, s, _ in out]),
            torch.stack([s2.reshape(()) for _, _, s2 in out]))


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("seed", [0, 1])
def test_modelopt_arithmetic_gives_modelopt_bytes(seed, fused):
    for w in _weights(seed):
        amax = w.abs().amax(dim=(1, 2))
        packed, scales, scale_2 = _modelopt(w, amax)
        q = nvfp4.quantize(w, amax, "amax", fused_cpu=fused, arithmetic="modelopt")
        assert torch.equal(q.packed, packed)
        assert torch.equal(q.block_scales.view(torch.uint8), scales)
        assert torch.equal(q.global_scale, scale_2)
        decoded = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale, "modelopt")
        err = (decoded - w).double().square().sum((1, 2))
        torch.testing.assert_close(err, q.err_sq, rtol=1e-6, atol=0)


def test_int4_path_in_modelopt_arithmetic():
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-2**31, 2**31 - 1, (2, 32, 32), dtype=torch.int32, generator=g)
    scale = (torch.rand(2, 32, 8, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
    amax = nvfp4.int4_amax(packed, scale)
    from kconvert.formats.int4 import Int4Codec

    w = Int4Codec.decode({"weight_packed": packed, "weight_scale": scale}, (32, 256))
    want_packed, want_scales, want_s2 = _modelopt(w, amax)
    for fused in (True, False):
        q = nvfp4.quantize_int4(packed, scale, amax, "amax", fused_cpu=fused,
                                arithmetic="modelopt")
        assert torch.equal(q.packed, want_packed)
        assert torch.equal(q.block_scales.view(torch.uint8), want_scales)
        assert torch.equal(q.global_scale, want_s2)


def test_the_two_arithmetics_differ_on_boundaries():
    """Not a vacuous switch: on Kimi's INT4 grid (values q * scale, many exactly on E2M1 cut
    points), compressed-tensors' order of operations rounds some the other way than ModelOpt's."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(-7, 8, (8, 256, 512), generator=g).float()
    w = codes * (torch.rand(8, 256, 16, generator=g) * 0.01).repeat_interleave(32, -1)
    amax = w.abs().amax(dim=(1, 2))
    ct = nvfp4.quantize(w, amax, "amax", fused_cpu=False)
    mo = nvfp4.quantize(w, amax, "amax", fused_cpu=False, arithmetic="modelopt")
    assert not torch.equal(ct.packed, mo.packed)
    assert (ct.packed != mo.packed).float().mean() < 1e-3  # rare: boundaries only
