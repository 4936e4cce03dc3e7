"""NVFP4 block-scale choice (formats.md §2) in Triton: the amax rule and the mse search over
MSE_CODE_OFFSETS in one launch, where the torch path (kconvert.formats.nvfp4) runs about 130
elementwise kernels, each a full pass over the blocks (the amax rule, then ten candidates of
division, rounding, error and a tree sum). The jit helpers here are also inlined into the OBS
engine's in-block kernel (kconvert.methods.obs_kernel), which picks each scale block's code
on the error-updated weights it already holds.

Bit for bit the torch path's codes, operation for operation: IEEE division (`div_rn`), the
fp32 -> FP8 e4m3 and fp32 -> bf16 casts as integer round-half-to-even on the bits (what torch's
casts do, written out so that no backend's conversion instruction is relied on), the E2M1 cut
points, the same fixed pairwise tree for each block's squared error (`nvfp4.block_sum`), and
the same strict comparison order over the candidates. Launch with fp contraction off
(`LAUNCH`). Tested on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1), counted
on the GPU by benchmarks/obs.py (part `kernel`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kconvert.formats.nvfp4_grid import MSE_CODE_OFFSETS, ZERO_CODE, cut_points
from kconvert.formats.nvfp4_grid import TRITON_LOCAL_DTYPES as LOCAL_DTYPES

BLOCKS_PER_PROGRAM = 64

ZERO = tl.constexpr(ZERO_CODE)  # a jit function reads module globals only as constexprs


def launch_options() -> dict:
    """No fp contraction (a product then a sum, as torch's separate kernels round them); the
    interpreter takes no such option."""
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@functools.cache
def constants(device: torch.device) -> tuple[list[float], torch.Tensor]:
    """(the E2M1 cut points as 7 floats, MSE_CODE_OFFSETS int32 on `device`): the arguments
    `choose_codes` reads them from (made once per device: no copy to the device per launch)."""
    return (cut_points(torch.device("cpu")).tolist(),
            torch.tensor(MSE_CODE_OFFSETS, dtype=torch.int32, device=device))


def rule_flags(rule: str, local_dtype: torch.dtype, arithmetic: str) -> dict:
    """The constexpr arguments of `choose_codes` for a block-scale rule, local dtype and
    arithmetic (nvfp4.ARITHMETIC)."""
    return {"N_OFF": len(MSE_CODE_OFFSETS), "MSE": rule == "mse",
            "BF16_LOCAL": local_dtype == torch.bfloat16, "MODELOPT": arithmetic == "modelopt"}


@triton.jit
def fp8_value(code):
    """fp32 value of positive FP8 e4m3 codes (int32, 0..0x7E): exact."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def fp8_code(x):
    """FP8 e4m3fn code (int32) of fp32 x in [0, 448], round half to even; NaN -> 0x7F."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
    t = x * 512.0  # below 2^-6: a multiple of 2^-9, rounded as an integer
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(x < 0.015625, sub, normal)
    return tl.where(x != x, 0x7F, code)


@triton.jit
def bf16_round(x):
    """fp32 x >= 0 rounded to bf16 (half to even), as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def block_step(code, gs, MODELOPT: tl.constexpr):
    """nvfp4.block_step: fp32(code) / gs, ModelOpt's fp32(code) * gs."""
    if MODELOPT:
        return fp8_value(code) * gs
    return tl.math.div_rn(fp8_value(code), gs)


@triton.jit
def grid_value(a, c0, c1, c2, c3, c4, c5, c6):
    """E2M1 magnitude |y| rounds to (bucketize on the cut points: past a cut when greater)."""
    v = tl.where(a > c0, 0.5, 0.0)
    v = tl.where(a > c1, 1.0, v)
    v = tl.where(a > c2, 1.5, v)
    v = tl.where(a > c3, 2.0, v)
    v = tl.where(a > c4, 3.0, v)
    v = tl.where(a > c5, 4.0, v)
    return tl.where(a > c6, 6.0, v)


@triton.jit
def tree_sum(x, R: tl.constexpr, G: tl.constexpr):
    """nvfp4.block_sum of x [R, G] (G 16 or 32): pairs (0,1), (2,3)... summed level by level."""
    a, b = tl.split(tl.reshape(x, [R, G // 2, 2]))
    x = a + b
    a, b = tl.split(tl.reshape(x, [R, G // 4, 2]))
    x = a + b
    a, b = tl.split(tl.reshape(x, [R, G // 8, 2]))
    x = a + b
    a, b = tl.split(tl.reshape(x, [R, G // 16, 2]))
    x = a + b
    if G == 32:
        a, b = tl.split(tl.reshape(x, [R, 1, 2]))
        x = a + b
    return tl.reshape(x, [R])


@triton.jit
def block_error(mag, code, gs, c0, c1, c2, c3, c4, c5, c6, MODELOPT: tl.constexpr,
                R: tl.constexpr, G: tl.constexpr):
    """nvfp4_scales.block_error: squared error [R] of |x| blocks [R, G] under codes [R]."""
    step = block_step(code, gs, MODELOPT)[:, None]
    err = grid_value(tl.math.div_rn(mag, step), c0, c1, c2, c3, c4, c5, c6) * step - mag
    return tree_sum(err * err, R, G)


@triton.jit
def choose_codes(x, gs, offs_ptr, c0, c1, c2, c3, c4, c5, c6, N_OFF: tl.constexpr,
                 MSE: tl.constexpr, BF16_LOCAL: tl.constexpr, MODELOPT: tl.constexpr,
                 R: tl.constexpr, G: tl.constexpr):
    """nvfp4.choose_block_codes of blocks x [R, G] (fp32) with global scales gs [R]: int32
    codes [R]. N_OFF offsets at offs_ptr (MSE_CODE_OFFSETS, 0 first)."""
    mag = tl.abs(x)
    amax = tl.max(mag, axis=1)
    if MODELOPT:
        d = tl.math.div_rn(amax, 6.0 * gs)
        d = tl.where(d == 0, 1.0, d)
        d = tl.minimum(tl.maximum(d, 0.001953125, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
        code = fp8_code(d)
    else:
        if BF16_LOCAL:
            local = bf16_round(tl.math.div_rn(bf16_round(amax), 6.0))
        else:
            local = tl.math.div_rn(amax, 6.0)
        code = fp8_code(tl.minimum(gs * local, 448.0, propagate_nan=tl.PropagateNan.ALL))
        code = tl.where(code == 0, ZERO, code)
    if MSE:
        err = block_error(mag, code, gs, c0, c1, c2, c3, c4, c5, c6, MODELOPT, R, G)
        base = code
        for i in range(1, N_OFF):
            cand_code = tl.minimum(tl.maximum(base + tl.load(offs_ptr + i), 1), 0x7E)
            cand = block_error(mag, cand_code, gs, c0, c1, c2, c3, c4, c5, c6, MODELOPT, R, G)
            better = cand < err  # strict: ties keep the earlier (amax-nearer) code
            err = tl.where(better, cand, err)
            code = tl.where(better, cand_code, code)
    return code


@triton.jit
def _choose_kernel(x_ptr, gs_ptr, offs_ptr, out_ptr, n_blocks, per_row,
                   c0, c1, c2, c3, c4, c5, c6, N_OFF: tl.constexpr, MSE: tl.constexpr,
                   BF16_LOCAL: tl.constexpr, MODELOPT: tl.constexpr, R: tl.constexpr,
                   G: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    live = blk < n_blocks
    cols = tl.arange(0, G)
    x = tl.load(x_ptr + blk[:, None] * G + cols[None, :], mask=live[:, None], other=0.0)
    gs = tl.load(gs_ptr + blk // per_row, mask=live, other=1.0)
    code = choose_codes(x, gs, offs_ptr, c0, c1, c2, c3, c4, c5, c6, N_OFF, MSE, BF16_LOCAL,
                        MODELOPT, R, G)
    tl.store(out_ptr + blk, code.to(tl.uint8), mask=live)


def choose_block_codes(blocks: torch.Tensor, gs: torch.Tensor, rule: str,
                       local_dtype: torch.dtype = torch.float32,
                       arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """nvfp4.choose_block_codes (same arguments, same codes) in one launch: blocks
    [N, nb, G] (G 16 or 32), gs [N, 1], local_dtype one of LOCAL_DTYPES."""
    if local_dtype not in LOCAL_DTYPES:
        raise ValueError(f"the Triton block-scale choice takes local dtypes {LOCAL_DTYPES}, "
                         f"not {local_dtype}")
    n, nb, g = blocks.shape
    x = blocks.float().contiguous()
    out = torch.empty(n, nb, dtype=torch.uint8, device=blocks.device)
    if not out.numel():
        return out
    cuts, offs = constants(blocks.device)
    grid = (triton.cdiv(n * nb, BLOCKS_PER_PROGRAM),)
    _choose_kernel[grid](x, gs.float().reshape(n).contiguous(), offs, out, n * nb, nb, *cuts,
                         R=BLOCKS_PER_PROGRAM, G=g, **rule_flags(rule, local_dtype, arithmetic),
                         **launch_options())
    return out


@triton.jit
def _encode_kernel(x_ptr, gs_ptr, code_ptr, packed_ptr, err_ptr, n_blocks, per_row,
                   c0, c1, c2, c3, c4, c5, c6, MODELOPT: tl.constexpr, R: tl.constexpr,
                   G: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    live = blk < n_blocks
    x = tl.load(x_ptr + blk[:, None] * G + tl.arange(0, G)[None, :], mask=live[:, None],
                other=0.0)
    gs = tl.load(gs_ptr + blk // per_row, mask=live, other=1.0)
    code = tl.load(code_ptr + blk, mask=live, other=1).to(tl.int32)
    step = block_step(code, gs, MODELOPT)[:, None]
    y = tl.math.div_rn(x, step)
    a = tl.abs(y)
    idx = ((a > c0).to(tl.int32) + (a > c1).to(tl.int32) + (a > c2).to(tl.int32)
           + (a > c3).to(tl.int32) + (a > c4).to(tl.int32) + (a > c5).to(tl.int32)
           + (a > c6).to(tl.int32))  # bucketize on the cut points
    nibble = idx | ((y < 0).to(tl.int32) << 3)
    even, odd = tl.split(tl.reshape(nibble, [R, G // 2, 2]))
    tl.store(packed_ptr + blk[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :],
             (even | (odd << 4)).to(tl.uint8), mask=live[:, None])
    err = grid_value(a, c0, c1, c2, c3, c4, c5, c6) * step - tl.abs(x)
    tl.store(err_ptr + blk, tree_sum(err * err, R, G), mask=live)


def encode(blocks: torch.Tensor, codes: torch.Tensor, gs: torch.Tensor,
           arithmetic: str = "compressed-tensors") -> tuple[torch.Tensor, torch.Tensor]:
    """The torch encoder's work on blocks [N, nb, G] (G 16 or 32) with their FP8 block-scale
    codes [N, nb] (uint8) and global scales gs [N, 1], in one launch: (packed nibbles uint8
    [N, nb * G / 2], even element low; each block's squared error fp32 [N, nb], summed by
    `nvfp4.block_sum`'s tree). Bit for bit nvfp4.quantize's torch path (its division,
    rounding, sign rule and error), reading each element once."""
    n, nb, g = blocks.shape
    x = blocks.float().contiguous()
    packed = torch.empty(n, nb * g // 2, dtype=torch.uint8, device=blocks.device)
    err = torch.empty(n, nb, dtype=torch.float32, device=blocks.device)
    if not err.numel():
        return packed, err
    grid = (triton.cdiv(n * nb, BLOCKS_PER_PROGRAM),)
    _encode_kernel[grid](x, gs.float().reshape(n).contiguous(), codes.contiguous(), packed, err,
                         n * nb, nb, *constants(blocks.device)[0],
                         MODELOPT=arithmetic == "modelopt", R=BLOCKS_PER_PROGRAM, G=g,
                         **launch_options())
    return packed, err


__all__ = ["BLOCKS_PER_PROGRAM", "LOCAL_DTYPES", "ZERO", "block_step", "choose_block_codes",
           "choose_codes", "constants", "encode", "grid_value", "launch_options", "rule_flags"]
