"""NVFP4's value grids (docs/formats.md §2): E2M1 element codes, FP8 e4m3 block-scale codes and
the element steps they give, the rounding cut points, and the constants of the format. Shared
by the torch path (kconvert.formats.nvfp4) and the CPU kernels (kconvert.formats.nvfp4_cpu)."""

from __future__ import annotations

import torch

BLOCK = 16  # dense NVFP4 (compressed-tensors, ModelOpt)
BLOCK_SIZES = (16, 32)
FP4_MAX = 6.0
FP8_MAX = 448.0
GLOBAL_NUMERATOR = FP8_MAX * FP4_MAX  # 2688
ZERO_BLOCK_SCALE = 0.125  # what compressed-tensors writes for a block whose scale is 0
FP8_VALUES = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
ZERO_CODE = int(torch.tensor(ZERO_BLOCK_SCALE).to(torch.float8_e4m3fn).view(torch.uint8))
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Offsets (in FP8 code steps; 8 steps = one octave) tried around the amax rule's code by `mse`.
# On Kimi-style INT4 sources (codes -7..7 on a group-32 grid) the best scale is usually 4-6
# steps LARGER than the amax rule's (it puts the grid's 7s on E2M1's 4 and 6 instead of
# clipping), sometimes 1-2 smaller. Measured on random Kimi-style codes, this window reaches
# the exhaustive search over all 126 codes exactly (0.603x the amax rule's error), and Gaussian
# BF16 weights likewise (0.731x).
MSE_CODE_OFFSETS = (0, -2, -1, 1, 2, 3, 4, 5, 6, 7)
# The local dtypes (compressed-tensors' `block_amax / 6`) the Triton block-scale choice
# reproduces (kconvert.formats.nvfp4_triton); another source dtype's blocks take torch's.
TRITON_LOCAL_DTYPES = (torch.float32, torch.bfloat16)
# Cut points of E2M1 rounding on |y|: a value is counted past a cut point when strictly
# greater; the cut points that round up on a tie (0.75, 1.75, 3.5) are moved one ulp down so
# that bucketize reproduces compressed-tensors' ties-to-even.
CUTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
TIE_UP = (0.75, 1.75, 3.5)


def cut_points(device: torch.device) -> torch.Tensor:
    cuts = torch.tensor(CUTS, dtype=torch.float32, device=device)
    down = torch.nextafter(cuts, torch.zeros_like(cuts))
    return torch.where(torch.isin(cuts, torch.tensor(TIE_UP, device=device)), down, cuts)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """y rounded to the E2M1 grid (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6) by
    arithmetic alone, with the ties `cut_points` gives (to even: 0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4): the grid's step is 0.5 below 2, 1 up
    to 4 and 2 above, and torch.round rounds half to even. Elementwise only (no table, no
    search), so a compiler fuses it with what comes before and after."""
    a = y.abs()
    q = torch.where(a < 2, torch.round(a * 2) / 2,
                    torch.where(a < 4, torch.round(a), (torch.round(a / 2) * 2).clamp(max=6)))
    return torch.where(y < 0, -q, q)


def block_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16 or 32) as a fixed pairwise tree: the same bits on every device."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> nibble codes uint8 [..., K] (low nibble = even element)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Nibble codes uint8 [..., K] -> uint8 [..., K/2]; inverse of unpack_codes."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def block_step(d: torch.Tensor, gs: torch.Tensor, arithmetic: str = "compressed-tensors"
               ) -> torch.Tensor:
    """Element step [..., nb, 1] of FP8 block scales d [..., nb] (uint8 codes or
    float8_e4m3fn) with per-tensor scales gs broadcast against d: fp32(d) / gs, or for
    ModelOpt's arithmetic fp32(d) * gs."""
    d = d.view(torch.float8_e4m3fn).float()
    return (d * gs if arithmetic == "modelopt" else d / gs).unsqueeze(-1)
