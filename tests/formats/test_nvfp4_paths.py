"""The fused CPU kernels and the torch path (the GPU's) write the same NVFP4 bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import numba  # a hard dependency (pyproject.toml): its absence fails, never skips
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from kconvert.formats import nvfp4, nvfp4_cpu, nvfp4_grid
from kconvert.formats.int4 import Int4Codec


def _kimi_style(out: int, inp: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-7, 8, (out, inp), generator=g).float()
    s = (torch.rand(out, inp // 32, generator=g) * 0.004 + 0.001).to(torch.bfloat16).float()
    return (q.reshape(out, -1, 32) * s.unsqueeze(-1)).reshape(out, inp)


def _batch() -> torch.Tensor:
    """Kimi-style, Gaussian and tiny matrices with the edge cases the kernels must match.

    K = 544 gives 34 blocks of 16 and 17 of 32: neither a multiple of the kernel's LANES.
    """
    g = torch.Generator().manual_seed(3)
    w = torch.stack([_kimi_style(40, 544, 1), torch.randn(40, 544, generator=g) * 0.02,
                     torch.randn(40, 544, generator=g) * 1e-6])
    w[0, 0, :32] = 0  # an all-zero block (scale 0.125, as compressed-tensors writes)
    w[1, 2, 3] = -1e-12  # a negative value that rounds to zero: nibble 0x8
    w[2, 5, :] = -0.0
    return w


def _assert_same(a: nvfp4.Quantized, b: nvfp4.Quantized) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)
    torch.testing.assert_close(a.err_sq, b.err_sq, rtol=1e-9, atol=0)
    torch.testing.assert_close(a.ref_sq, b.ref_sq, rtol=1e-9, atol=0)


@pytest.mark.parametrize("block", nvfp4.BLOCK_SIZES)
@pytest.mark.parametrize("mode", ["amax", "mse"])
def test_fused_cpu_kernel_equals_torch_path(mode, block):
    w = _batch()
    amax = w.abs().amax(dim=(1, 2))
    fused = nvfp4.quantize(w, amax, mode, fused_cpu=True, group_size=block)
    eager = nvfp4.quantize(w, amax, mode, fused_cpu=False, group_size=block)
    _assert_same(fused, eager)
    assert fused.block_scales.shape == (3, 40, 544 // block)
    # The comparison can fail: another block-scale rule gives other bytes.
    other = nvfp4.quantize(w, amax, "amax" if mode == "mse" else "mse", fused_cpu=False,
                           group_size=block)
    assert not torch.equal(other.block_scales.view(torch.uint8),
                           eager.block_scales.view(torch.uint8))


@pytest.mark.parametrize("mode", ["amax", "mse"])
def test_fused_cpu_kernel_with_bf16_local_dtype(mode):
    """A BF16 source's amax rule (block amax / 6 in bf16) comes from torch into the kernel."""
    w = _batch().to(torch.bfloat16).float()
    amax = w.abs().amax(dim=(1, 2))
    fused = nvfp4.quantize(w, amax, mode, fused_cpu=True, local_dtype=torch.bfloat16)
    eager = nvfp4.quantize(w, amax, mode, fused_cpu=False, local_dtype=torch.bfloat16)
    _assert_same(fused, eager)


@pytest.mark.parametrize("block", nvfp4.BLOCK_SIZES)
def test_given_block_codes_are_used_as_they_are(block):
    w = _batch()
    amax = w.abs().amax(dim=(1, 2))
    nb = 544 // block
    g = torch.Generator().manual_seed(5)
    # Codes around the amax rule's, some far off (heavy clipping or a coarse grid).
    amax_codes = nvfp4.quantize(w, amax, "amax", group_size=block).block_scales.view(torch.uint8)
    codes = (amax_codes.short() + torch.randint(-6, 9, amax_codes.shape, generator=g)
             ).clamp(1, 0x7E).to(torch.uint8)
    fused = nvfp4.quantize(w, amax, "mse", fused_cpu=True, group_size=block, block_codes=codes)
    eager = nvfp4.quantize(w, amax, "mse", fused_cpu=False, group_size=block, block_codes=codes)
    _assert_same(fused, eager)
    assert torch.equal(fused.block_scales.view(torch.uint8), codes)
    # err_sq is the error of exactly that encoding.
    decoded = nvfp4.dequantize(fused.packed, fused.block_scales, fused.global_scale)
    torch.testing.assert_close(fused.err_sq, (decoded.double() - w.double()).square().sum((1, 2)),
                               rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="uint8"):
        nvfp4.quantize(w, amax, group_size=block, block_codes=codes[:, :, : nb - 1])
    with pytest.raises(ValueError, match=r"1\.\.0x7E"):
        nvfp4.quantize(w, amax, group_size=block, block_codes=torch.zeros_like(codes))


def test_fp8_codes_equal_torch_cast():
    """The kernels' FP8 rounding is torch's float32 -> float8_e4m3fn cast after the clamp to
    448: every code, the midpoints between neighbours (ties) and one ulp either side."""
    values = nvfp4.FP8_VALUES[:127]
    mids = (values[:-1] + values[1:]) / 2  # exact in fp32
    pts = torch.cat([values, mids])
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(0.0)),
                     torch.nextafter(pts, torch.tensor(1e9)),
                     torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 500,
                     torch.tensor([2.0**-12, 448.5, 1e30, float("inf"), float("nan")])])
    expected = pts.clamp(max=nvfp4.FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    got = torch.empty_like(pts, dtype=torch.int32)
    nvfp4_cpu._fp8_codes(pts.numpy(), got.numpy())
    assert torch.equal(got, expected.int())


def test_e2m1_rounding_equals_torch_bucketize():
    """The kernels' E2M1 value (a rint on the grid) and nibble equal the torch path's bucketize
    over the cut points: on each cut point, a few ulps either side, and random values."""
    cuts = nvfp4.cut_points(torch.device("cpu"))
    down = up = torch.cat([torch.tensor(nvfp4_grid.CUTS),
                           torch.tensor([0.0, 2.0, 4.0, 6.0, 1e30])])
    near = [down]
    for _ in range(3):
        down, up = torch.nextafter(down, torch.tensor(0.0)), torch.nextafter(up, torch.tensor(1e38))
        near += [down, up]
    y = torch.cat([*near, torch.rand(20000, generator=torch.Generator().manual_seed(1)) * 8])
    idx = torch.bucketize(y, cuts)
    lut = torch.tensor(nvfp4.E2M1)

    @numba.njit
    def kernel_rounding(y, values, nibbles):
        for i in range(y.shape[0]):
            values[i] = nvfp4_cpu._e2m1_value(y[i])
            nibbles[i] = nvfp4_cpu._nibble(-y[i])

    values, nibbles = torch.empty_like(y), torch.empty(y.shape, dtype=torch.int32)
    kernel_rounding(y.numpy(), values.numpy(), nibbles.numpy())
    assert torch.equal(values, lut[idx])
    expected = torch.where(y > 0, idx | 8, idx)  # the sign of -y: 0x8 only where -y < 0
    assert torch.equal(nibbles, expected.int())


CONCURRENT_LAUNCHES = """
import threading, torch
from kconvert.formats import nvfp4
g = torch.Generator().manual_seed(0)
packed = torch.randint(-2**31, 2**31 - 1, (2, 64, 64), dtype=torch.int32, generator=g)
scale = (torch.rand(2, 64, 16, generator=g) * 0.004 + 0.001).to(torch.bfloat16)
ref = nvfp4.quantize_int4(packed, scale, nvfp4.int4_amax(packed, scale), "mse").packed
bad = []
def work():
    for _ in range(100):
        q = nvfp4.quantize_int4(packed, scale, nvfp4.int4_amax(packed, scale), "mse")
        bad.extend([] if torch.equal(q.packed, ref) else [1])
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
import numba
print(numba.threading_layer(), len(bad))
"""


def test_kernels_launched_from_several_threads_take_turns():
    """The kernels release the GIL; under numba's workqueue layer (no OpenMP or TBB) two
    threads launching at once abort the process, so launches take turns (nvfp4's lock)."""
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    proc = subprocess.run([sys.executable, "-c", CONCURRENT_LAUNCHES], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["workqueue", "0"]


def test_widen_bf16_equals_torch_cast_for_every_bf16():
    """The kernels widen bf16 INT4 scales themselves: all 65536 bit patterns (subnormals,
    infinities and NaN payloads included) give torch's bf16 -> fp32 bits."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).reshape(256, 256)
    got = torch.empty(bits.shape, dtype=torch.float32)
    nvfp4_cpu.widen_bf16(bits.numpy().view("uint16"), got.numpy())
    assert torch.equal(got.view(torch.int32), bits.view(torch.bfloat16).float().view(torch.int32))


def _int4(b: int, m: int, k: int, group: int, codes_lo: int, scale_dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [B, M, K/8] written by compressed-tensors' own packer, scales [B, M, K/group]."""
    g = torch.Generator().manual_seed(k + group)
    q = torch.randint(codes_lo, 8, (b * m, k), generator=g, dtype=torch.int8)
    packed = pack_to_int32(q, 4).reshape(b, m, k // 8)
    scale = (torch.rand(b, m, k // group, generator=g) * 0.004 + 0.001).to(scale_dtype)
    return packed, scale


@pytest.mark.parametrize(("group", "codes_lo", "scale_dtype"), [
    (32, -7, torch.bfloat16),  # Kimi: codes -7..7, bf16 scales
    (64, -8, torch.float32),  # compressed-tensors' own range, fp32 scales
    (4, -8, torch.float32),  # groups of half a word: decoded by torch, not the kernels
])
@pytest.mark.parametrize("block", nvfp4.BLOCK_SIZES)
@pytest.mark.parametrize("mode", ["amax", "mse"])
def test_quantize_int4_equals_decode_then_quantize(mode, block, group, codes_lo, scale_dtype):
    packed, scale = _int4(2, 24, 576, group, codes_lo, scale_dtype)  # 36 / 18 blocks per row
    w = Int4Codec.decode({"weight_packed": packed, "weight_scale": scale}, (24, 576))
    amax = nvfp4.int4_amax(packed, scale)
    assert torch.equal(amax, w.abs().amax(dim=(1, 2)))
    reference = nvfp4.quantize(w, amax, mode, fused_cpu=False, group_size=block)
    _assert_same(nvfp4.quantize_int4(packed, scale, amax, mode, block), reference)
    _assert_same(nvfp4.quantize_int4(packed, scale, amax, mode, block, fused_cpu=False),
                 reference)


def test_int4_amax_propagates_nan():
    packed, scale = _int4(2, 4, 64, 32, -7, torch.bfloat16)
    scale[1, 2, 1] = float("nan")
    amax = nvfp4.int4_amax(packed, scale)
    assert amax[0].isfinite() and amax[1].isnan()


def test_a_kernel_launch_keeps_torchs_thread_count():
    """numba's OpenMP layer, started by a process's first kernel launch, set the launching
    thread's OpenMP count to numba's: torch ran on 2 threads after a conversion in a process
    started with 1, and later CPU sums (learned compensation's) added in another order. In a
    fresh process (the first launch is this one's), with numba's count above torch's."""
    code = ("import torch; from kconvert.formats import nvfp4; nvfp4.warm_cpu_kernels(); "
            "print(torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "1"
