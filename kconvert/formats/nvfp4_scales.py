"""NVFP4's scales (formats.md §2): the per-tensor scale of each flavour's arithmetic, and the
FP8 block scales a rule chooses (`amax`, or the `mse` search around it), by torch or Triton;
kconvert.formats.nvfp4 encodes and decodes with them.
"""

from __future__ import annotations

import importlib.util

import torch

from kconvert.formats.nvfp4_grid import (
    E2M1,
    FP4_MAX,
    FP8_MAX,
    GLOBAL_NUMERATOR,
    MSE_CODE_OFFSETS,
    TRITON_LOCAL_DTYPES,
    ZERO_CODE,
    block_step,
    block_sum,
    cut_points,
)

# How the two NVFP4 flavours compute their scales (docs/formats.md §2). The bytes mean the same
# thing in both, but the fp32 arithmetic differs, and with it the rounding on rare boundaries:
#   compressed-tensors  g = 2688 / amax   d = fp8(g * (block_amax / 6))   step = fp32(d) / g
#   modelopt            g = amax / 2688   d = fp8(block_amax / (6 * g))   step = fp32(d) * g
# Each flavour's `amax` rule gives its own tool's bytes exactly for the same g.
ARITHMETIC = ("compressed-tensors", "modelopt")


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """2688 / amax in fp32, with compressed-tensors' fallback of 1.0 for an all-zero set."""
    amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(GLOBAL_NUMERATOR / amax, nan=1.0, posinf=1.0, neginf=1.0)


def tensor_scale(amax: torch.Tensor, arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """The per-tensor scale g of `arithmetic` for `amax` [B]: compressed-tensors' 2688 / amax
    (`global_scale`) or ModelOpt's amax / 2688 (its weights_scaling_factor_2, computed as its
    NVFP4QTensor computes it). An all-zero set gets 1.0 in both (its blocks encode as zeros)."""
    if arithmetic == "compressed-tensors":
        return global_scale(amax)
    check_arithmetic(arithmetic)
    amax = amax.float()
    return torch.where(amax > 0, amax / GLOBAL_NUMERATOR, torch.ones_like(amax))


def recorded_scale(stored: torch.Tensor, amax: torch.Tensor, arithmetic: str) -> torch.Tensor:
    """compressed-tensors' form of the per-tensor scales, 2688 / amax, which the manifest
    records whatever the flavour: `stored` (as `arithmetic` stores them) as it is in
    compressed-tensors' arithmetic, else from `amax`."""
    return global_scale(amax) if arithmetic == "modelopt" else stored


def stored_scale(recorded: torch.Tensor, amax: torch.Tensor, arithmetic: str) -> torch.Tensor:
    """The per-tensor scales `arithmetic` stores for sets the manifest records with `recorded`
    (2688 / amax, exact) and `amax`: what the flavour's own encoder writes (ModelOpt's
    amax / 2688 is computed from amax, as its encoder computes it)."""
    return tensor_scale(amax, arithmetic) if arithmetic == "modelopt" else recorded


def check_arithmetic(arithmetic: str) -> None:
    if arithmetic not in ARITHMETIC:
        raise ValueError(f"NVFP4 arithmetic must be one of {ARITHMETIC}, not {arithmetic!r}")


def check_rule(rule: str) -> None:
    if rule not in ("amax", "mse"):
        raise ValueError(f"the block-scale rule must be 'amax' or 'mse', not {rule!r}")


def amax_block_codes(blocks: torch.Tensor, gs: torch.Tensor,
                      local_dtype: torch.dtype = torch.float32,
                      arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """FP8 block scale codes (uint8 bits of float8_e4m3fn) by the amax rule.

    blocks [N, nb, block], gs [N, 1]. Scale selection works on the uint8 bits: positive FP8
    codes are ordered like their values, and uint8 ops exist on every device.
    """
    if arithmetic == "modelopt":
        # ModelOpt: block_amax / (6 * g) in fp32, an all-zero block 1.0, then clamped to
        # [2^-9, 448] before the FP8 cast (NVFP4QTensor.get_weights_scaling_factor).
        six_g = torch.tensor(FP4_MAX, dtype=torch.float32, device=blocks.device) * gs
        d = blocks.abs().amax(dim=-1).float() / six_g
        d = torch.where(d == 0, torch.ones_like(d), d)
        return d.clamp(2.0**-9, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    # compressed-tensors divides the block amax by 6 in the weight's own dtype (bf16 for a
    # BF16 checkpoint) before multiplying by the fp32 global scale (formats.md §2).
    # Divide by a tensor, not a Python float: CUDA turns `t / 6.0` into `t * fp32(1/6)`, which
    # rounds differently from the CPU's true division and would change bytes between devices.
    six = torch.tensor(FP4_MAX, dtype=local_dtype, device=blocks.device)
    local = (blocks.abs().amax(dim=-1).to(local_dtype) / six).float()
    d = (gs * local).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(d == 0, ZERO_CODE, d)


def block_error(
    mag: torch.Tensor, d: torch.Tensor, gs: torch.Tensor, cuts: torch.Tensor, lut: torch.Tensor,
    arithmetic: str = "compressed-tensors",
) -> torch.Tensor:
    """Squared error per block of |x| blocks [N, nb, block] under FP8 block scale codes d [N, nb].

    Working on magnitudes is exact: the sign of a code never changes its error.
    """
    step = block_step(d, gs, arithmetic)
    idx = torch.bucketize(mag / step, cuts, out_int32=True)
    err = lut[idx] * step - mag
    return block_sum(err * err)


def rounding(blocks: torch.Tensor, d: torch.Tensor, gs: torch.Tensor, cuts: torch.Tensor,
              arithmetic: str = "compressed-tensors") -> tuple[torch.Tensor, ...]:
    """(y = blocks / step, E2M1 index of |y| (int32), step [N, nb, 1]) of blocks [N, nb, block]
    under block scale codes d, for the nibbles (sign << 3 | index, the sign of y as in
    compressed-tensors: a negative value that rounds to 0 is 0x8, -0.0 and +0.0 0x0), the
    values and the error (|x| / step is |x / step|, bit for bit)."""
    step = block_step(d, gs, arithmetic)
    y = blocks / step
    return y, torch.bucketize(y.abs(), cuts, out_int32=True), step


def choose(blocks: torch.Tensor, gs: torch.Tensor, rule: str, local_dtype: torch.dtype,
            cuts: torch.Tensor, lut: torch.Tensor, arithmetic: str = "compressed-tensors"
            ) -> torch.Tensor:
    """Block scale codes [N, nb] by `rule`."""
    mag = blocks.abs()
    d = amax_block_codes(blocks, gs, local_dtype, arithmetic)
    err = block_error(mag, d, gs, cuts, lut, arithmetic)
    if rule == "mse":
        base = d.to(torch.int16)
        for off in MSE_CODE_OFFSETS[1:]:
            code = (base + off).clamp(1, 0x7E).to(torch.uint8)
            cand = block_error(mag, code, gs, cuts, lut, arithmetic)
            better = cand < err  # strict: ties keep the earlier (amax-nearer) code
            err = torch.where(better, cand, err)
            d = torch.where(better, code, d)
    return d


# Who chooses block scales and encodes, same bytes either way: "torch", "triton" (nvfp4_triton:
# CUDA, or TRITON_INTERPRET=1), "auto" (triton on CUDA when it imports and, for the choice,
# takes the local dtype).
CHOOSERS = ("auto", "torch", "triton")


def use_triton(kernel: str, device: torch.device) -> bool:
    if kernel not in CHOOSERS:
        raise ValueError(f"kernel must be one of {CHOOSERS}, not {kernel!r}")
    return kernel == "triton" or (kernel == "auto" and device.type == "cuda"
                                  and importlib.util.find_spec("triton") is not None)


def choose_block_codes(blocks: torch.Tensor, gs: torch.Tensor, rule: str,
                       local_dtype: torch.dtype = torch.float32,
                       arithmetic: str = "compressed-tensors", kernel: str = "auto"
                       ) -> torch.Tensor:
    """The FP8 block scale codes `quantize` picks for blocks [N, nb, block] (fp32).

    gs [N, 1]: each row's per-tensor scale (`tensor_scale` of its amax); rule: "amax" or
    "mse", as quantize's `scale_rule`; local_dtype and arithmetic: as quantize's; kernel: who
    computes them (CHOOSERS). Returns uint8 codes [N, nb] (bits of float8_e4m3fn, always
    1..0x7E for finite input), on the blocks' device.
    """
    check_rule(rule)
    check_arithmetic(arithmetic)
    device = blocks.device
    if use_triton(kernel, device) and (kernel == "triton" or local_dtype in TRITON_LOCAL_DTYPES):
        from kconvert.formats import nvfp4_triton

        return nvfp4_triton.choose_block_codes(blocks, gs, rule, local_dtype, arithmetic)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=device)
    return choose(blocks.float(), gs.float(), rule, local_dtype, cut_points(device), lut,
                   arithmetic)


def fake_quantize(blocks: torch.Tensor, codes: torch.Tensor, gs: torch.Tensor,
                  arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """The fp32 values dequantize(quantize(...)) gives blocks [N, nb, block] (fp32) with FP8
    block scale codes [N, nb] (uint8) and row global scales gs [N, 1], each rounded exactly as
    `quantize` rounds it (the last dim may be any part of a block: rounding is per element)."""
    blocks = blocks.float()
    y, idx, step = rounding(blocks, codes, gs, cut_points(blocks.device), arithmetic)
    v = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)[idx]
    return torch.where(y < 0, -v, v) * step  # decode_steps' values, without the nibbles

