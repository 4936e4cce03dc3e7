"""The Triton block-scale choice (kconvert.formats.nvfp4_triton), run on CPU tensors through
Triton's interpreter (TRITON_INTERPRET=1) or compiled on CUDA tensors (TRITON_INTERPRET=0 on a
GPU machine): its FP8 and bf16 rounding equal torch's casts on every FP8 code, every tie between
neighbours and one ulp either side; its codes equal the torch path's bit for bit for both rules,
both arithmetics, fp32 and bf16 local dtypes, 16- and 32-element blocks, zero, negative-zero and
tiny blocks, and the independent reference written from formats.md (tests/nvfp4_reference.py)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from nvfp4_reference import best_code, block_errors

from conftest import TRITON_DEVICE
from kconvert.formats import nvfp4, nvfp4_triton

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)


@triton.jit
def _casts(x_ptr, fp8_ptr, bf16_ptr, n, R: tl.constexpr):
    i = tl.program_id(0) * R + tl.arange(0, R)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(fp8_ptr + i, nvfp4_triton.fp8_code(tl.minimum(x, 448.0)), mask=i < n)
    tl.store(bf16_ptr + i, nvfp4_triton.bf16_round(x), mask=i < n)


def test_fp8_and_bf16_rounding_equal_torch_casts():
    values = nvfp4.FP8_VALUES[:127]
    pts = torch.cat([values, (values[:-1] + values[1:]) / 2])  # codes and exact ties
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(0.0)),
                     torch.nextafter(pts, torch.tensor(1e9)),
                     torch.rand(4000, generator=torch.Generator().manual_seed(0)) * 500,
                     torch.tensor([2.0**-12, 448.5, 1e30, float("inf")])]).to(TRITON_DEVICE)
    fp8 = torch.empty_like(pts, dtype=torch.int32)
    bf16 = torch.empty_like(pts)
    _casts[(triton.cdiv(pts.numel(), 1024),)](pts, fp8, bf16, pts.numel(), R=1024)
    assert torch.equal(fp8, pts.clamp(max=nvfp4.FP8_MAX).to(torch.float8_e4m3fn)
                       .view(torch.uint8).int())
    # bf16 ties: values halfway between two bf16 numbers, both parities
    ties = (torch.arange(1, 200, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    ties = ties.to(TRITON_DEVICE)
    bf16_ties = torch.empty_like(ties)
    _casts[(1,)](ties, torch.empty_like(ties, dtype=torch.int32), bf16_ties, ties.numel(), R=256)
    assert torch.equal(bf16, pts.bfloat16().float())
    assert torch.equal(bf16_ties, ties.bfloat16().float())


def _blocks(group: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 5, group, generator=g) * torch.logspace(-14, 3, 40)[:, None, None]
    x[3, 2] = 0.0
    x[4, 1] = -0.0
    x[5, 0, :3] = 0.0  # a block with zeros among its values
    return x.to(TRITON_DEVICE)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("rule", ["amax", "mse"])
@pytest.mark.parametrize("arithmetic,local", [("compressed-tensors", torch.float32),
                                              ("compressed-tensors", torch.bfloat16),
                                              ("modelopt", torch.float32)])
def test_codes_equal_the_torch_path(group, rule, arithmetic, local):
    x = _blocks(group, group + len(rule))
    gs = nvfp4.tensor_scale(x.abs().amax((1, 2)), arithmetic)[:, None]
    gs[6] = 1.0  # an all-tiny row under a unit scale: subnormal FP8 codes
    ref = nvfp4.choose_block_codes(x, gs, rule, local, arithmetic, kernel="torch")
    got = nvfp4.choose_block_codes(x, gs, rule, local, arithmetic, kernel="triton")
    assert torch.equal(got, ref)
    if local == torch.float32:  # the reference computes the amax rule in fp32
        # the reference's error, not its code: blocks that round to 0 tie on every code
        mag, row_gs, got = x.abs().cpu(), gs[:, 0].cpu(), got.cpu()
        want = best_code(mag, row_gs, rule, arithmetic)
        assert torch.equal(block_errors(mag, row_gs, got.long()[..., None], arithmetic),
                           block_errors(mag, row_gs, want[..., None], arithmetic))


def test_the_triton_chooser_refuses_a_local_dtype_it_does_not_reproduce():
    x = _blocks(16, 0)
    with pytest.raises(ValueError, match="local dtypes"):
        nvfp4.choose_block_codes(x, torch.ones(40, 1, device=x.device), "mse", torch.float16,
                                 kernel="triton")


@pytest.mark.parametrize("group,arithmetic", [(16, "compressed-tensors"),
                                              (32, "compressed-tensors"), (16, "modelopt")])
def test_the_triton_encoder_writes_the_torch_encoders_bytes(group, arithmetic):
    """nvfp4.quantize with kernel="triton" (nvfp4_triton.choose_block_codes and .encode) and
    kernel="torch": the same packed nibbles, block scales, squared errors and source norms, bit
    for bit, with the rule's codes and with given ones (every FP8 code, so tiny and huge steps);
    among the values zeros, negative zeros, a 14-decade range and exact E2M1 ties."""
    x = _blocks(group, 7 + group)
    w = x.reshape(8, 5, 5 * group).clone()
    step = 2.0 ** -3  # ZERO_CODE (0.125) under a unit global scale: exact ties at midpoints
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.75, -3.5, 7.0],
                        device=w.device)
    w[7, 0, :ties.numel()] = ties * step
    amax = w.abs().amax((1, 2))
    amax[7] = nvfp4.GLOBAL_NUMERATOR  # a unit global scale in both arithmetics
    given = torch.arange(w.numel() // group, device=w.device).remainder(0x7E).add(1)
    given = given.to(torch.uint8).reshape(8, 5, -1)
    given[7, 0] = nvfp4.ZERO_CODE
    for codes in (None, given):
        got, ref = (nvfp4.quantize(w, amax, "mse", fused_cpu=False, group_size=group,
                                   block_codes=codes, arithmetic=arithmetic, kernel=kernel)
                    for kernel in ("triton", "torch"))
        assert torch.equal(got.packed, ref.packed)
        assert torch.equal(got.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8))
        assert torch.equal(got.err_sq, ref.err_sq) and torch.equal(got.ref_sq, ref.ref_sq)
    assert bool((ref.packed == 0x88).any() or (ref.packed & 0x0F == 0x08).any())  # -0 nibbles
