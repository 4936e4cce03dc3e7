"""The `mse` block-scale rule pinned against a search written here over every FP8 e4m3 code.

Everything below the imports is written from formats.md §2 and the README alone: FP8 e4m3
values from their bits, E2M1 rounding to the nearest value with ties to the even code, each
block's squared error summed as the fixed pairwise tree the format notes name (so that two
codes compare exactly as kconvert compares them), the amax rule's code, the documented
window (the amax code -2 .. +7, clamped to the positive finite codes) and every one of the
126 positive finite codes. For every block, the error of the code kconvert wrote must equal
the window's minimum exactly, and (as the README and formats.md state) the window's minimum
equals the exhaustive minimum on Kimi-style INT4 sources and on Gaussian weights.
"""

from __future__ import annotations

import pytest
import torch

from kconvert.formats import nvfp4

BLOCK = 16
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CODES = torch.arange(1, 0x7F)  # every positive finite FP8 e4m3 code


def fp8_value(code: torch.Tensor) -> torch.Tensor:
    """Value of positive FP8 e4m3 codes (4 exponent bits, bias 7, 3 mantissa bits)."""
    exp, man = (code >> 3) & 0xF, (code & 7).float()
    normal = (1 + man / 8) * torch.pow(2.0, exp.float() - 7)
    return torch.where(exp == 0, man / 8 * 2.0 ** -6, normal)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """|y| to the nearest E2M1 value; on a tie the even code (the neighbours' differences are
    exact in fp32, so a tie is seen exactly)."""
    dist = (y.unsqueeze(-1) - E2M1_VALUES).abs()
    nearest = dist == dist.amin(-1, keepdim=True)
    even = torch.arange(8) % 2 == 0
    idx = (nearest.float() * 2 + even.float() * nearest.float()).argmax(-1)
    return E2M1_VALUES[idx]


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def block_errors(mag: torch.Tensor, gs: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Squared error [N, nb, C] of |x| blocks [N, nb, 16] (row scales gs [N]) under each of
    the codes [N, nb, C] (compressed-tensors' arithmetic: step = fp32(d) / gs)."""
    step = fp8_value(codes) / gs[:, None, None]  # [N, nb, C]
    y = mag.unsqueeze(-2) / step.unsqueeze(-1)  # [N, nb, C, 16]
    err = round_e2m1(y) * step.unsqueeze(-1) - mag.unsqueeze(-2)
    return pairwise_sum(err * err)


def amax_code(mag: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    d = gs[:, None] * (mag.amax(-1) / torch.tensor(6.0))
    return d.clamp(max=448.0).to(torch.float8_e4m3fn).view(torch.uint8).long()


def check_against_search(w: torch.Tensor, q: nvfp4.Quantized, exhaustive: bool = True) -> None:
    n = w.shape[0] * w.shape[1]
    mag = w.reshape(n, -1, BLOCK).abs().float()
    gs = q.global_scale.float().repeat_interleave(w.shape[1])
    chosen = q.block_scales.reshape(n, -1).view(torch.uint8).long()
    got = block_errors(mag, gs, chosen.unsqueeze(-1))[..., 0]
    window = (amax_code(mag, gs).unsqueeze(-1) + torch.arange(-2, 8)).clamp(1, 0x7E)
    best_window = block_errors(mag, gs, window).amin(-1)
    assert torch.equal(got, best_window), (
        f"{int((got != best_window).sum())} of {got.numel()} blocks are not at the window's "
        f"minimum; total error {float(got.double().sum()):.6g} vs "
        f"{float(best_window.double().sum()):.6g}")
    if exhaustive:
        everything = block_errors(mag, gs, CODES.expand(*mag.shape[:2], -1)).amin(-1)
        assert torch.equal(best_window, everything)


def kimi_int4(b: int, m: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi-style INT4: codes -7..7 (value (nibble - 8) * scale), bf16 scales per 32."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-7, 8, (b, m, k), generator=g)
    nib = (codes + 8).to(torch.int64)
    words = torch.zeros(b, m, k // 8, dtype=torch.int64)
    for i in range(8):
        words |= nib[..., i::8] << (4 * i)
    packed = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    scale = (torch.rand(b, m, k // 32, generator=g) * 0.02 + 1e-3).bfloat16()
    return packed, scale, codes.float() * scale.float().repeat_interleave(32, -1)


def test_int4_source_blocks_reach_the_window_and_exhaustive_minimum():
    packed, scale, w = kimi_int4(2, 48, 256, seed=0)
    amax = w.abs().amax((1, 2))
    check_against_search(w, nvfp4.quantize_int4(packed, scale, amax, "mse"))


@pytest.mark.parametrize("fused_cpu", [True, False])
def test_gaussian_blocks_reach_the_window_and_exhaustive_minimum(fused_cpu):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 48, 256, generator=g) * torch.rand(2, 48, 1, generator=g)
    q = nvfp4.quantize(w, w.abs().amax((1, 2)), "mse", fused_cpu=fused_cpu)
    check_against_search(w, q)


def test_amax_rule_is_the_window_center():
    """The `amax` rule writes the amax code of every block (the window's centre above)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1, 32, 128, generator=g)
    q = nvfp4.quantize(w, w.abs().amax((1, 2)), "amax")
    mag = w.reshape(32, -1, BLOCK).abs()
    gs = q.global_scale.float().repeat_interleave(32)
    assert torch.equal(q.block_scales.reshape(32, -1).view(torch.uint8).long(),
                       amax_code(mag, gs))
