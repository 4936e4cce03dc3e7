"""The OBS engine's in-block column loop as one fused Triton kernel (docs/obs.md).

`kconvert.sparsity.obs.column_loop` (torch) launches a handful of kernels per column: 16 or
32 columns per scale block, hundreds of scale blocks per matrix, so on a GPU the loop is
bound by launches, not arithmetic. Here one launch does a whole scale block for a batch of
matrices: each program holds BLOCK_M rows of the block in registers and, column by column,
rounds to the NVFP4 grid (the encoder's division, cut points and sign rule), applies the mask,
writes the scaled error and subtracts its rank-1 update from the block's later columns.

Same arithmetic as the torch loop, operation for operation: IEEE division (`div_rn`, not
Triton's fast division), a product then a subtraction (contraction into FMA is switched off
on the GPU), so the codes are the torch loop's; tested through Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1), measured on the GPU by scripts/bench_obs.py.
"""

from __future__ import annotations

import functools
import os

import torch

from kconvert.formats import nvfp4

BLOCK_M = 64  # rows per program


def available() -> bool:
    """Triton imports (the kernel then runs on CUDA tensors, or anywhere under its
    interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def column_loop_kernel(w_ptr, u_ptr, keep_ptr, step_ptr, e_ptr, rows,
                           sw_b, sw_m, sw_k, su_b, su_r, su_c, sk_b, sk_m, sk_k,
                           ss_b, ss_m, se_b, se_m, se_k,
                           c0, c1, c2, c3, c4, c5, c6,
                           G: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)  # a batch's offset passes 2^31 elements
        r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, G)
        live = r < rows
        in_rows = live[:, None] & (cols[None, :] < G)
        w_at = w_ptr + b * sw_b + r[:, None] * sw_m + cols[None, :] * sw_k
        w = tl.load(w_at, mask=in_rows, other=0.0)
        step = tl.load(step_ptr + b * ss_b + r * ss_m, mask=live, other=1.0)
        if MASKED:
            keep = tl.load(keep_ptr + b * sk_b + r[:, None] * sk_m + cols[None, :] * sk_k,
                           mask=in_rows, other=0)
        e_all = tl.zeros([BLOCK, G], dtype=tl.float32)
        for j in range(G):
            here = cols[None, :] == j
            col = tl.max(tl.where(here, w, float("-inf")), axis=1)  # exact, -0.0 kept
            y = tl.math.div_rn(col, step)
            a = tl.abs(y)
            v = tl.where(a > c0, 0.5, 0.0)
            v = tl.where(a > c1, 1.0, v)
            v = tl.where(a > c2, 1.5, v)
            v = tl.where(a > c3, 2.0, v)
            v = tl.where(a > c4, 3.0, v)
            v = tl.where(a > c5, 4.0, v)
            v = tl.where(a > c6, 6.0, v)
            q = tl.where(y < 0, -v, v) * step
            if MASKED:
                kept = tl.max(tl.where(here, keep, 0), axis=1) != 0
                q = tl.where(kept, q, 0.0)
            d = tl.load(u_ptr + b * su_b + j * su_r + j * su_c)
            e = tl.math.div_rn(col - q, d)
            u_row = tl.load(u_ptr + b * su_b + j * su_r + cols * su_c, mask=cols > j,
                            other=0.0)
            later = cols[None, :] > j
            w = tl.where(later, w - e[:, None] * u_row[None, :], w)
            w = tl.where(here, q[:, None], w)
            e_all = tl.where(here, e[:, None], e_all)
        tl.store(w_at, w, mask=in_rows)
        tl.store(e_ptr + b * se_b + r[:, None] * se_m + cols[None, :] * se_k, e_all,
                 mask=in_rows)

    return column_loop_kernel


def column_loop(wg: torch.Tensor, ug: torch.Tensor, keep: torch.Tensor | None,
                step: torch.Tensor, eg: torch.Tensor) -> None:
    """kconvert.sparsity.obs.column_loop in one launch (same arguments, same results)."""
    import triton

    b, m, g = wg.shape
    if g & (g - 1):
        raise ValueError(f"the kernel takes power-of-two scale blocks, not {g}")
    cuts = nvfp4.cut_points(torch.device("cpu")).tolist()
    keep_arg = keep.view(torch.uint8) if keep is not None else wg
    keep_strides = keep_arg.stride() if keep is not None else (0, 0, 0)
    launch = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
    _kernel()[(b, triton.cdiv(m, BLOCK_M))](
        wg, ug, keep_arg, step, eg, m, *wg.stride(), *ug.stride(), *keep_strides,
        *step.stride(), *eg.stride(), *cuts, G=g, BLOCK=BLOCK_M, MASKED=keep is not None,
        **launch)
