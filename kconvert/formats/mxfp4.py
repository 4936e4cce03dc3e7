"""MXFP4 math (docs/formats.md §6, OCP Microscaling v1.0), vectorised over a batch of matrices.

One E8M0 scale per block of 32 elements along the input dim, no per-tensor scale:
  scale code  c = clamp(floor(log2(round_up(block_amax))) - 2, -127, 127) + 127   (uint8)
              round_up: block_amax's fp32 mantissa rounded up to the next power of two
              when it is >= 1.75 (the amax would otherwise land on E2M1 7, beyond 6)
  step        s = 2^(c - 127)                    (exact in fp32; c = 0 is 2^-127, subnormal)
  elements    y = x / s -> E2M1, ties to even, saturating at 6; nibble = sign << 3 | code
  decode      x' = E2M1[code] * s
The `amax` rule is AMD Quark's "even" scale mode and compressed-tensors' MX scale rule alike,
so it gives both tools' bytes bit for bit. The two tools differ in two corners only, which
each layout's codec passes as a `Flavour`: a negative value that rounds to 0 keeps its sign
bit (0x8) in compressed-tensors and is written 0x0 by Quark; an all-zero block's scale code
is 0 in compressed-tensors and 1 in Quark (which clamps its exported exponent to 2^-126).
The `mse` rule keeps the format and picks, per block, the scale code among the amax rule's
and its neighbours (one octave either way) that gives the least squared error against the
fp32 source. Every value that decides a byte is
computed exactly (bit operations, power-of-two steps, E2M1 cut points) and every block error
is summed in a fixed order, so CPU and GPU write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kconvert.errors import KconvertError
from kconvert.formats.nvfp4 import E2M1, block_sum, cut_points, decode_steps, pack_codes

BLOCK = 32
BIAS = 127  # E8M0: the byte c means 2^(c - 127); 255 is NaN
EMAX_ELEM = 2  # floor(log2(6)), E2M1's largest exponent
NAN_CODE = 255
# Scale code offsets `mse` tries around the amax rule's (0 first: ties keep it).
MSE_CODE_OFFSETS = (0, 1, -1)
RULES = ("amax", "mse")
MAX_CODE = 254  # 2^127; where the round-up overflows (amax >= 1.75 * 2^127) Quark writes it too
_ROUND_UP = 1 << 21  # fp32 mantissa 0.75 - 0.5 ulp of a 1-bit mantissa: 1.75 and above carry
_EXPONENT = 0x7F800000


@dataclass(frozen=True)
class Flavour:
    """Where a layout's tool departs from the common rule (see the module's docstring)."""

    signed_zero: bool  # a negative value rounding to 0 is written 0x8
    min_code: int  # the smallest scale code written (an all-zero block's)


COMPRESSED_TENSORS = Flavour(signed_zero=True, min_code=0)
QUARK = Flavour(signed_zero=False, min_code=1)


@dataclass
class MxQuantized:
    """MXFP4 encoding of a batch of B matrices [B, M, K]."""

    packed: torch.Tensor  # uint8 [B, M, K/2], even element in the low nibble
    scales: torch.Tensor  # uint8 [B, M, K/32], E8M0 codes
    err_sq: torch.Tensor  # float64 [B], sum of squared error against the source
    ref_sq: torch.Tensor  # float64 [B], sum of squared source values


def amax_codes(amax: torch.Tensor, min_code: int = 0) -> torch.Tensor:
    """E8M0 scale codes (uint8) of blocks with these fp32 amaxes, by the OCP / Quark "even"
    rule above, at least `min_code` (an all-zero block's)."""
    bits = amax.float().contiguous().view(torch.int32) + _ROUND_UP
    exponent = torch.bitwise_and(bits, _EXPONENT) >> 23  # biased floor(log2), 0 for zero
    exponent = torch.where(exponent == 0xFF, MAX_CODE + EMAX_ELEM, exponent)  # overflowed
    return (exponent - EMAX_ELEM).clamp(min_code, MAX_CODE).to(torch.uint8)


def steps(codes: torch.Tensor) -> torch.Tensor:
    """fp32 2^(c - 127) of E8M0 codes, built from its bits (exact on every device); NaN for
    the NaN code 255."""
    c = codes.to(torch.int32)
    bits = torch.where(c > 0, c << 23, torch.full_like(c, 1 << 22))  # c = 0: 2^-127
    step = bits.view(torch.float32)
    return torch.where(c == NAN_CODE, torch.full_like(step, float("nan")), step)


def _nibbles(blocks: torch.Tensor, step: torch.Tensor, cuts: torch.Tensor, flavour: Flavour
             ) -> torch.Tensor:
    """E2M1 nibbles of blocks [N, nb, 32] on steps [N, nb, 1]."""
    y = blocks / step
    idx = torch.bucketize(y.abs(), cuts, out_int32=True).to(torch.uint8)
    negative = y < 0 if flavour.signed_zero else (y < 0) & (idx != 0)
    return idx | (negative.to(torch.uint8) << 3)


def _block_error(mag: torch.Tensor, step: torch.Tensor, cuts: torch.Tensor, lut: torch.Tensor
                 ) -> torch.Tensor:
    """Squared error per block of |x| blocks [N, nb, 32] on steps [N, nb, 1]."""
    err = lut[torch.bucketize(mag / step, cuts, out_int32=True)] * step - mag
    return block_sum(err * err)


def _choose(blocks: torch.Tensor, rule: str, cuts: torch.Tensor, lut: torch.Tensor,
            min_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 codes [N, nb], each block's squared error) by `rule`."""
    mag = blocks.abs()
    codes = amax_codes(mag.amax(dim=-1), min_code)
    err = _block_error(mag, steps(codes).unsqueeze(-1), cuts, lut)
    if rule == "mse":
        base = codes.to(torch.int16)
        for off in MSE_CODE_OFFSETS[1:]:
            cand = (base + off).clamp(min_code, MAX_CODE).to(torch.uint8)
            cand_err = _block_error(mag, steps(cand).unsqueeze(-1), cuts, lut)
            better = cand_err < err  # strict: ties keep the earlier (amax-nearer) code
            err = torch.where(better, cand_err, err)
            codes = torch.where(better, cand, codes)
    return codes, err


def quantize(w: torch.Tensor, rule: str = "mse", flavour: Flavour = COMPRESSED_TENSORS,
             chunk_elems: int = 1 << 22, block_codes: torch.Tensor | None = None
             ) -> MxQuantized:
    """Encode fp32 matrices w [B, M, K] (K a multiple of 32) as MXFP4 in a layout's
    `flavour`, the block scales by `rule` ("amax" or "mse") unless `block_codes` (uint8 E8M0
    [B, M, K/32], not the NaN code) gives them; rows are processed in chunks of about
    `chunk_elems` elements, which bounds temporary memory."""
    if rule not in RULES:
        raise ValueError(f"the block-scale rule must be one of {RULES}, not {rule!r}")
    b, m, k = w.shape
    if k % BLOCK:
        raise ValueError(f"input dimension {k} is not a multiple of {BLOCK}")
    nb, device = k // BLOCK, w.device
    if block_codes is not None and (block_codes.dtype != torch.uint8
                                    or tuple(block_codes.shape) != (b, m, nb)
                                    or bool((block_codes == NAN_CODE).any())):
        raise ValueError(f"block_codes must be uint8 [{b}, {m}, {nb}] E8M0 codes below "
                         f"{NAN_CODE}")
    given = None if block_codes is None else block_codes.to(device).reshape(b * m, nb)
    rows = w.reshape(b * m, nb, BLOCK)
    cuts = cut_points(device)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=device)
    packed = torch.empty(b * m, k // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(b * m, nb, dtype=torch.uint8, device=device)
    err = torch.empty(b * m, dtype=torch.float64, device=device)
    ref = torch.empty(b * m, dtype=torch.float64, device=device)
    step_rows = max(1, chunk_elems // k)
    for r0 in range(0, b * m, step_rows):
        sl = slice(r0, r0 + step_rows)
        blocks = rows[sl].float()
        if given is None:
            codes, block_err = _choose(blocks, rule, cuts, lut, flavour.min_code)
        else:
            codes = given[sl]
            block_err = _block_error(blocks.abs(), steps(codes).unsqueeze(-1), cuts, lut)
        scales[sl] = codes
        nibbles = _nibbles(blocks, steps(codes).unsqueeze(-1), cuts, flavour)
        packed[sl] = pack_codes(nibbles.flatten(-2))
        err[sl] = block_err.sum(-1, dtype=torch.float64)
        ref[sl] = blocks.double().square().sum((-1, -2))
    return MxQuantized(packed.reshape(b, m, -1), scales.reshape(b, m, -1),
                       err.reshape(b, m).sum(-1), ref.reshape(b, m).sum(-1))


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [B, M, K] from packed [B, M, K/2] and E8M0 codes [B, M, K/32] (uint8)."""
    return decode_steps(packed, steps(scales))


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) MXFP4-quantized and dequantized as a W4A4 server
    quantizes its activations at run time (docs/formats.md §6, "W4A4: dynamic activations"):
    each block of 32 along the last dim on the amax rule's step, E2M1 ties to even, saturating
    at 6. Computed in fp32 (every step is a power of two, so the only rounding is E2M1's) and
    returned in x's dtype."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"activations of {k} features are not whole {BLOCK}-element blocks")
    blocks = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK).float()
    step = steps(amax_codes(blocks.abs().amax(dim=-1))).unsqueeze(-1)
    y = blocks / step
    lut = torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    mag = lut[torch.bucketize(y.abs(), cut_points(x.device), out_int32=True)]
    return (torch.where(y < 0, -mag, mag) * step).reshape(x.shape).to(x.dtype)


__all__ = ["BIAS", "BLOCK", "COMPRESSED_TENSORS", "EMAX_ELEM", "MAX_CODE", "MSE_CODE_OFFSETS",
           "NAN_CODE", "QUARK", "RULES", "Flavour", "MxQuantized", "amax_codes", "dequantize",
           "fake_quantize", "quantize", "steps"]


def declared_dynamic(name: str, spec: dict | None, dynamic: dict, label: str) -> bool:
    """Whether a config's activation `spec` for module `name` (its `label`, e.g. Quark's
    input_tensors) declares MXFP4's dynamic form, whose keys and values `dynamic` gives:
    False when it declares none; a form kconvert cannot run as served is an error, never a
    module silently left unquantized."""
    if not spec:
        return False
    said = {k: spec.get(k) for k in dynamic}
    if said != dynamic:
        raise KconvertError(f"{name}: the quantization_config gives its MXFP4 weights {label} "
                            f"{said}, not MXFP4's dynamic form {dynamic}; kconvert cannot run "
                            "them as served", file="config.json")
    return True

