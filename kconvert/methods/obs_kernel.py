"""The OBS engine's work on one scale block as one fused Triton kernel (docs/obs.md).

`kconvert.methods.obs.scale_block` (torch) runs well over a hundred small kernels per scale
block: the mask (SparseGPT's p48), the block's FP8 scale by the `--block-scale` rule (the mse
search alone is ten candidates of division, rounding, error and sum), then a handful per
column; 16 or 32 columns per block, hundreds of blocks per matrix, so on a GPU the loop is
bound by launches, not arithmetic. Here one launch does a whole scale block for a batch of
matrices: each program holds BLOCK_M rows of the block in registers, chooses their p48 mask
(when asked) and block-scale codes on them (kconvert.formats.nvfp4_triton, the encoder's
rule), then column by column rounds to the NVFP4 grid (the encoder's division, cut points and
sign rule), applies the mask, writes the scaled error and subtracts its rank-1 update from the
block's later columns.

Same arithmetic as the torch path, operation for operation: IEEE division (`div_rn`, not
Triton's fast division), a product then a subtraction (contraction into FMA is switched off
on the GPU), the mask's comparisons and tie rule (`p48.top2_pairs`), so the masks, codes and
W-hat are the torch path's; tested through Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1), counted on the GPU by benchmarks/obs.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kconvert.formats import nvfp4_triton as q

BLOCK_M = 64  # rows per program

# Masks the kernel chooses itself (a MaskRule's `fused` name, kconvert.methods.obs).
FUSED_MASKS = ("p48",)


@triton.jit
def p48_keep(w, d, BLOCK: tl.constexpr, G: tl.constexpr):
    """sparsegpt.p48_mask of w [BLOCK, G] with U's diagonal d [G]: int32 keep [BLOCK, G]."""
    score = tl.math.div_rn(w * w, (d * d)[None, :])
    even, odd = tl.split(tl.reshape(score, [BLOCK, G // 2, 2]))
    # pair p of a chunk of 4 at [..., p // 2, p % 2]
    a, b = tl.split(tl.reshape(even + odd, [BLOCK, G // 8, 2, 2]))
    s0, s2 = tl.split(a)
    s1, s3 = tl.split(b)
    # rank of a pair: the pairs with a higher score, or an equal one at a lower index
    r0 = (s1 > s0).to(tl.int32) + (s2 > s0).to(tl.int32) + (s3 > s0).to(tl.int32)
    r1 = (s0 >= s1).to(tl.int32) + (s2 > s1).to(tl.int32) + (s3 > s1).to(tl.int32)
    r2 = (s0 >= s2).to(tl.int32) + (s1 >= s2).to(tl.int32) + (s3 > s2).to(tl.int32)
    r3 = (s0 >= s3).to(tl.int32) + (s1 >= s3).to(tl.int32) + (s2 >= s3).to(tl.int32)
    k = tl.join(tl.join((r0 < 2).to(tl.int32), (r2 < 2).to(tl.int32)),
                tl.join((r1 < 2).to(tl.int32), (r3 < 2).to(tl.int32)))
    pairs = tl.reshape(k, [BLOCK, G // 2])
    return tl.reshape(tl.join(pairs, pairs), [BLOCK, G])


@triton.jit
def scale_block_kernel(w_ptr, u_ptr, gs_ptr, codes_ptr, e_ptr, offs_ptr, rows,
                       sw_b, sw_m, sw_k, su_b, su_r, su_c, sg_b, sg_m, sc_b, sc_m,
                       se_b, se_m, se_k, c0, c1, c2, c3, c4, c5, c6,
                       G: tl.constexpr, BLOCK: tl.constexpr, P48: tl.constexpr,
                       N_OFF: tl.constexpr, MSE: tl.constexpr, BF16_LOCAL: tl.constexpr,
                       MODELOPT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # a batch's offset passes 2^31 elements
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, G)
    live = r < rows
    in_rows = live[:, None] & (cols[None, :] < G)
    w_at = w_ptr + b * sw_b + r[:, None] * sw_m + cols[None, :] * sw_k
    w = tl.load(w_at, mask=in_rows, other=0.0)
    gs = tl.load(gs_ptr + b * sg_b + r * sg_m, mask=live, other=1.0)
    if P48:
        keep = p48_keep(w, tl.load(u_ptr + b * su_b + cols * (su_r + su_c)), BLOCK, G)
        blocks = tl.where(keep != 0, w, 0.0)
    else:
        blocks = w
    code = q.choose_codes(blocks, gs, offs_ptr, c0, c1, c2, c3, c4, c5, c6, N_OFF, MSE,
                          BF16_LOCAL, MODELOPT, BLOCK, G)
    tl.store(codes_ptr + b * sc_b + r * sc_m, code.to(tl.uint8), mask=live)
    step = q.block_step(code, gs, MODELOPT)
    e_all = tl.zeros([BLOCK, G], dtype=tl.float32)
    for j in range(G):
        here = cols[None, :] == j
        col = tl.max(tl.where(here, w, float("-inf")), axis=1)  # exact, -0.0 kept
        y = tl.math.div_rn(col, step)
        v = q.grid_value(tl.abs(y), c0, c1, c2, c3, c4, c5, c6)
        qv = tl.where(y < 0, -v, v) * step
        if P48:
            kept = tl.max(tl.where(here, keep, 0), axis=1) != 0
            qv = tl.where(kept, qv, 0.0)
        d = tl.load(u_ptr + b * su_b + j * su_r + j * su_c)
        e = tl.math.div_rn(col - qv, d)
        u_row = tl.load(u_ptr + b * su_b + j * su_r + cols * su_c, mask=cols > j,
                        other=0.0)
        later = cols[None, :] > j
        w = tl.where(later, w - e[:, None] * u_row[None, :], w)
        w = tl.where(here, qv[:, None], w)
        e_all = tl.where(here, e[:, None], e_all)
    tl.store(w_at, w, mask=in_rows)
    tl.store(e_ptr + b * se_b + r[:, None] * se_m + cols[None, :] * se_k, e_all,
             mask=in_rows)



def supports(mask: str | None, local_dtype: torch.dtype, group_size: int) -> bool:
    """Whether the kernel does a scale block with this mask (a FUSED_MASKS name or None),
    block-scale local dtype and block size."""
    return ((mask is None or mask in FUSED_MASKS) and local_dtype in q.LOCAL_DTYPES
            and not group_size & (group_size - 1))


def scale_block(wg: torch.Tensor, ug: torch.Tensor, gs: torch.Tensor, mask: str | None,
                rule: str, local_dtype: torch.dtype, arithmetic: str, eg: torch.Tensor
                ) -> torch.Tensor:
    """kconvert.methods.obs.scale_block in one launch (same arguments but the mask, named
    here: None or a FUSED_MASKS name; same results)."""
    b, m, g = wg.shape
    if not supports(mask, local_dtype, g):
        raise ValueError(f"the OBS kernel takes masks {FUSED_MASKS} or none, local dtypes "
                         f"{q.LOCAL_DTYPES} and power-of-two scale blocks, not "
                         f"{mask!r}, {local_dtype}, {g}")
    codes = torch.empty(b, m, dtype=torch.uint8, device=wg.device)
    cuts, offs = q.constants(wg.device)
    scale_block_kernel[(b, triton.cdiv(m, BLOCK_M))](
        wg, ug, gs, codes, eg, offs, m, *wg.stride(), *ug.stride(), *gs.stride(),
        *codes.stride(), *eg.stride(), *cuts, G=g, BLOCK=BLOCK_M, P48=mask == "p48",
        **q.rule_flags(rule, local_dtype, arithmetic), **q.launch_options())
    return codes
