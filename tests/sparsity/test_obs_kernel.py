"""The fused Triton in-block loop (kconvert.sparsity.obs_kernel) against the torch loop it
replaces on a GPU, run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1): the
same W-hat and block codes, bit for bit, with and without SparseGPT's mask, for 16- and
32-column scale blocks and a row count that leaves a partial row tile."""

from __future__ import annotations

import os

import pytest
import torch
import triton  # noqa: F401  (a test dependency: pyproject's test extra)

from kconvert.formats import nvfp4
from kconvert.sparsity import obs, sparsegpt

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)",
                allow_module_level=True)


@pytest.mark.parametrize("group,mask", [(16, None), (32, sparsegpt.p48_mask),
                                        (16, sparsegpt.p48_mask)])
def test_kernel_gives_the_torch_loops_bits(group, mask):
    g = torch.Generator().manual_seed(group)
    b, m, k = 2, 70, 64  # 70 rows: one full tile of 64 and a partial one
    x = torch.randn(b, 200, k, generator=g) @ (torch.randn(k, k, generator=g) / 8 + torch.eye(k))
    u = obs.prepare_inverse(x.transpose(1, 2) @ x)
    w = torch.randn(b, m, k, generator=g) / 8
    gs = nvfp4.tensor_scale(w.abs().amax((1, 2))).repeat_interleave(m).reshape(b, m)
    ref = obs.obs_quantize(w, u, gs, group, "mse", mask=mask, kernel="torch")
    got = obs.obs_quantize(w, u, gs, group, "mse", mask=mask, kernel="triton")
    assert torch.equal(got[1], ref[1])
    assert torch.equal(got[0], ref[0])
