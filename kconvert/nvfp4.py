"""NVFP4 math (formats.md §2), vectorised over a batch of matrices.

Operation order follows compressed-tensors' compressor exactly, so that with the same global
scale the `amax` block-scale rule gives its bytes bit for bit:
  global scale  gs = 2688 / amax                        (fp32; 1.0 when amax is 0)
  block scale   d  = fp8(clamp(gs * (block_amax / 6), 448)), and 0.125 where that is 0
  elements      y  = x / (fp32(d) / gs) -> E2M1, ties as compressed-tensors' cast_to_fp4
  decode        x' = E2M1[code] * (fp32(d) / gs)
The `mse` rule keeps the format and only picks, per block, the FP8 scale code (among a window
of codes around the amax rule's) that minimises the block's squared error against the fp32
source. Every reduction that decides a byte is done in a fixed order, so CPU and GPU agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
GLOBAL_NUMERATOR = FP8_MAX * FP4_MAX  # 2688
ZERO_BLOCK_SCALE = 0.125  # what compressed-tensors writes for a block whose scale is 0
_FP8_VALUES = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_ZERO_CODE = int(torch.tensor(ZERO_BLOCK_SCALE).to(torch.float8_e4m3fn).view(torch.uint8))
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Offsets (in FP8 code steps; 8 steps = one octave) tried around the amax rule's code by `mse`.
# On Kimi-style INT4 sources (codes -7..7 on a group-32 grid) the best scale is usually 4-6
# steps LARGER than the amax rule's (it puts the grid's 7s on E2M1's 4 and 6 instead of
# clipping), sometimes 1-2 smaller. Measured on random Kimi-style codes, this window reaches
# the exhaustive search over all 126 codes exactly (0.603x the amax rule's error), and Gaussian
# BF16 weights likewise (0.731x).
MSE_CODE_OFFSETS = (0, -2, -1, 1, 2, 3, 4, 5, 6, 7)
# Cut points of E2M1 rounding on |y|: a value is counted past a cut point when strictly
# greater; the cut points that round up on a tie (0.75, 1.75, 3.5) are moved one ulp down so
# that bucketize reproduces compressed-tensors' ties-to-even.
_CUTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)


@dataclass
class Quantized:
    """NVFP4 encoding of a batch of B matrices [B, M, K]."""

    packed: torch.Tensor  # uint8 [B, M, K/2], even element in the low nibble
    block_scale: torch.Tensor  # float8_e4m3fn [B, M, K/16]
    global_scale: torch.Tensor  # float32 [B], = 2688 / amax
    err_sq: torch.Tensor  # float64 [B], sum of squared error against the source
    ref_sq: torch.Tensor  # float64 [B], sum of squared source values


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """2688 / amax in fp32, with compressed-tensors' fallback of 1.0 for an all-zero set."""
    amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(GLOBAL_NUMERATOR / amax, nan=1.0, posinf=1.0, neginf=1.0)


def _cut_points(device: torch.device) -> torch.Tensor:
    cuts = torch.tensor(_CUTS, dtype=torch.float32, device=device)
    down = torch.nextafter(cuts, torch.zeros_like(cuts))
    return torch.where(torch.isin(cuts, torch.tensor(_TIE_UP, device=device)), down, cuts)


def _block_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) as a fixed pairwise tree: the same bits on every device."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _amax_block_scale(blocks: torch.Tensor, gs: torch.Tensor,
                      local_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 block scale codes (uint8 bits of float8_e4m3fn) by the amax rule.

    blocks [N, nb, 16], gs [N, 1]. Scale selection works on the uint8 bits: positive FP8
    codes are ordered like their values, and uint8 ops exist on every device.
    """
    # compressed-tensors divides the block amax by 6 in the weight's own dtype (bf16 for a
    # BF16 checkpoint) before multiplying by the fp32 global scale (formats.md §2).
    # Divide by a tensor, not a Python float: CUDA turns `t / 6.0` into `t * fp32(1/6)`, which
    # rounds differently from the CPU's true division and would change bytes between devices.
    six = torch.tensor(FP4_MAX, dtype=local_dtype, device=blocks.device)
    local = (blocks.abs().amax(dim=-1).to(local_dtype) / six).float()
    d = (gs * local).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(d == 0, _ZERO_CODE, d)


def _block_error(
    mag: torch.Tensor, d: torch.Tensor, gs: torch.Tensor, cuts: torch.Tensor, lut: torch.Tensor
) -> torch.Tensor:
    """Squared error per block of |x| blocks [N, nb, 16] under FP8 block scale codes d [N, nb].

    Working on magnitudes is exact: the sign of a code never changes its error.
    """
    step = (d.view(torch.float8_e4m3fn).float() / gs).unsqueeze(-1)
    idx = torch.bucketize(mag / step, cuts, out_int32=True)
    err = lut[idx] * step - mag
    return _block_sum(err * err)


def _nibbles(blocks: torch.Tensor, d: torch.Tensor, gs: torch.Tensor, cuts: torch.Tensor
             ) -> torch.Tensor:
    """E2M1 nibbles (sign << 3 | code) of blocks [N, nb, 16] under block scale codes d."""
    y = blocks / (d.view(torch.float8_e4m3fn).float() / gs).unsqueeze(-1)
    idx = torch.bucketize(y.abs(), cuts, out_int32=True).to(torch.uint8)
    # compressed-tensors takes the sign from sign(y): a negative value that rounds to 0 is
    # written 0x8, while -0.0 itself stays 0x0.
    return idx | ((y < 0).to(torch.uint8) << 3)


def quantize(
    w: torch.Tensor, amax: torch.Tensor, block_scale: str = "mse", chunk_elems: int = 1 << 22,
    fused_cpu: bool = True, local_dtype: torch.dtype = torch.float32,
) -> Quantized:
    """Encode fp32 matrices w [B, M, K] with one global scale per matrix from `amax` [B].

    `amax` is passed in (not taken from w) because a fused set's members share the largest
    amax of the set. All B*M rows are processed together in chunks of about `chunk_elems`
    elements, which bounds temporary memory and keeps kernel launches few on a GPU. On a CPU
    the block search runs in the fused numba kernel (`fused_cpu`), which gives the same bytes.
    """
    if block_scale not in ("amax", "mse"):
        raise ValueError(f"block_scale must be 'amax' or 'mse', not {block_scale!r}")
    b, m, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of {BLOCK}")
    device = w.device
    lut = torch.tensor(E2M1, dtype=torch.float32, device=device)
    cuts = _cut_points(device)
    gs = global_scale(amax.to(device))
    rows = w.reshape(b * m, k // BLOCK, BLOCK)
    row_gs = gs.repeat_interleave(m).unsqueeze(-1)  # [B*M, 1]
    packed = torch.empty(b * m, k // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(b * m, k // BLOCK, dtype=torch.float8_e4m3fn, device=device)
    row_err = torch.empty(b * m, dtype=torch.float64, device=device)
    row_ref = torch.empty(b * m, dtype=torch.float64, device=device)
    offsets = MSE_CODE_OFFSETS if block_scale == "mse" else MSE_CODE_OFFSETS[:1]
    kernel = _cpu_kernel() if fused_cpu and device.type == "cpu" else None
    step_rows = max(1, chunk_elems // k)
    for r0 in range(0, b * m, step_rows):
        sl = slice(r0, r0 + step_rows)
        blocks, gsi = rows[sl].float(), row_gs[sl]
        d = _amax_block_scale(blocks, gsi, local_dtype)
        if kernel is not None:
            kernel(blocks.reshape(-1, k).contiguous().numpy(), gsi[:, 0].contiguous().numpy(),
                   d.numpy(), np.array(offsets, dtype=np.int32), _FP8_VALUES.numpy(),
                   cuts.numpy(), packed[sl].numpy(),
                   scales.view(torch.uint8)[sl].numpy(), row_err[sl].numpy(),
                   row_ref[sl].numpy())
            continue
        mag = blocks.abs()
        err = _block_error(mag, d, gsi, cuts, lut)
        if block_scale == "mse":
            base = d.to(torch.int16)
            for off in offsets[1:]:
                code = (base + off).clamp(1, 0x7E).to(torch.uint8)
                cand = _block_error(mag, code, gsi, cuts, lut)
                better = cand < err  # strict: ties keep the earlier (amax-nearer) code
                err = torch.where(better, cand, err)
                d = torch.where(better, code, d)
        packed[sl] = pack_codes(_nibbles(blocks, d, gsi, cuts).flatten(-2))
        scales[sl] = d.view(torch.float8_e4m3fn)
        row_err[sl] = err.sum(-1, dtype=torch.float64)
        row_ref[sl] = mag.double().square().sum((-1, -2))
    return Quantized(
        packed.reshape(b, m, k // 2),
        scales.reshape(b, m, k // BLOCK),
        gs,
        row_err.reshape(b, m).sum(-1),
        row_ref.reshape(b, m).sum(-1),
    )


def _cpu_kernel():
    """The fused CPU block search, or None where numba is missing (torch path then)."""
    try:
        from kconvert.nvfp4_cpu import quantize_rows
    except ImportError:
        return None
    return quantize_rows


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> nibble codes uint8 [..., K] (low nibble = even element)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Nibble codes uint8 [..., K] -> uint8 [..., K/2]; inverse of unpack_codes."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """fp32 [B, M, K] from packed [B, M, K/2], block scales [B, M, K/16], global scales [B]."""
    codes = unpack_codes(packed)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = lut[(codes & 7).long()]
    values = torch.where((codes & 8).bool(), -values, values)
    step = block_scale.float() / gs.float().reshape(-1, 1, 1)
    b, m, k = values.shape
    return (values.reshape(b, m, k // BLOCK, BLOCK) * step.unsqueeze(-1)).reshape(b, m, k)
