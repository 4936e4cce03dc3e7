"""The fused Triton scale-block kernel (kconvert.methods.obs_kernel: mask, block scale and
column loop in one launch) against the torch path it replaces on a GPU, run on CPU tensors
through Triton's interpreter (TRITON_INTERPRET=1) or compiled on CUDA tensors
(TRITON_INTERPRET=0 on a GPU machine): the same W-hat and block codes, bit for bit, with and
without SparseGPT's mask, both block-scale rules, both arithmetics, fp32 and bf16 local dtypes,
16- and 32-column scale blocks and a row count that leaves a partial row tile."""

from __future__ import annotations

import os

import pytest
import torch
import triton  # noqa: F401  (a test dependency: pyproject's test extra)

from conftest import TRITON_DEVICE
from kconvert.formats import nvfp4
from kconvert.methods import obs, sparsegpt

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)


@pytest.mark.parametrize("group,mask,rule,local,arithmetic", [
    (16, None, "mse", torch.float32, "compressed-tensors"),
    (32, sparsegpt.p48_mask, "mse", torch.float32, "compressed-tensors"),
    (16, sparsegpt.p48_mask, "mse", torch.float32, "compressed-tensors"),
    (16, None, "amax", torch.bfloat16, "compressed-tensors"),
    (16, sparsegpt.p48_mask, "mse", torch.float32, "modelopt")])
def test_kernel_gives_the_torch_loops_bits(group, mask, rule, local, arithmetic):
    """Mask, block-scale codes (chosen inside the kernel) and W-hat: the torch path's."""
    g = torch.Generator().manual_seed(group)
    b, m, k = 2, 70, 64  # 70 rows: one full tile of 64 and a partial one
    x = torch.randn(b, 200, k, generator=g) @ (torch.randn(k, k, generator=g) / 8 + torch.eye(k))
    u = obs.prepare_inverse(x.transpose(1, 2) @ x).to(TRITON_DEVICE)
    w = (torch.randn(b, m, k, generator=g) / 8).to(TRITON_DEVICE)
    gs = nvfp4.tensor_scale(w.abs().amax((1, 2)), arithmetic).repeat_interleave(m).reshape(b, m)
    ref = obs.obs_quantize(w, u, gs, group, rule, local, arithmetic, mask=mask, kernel="torch")
    got = obs.obs_quantize(w, u, gs, group, rule, local, arithmetic, mask=mask, kernel="triton")
    assert torch.equal(got[1], ref[1])
    assert torch.equal(got[0], ref[0])
    if mask is not None:  # pruned entries are +0, two pairs of every chunk of 8 kept
        assert ((got[0].reshape(b, m, -1, 8) != 0).sum(-1) <= 4).all()


def test_a_mask_the_kernel_does_not_implement_is_refused():
    """kernel="triton" with a mask rule the kernel has no copy of is an error (never silently
    another rule); "auto" takes the torch path for it."""
    w, u = torch.randn(1, 8, 32) / 8, torch.eye(32)[None]
    w, u, gs = w.to(TRITON_DEVICE), u.to(TRITON_DEVICE), torch.ones(1, 8, device=TRITON_DEVICE)

    def halves(wg, d):
        return torch.ones_like(wg, dtype=torch.bool)

    with pytest.raises(ValueError, match="masks"):
        obs.obs_quantize(w, u, gs, 16, "mse", mask=halves, kernel="triton")
    ref = obs.obs_quantize(w, u, gs, 16, "mse", mask=halves, kernel="torch")
    got = obs.obs_quantize(w, u, gs, 16, "mse", mask=halves, kernel="auto")
    assert torch.equal(got[0], ref[0])
