"""The exact MXFP4 -> NVFP4 cast (docs/formats.md §7), as NVIDIA ModelOpt casts Kimi-K3.

MXFP4 stores E2M1 codes with one E8M0 exponent k_j per block of 32; NVFP4 stores the same
E2M1 codes with an FP8 e4m3 scale per block of 16 and one fp32 per-tensor scale. With the
per-tensor scale a power of two the two grids coincide wherever E4M3 holds the block's power
of two exactly:
  k_max     the largest k_j over the blocks whose E8M0 byte is not 0 (0 where none is)
            (modelopt.torch.quantization.utils.numeric_utils.mxfp4_to_nvfp4_global_amax);
            a fused set (an expert's gate and up) takes its members' largest
  m         k_max - 8: ModelOpt's weight_scale_2 = 2^m, compressed-tensors' gs = 2^-m; the
            engine carries it as the amax 2688 * 2^m that gives these scales exactly
  block j   exact when -9 <= k_j - m <= 8 (E4M3 holds 2^e exactly for e in [-9, 8]): both of
            its 16-halves get the FP8 scale 2^(k_j - m) and the source's bytes unchanged, so
            every element decodes to E2M1 * 2^k_j, the source's value, bit for bit (a -0
            nibble 0x8 stays 0x8: ModelOpt's re-quantization writes 0x0 there)
            A block whose codes are all zero is exact whatever its exponent: it gets
            2^clamp(k_j - m, -9, 8) (0x01 for E8M0 byte 0, as ModelOpt writes).
  the rest  fall back to the output's block-scale rule (mse or amax, kconvert.formats.nvfp4)
            on the decoded block, with the same per-tensor scale, and are counted
k_max is held in [-119, 124], where both flavours' per-tensor scales are finite normal fp32
powers of two (a tensor beyond it, impossible in a real weight, casts with fallback blocks).
"""

from __future__ import annotations

import torch

from kconvert.formats import nvfp4
from kconvert.formats.base import Codec, Encoded
from kconvert.formats.mxfp4 import BIAS, NAN_CODE
from kconvert.formats.mxfp4 import dequantize as mxfp4_dequantize
from kconvert.formats.mxfp4_ct import Mxfp4Codec
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.formats.nvfp4_modelopt import ModeloptNvfp4Codec

E4M3_KMIN, E4M3_KMAX = -9, 8  # E4M3 holds 2^e exactly for e in this range (2^-9: 0x01)
KMAX_RANGE = (-119, 124)
MX_BLOCK_BYTES = 16  # a 32-element MXFP4 block's packed bytes
# 4 x (E2M1[lo]^2 + E2M1[hi]^2) of every packed byte: whole numbers (E2M1 is in halves).
_SQUARES4 = torch.tensor([4 * (nvfp4.E2M1[b & 7] ** 2 + nvfp4.E2M1[(b >> 4) & 7] ** 2)
                          for b in range(256)], dtype=torch.int32)
_POW2_CODES = torch.tensor([2.0**e for e in range(E4M3_KMIN, E4M3_KMAX + 1)]
                           ).to(torch.float8_e4m3fn).view(torch.uint8)


def k_max(scales: torch.Tensor) -> torch.Tensor:
    """int32 [B]: each matrix's largest exponent over its E8M0 bytes [B, M, K/32] that are
    not 0 (0 where all are), held in KMAX_RANGE."""
    k = scales.to(torch.int32) - BIAS
    k = torch.where(scales > 0, k, torch.full_like(k, -BIAS - 1)).flatten(1).amax(-1)
    return torch.where(k < -BIAS, torch.zeros_like(k), k).clamp(*KMAX_RANGE)


def nominal_amax(scales: torch.Tensor) -> torch.Tensor:
    """fp32 [B]: 2688 * 2^(k_max - 8) of E8M0 bytes [B, M, K/32], the amax whose per-tensor
    scales are exactly 2^(k_max - 8) (ModelOpt) and 2^(8 - k_max) (compressed-tensors);
    NaN where a byte is MXFP4's NaN (255)."""
    m = (k_max(scales) - E4M3_KMAX).float()
    amax = nvfp4.GLOBAL_NUMERATOR * torch.exp2(m)
    bad = (scales == NAN_CODE).flatten(1).any(-1)
    return torch.where(bad, torch.full_like(amax, float("nan")), amax)


def _exponent_m(amax: torch.Tensor) -> torch.Tensor:
    """int32 [B]: m of nominal amaxes (amax / 2688 = 2^m); ValueError if one is not."""
    ratio = amax.float() / nvfp4.GLOBAL_NUMERATOR
    mantissa, exponent = torch.frexp(ratio)
    if bool(((mantissa != 0.5) & torch.isfinite(ratio)).any()):
        raise ValueError("the exact cast's amax must be 2688 * 2^m (nominal_amax)")
    return exponent.to(torch.int32) - 1


def stored_exponent(scale: torch.Tensor, arithmetic: str) -> int | None:
    """m of a per-tensor scale as `arithmetic` stores it (ModelOpt's 2^m, compressed-tensors'
    2^-m), None when it is not a power of two (no exact cast wrote it)."""
    mantissa, exponent = torch.frexp(scale.float().reshape(()))
    if float(mantissa) != 0.5:
        return None
    m = int(exponent) - 1
    return m if arithmetic == "modelopt" else -m


def exact_blocks(packed: torch.Tensor, scales: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """bool [B, M, K/32]: the blocks of MXFP4 matrices (packed [B, M, K/2], E8M0 scales
    [B, M, K/32]) that NVFP4 holds exactly under per-tensor scales 2^m (m int [B])."""
    b, rows, nb = scales.shape
    delta = scales.to(torch.int32) - BIAS - m.to(scales.device).view(b, 1, 1)
    exact = (delta >= E4M3_KMIN) & (delta <= E4M3_KMAX) & (scales != NAN_CODE)
    if not bool(exact.all()):
        zero = (packed.view(b, rows, nb, MX_BLOCK_BYTES) & 0x77).amax(-1) == 0
        exact |= zero  # every code +-0: any scale decodes it
    return exact


def _squares(packed: torch.Tensor, scales: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """float64 [B]: the sum of squared values of MXFP4 matrices, from their bytes."""
    b, m, half = packed.shape
    nb = scales.shape[-1]
    rows, row_scales = packed.reshape(b * m, half), scales.reshape(b * m, nb)
    lut = _SQUARES4.to(packed.device)
    out = torch.empty(b * m, dtype=torch.float64, device=packed.device)
    for r0 in range(0, b * m, chunk_rows):
        sl = slice(r0, r0 + chunk_rows)
        per_block = lut[rows[sl].long()].reshape(-1, nb, MX_BLOCK_BYTES).sum(-1)
        k = row_scales[sl].to(torch.int32) - BIAS
        step_sq = torch.exp2(2 * k.double()) / 4  # (2^k)^2 / 4: the LUT holds 4 x squares
        step_sq = torch.where(row_scales[sl] == NAN_CODE, torch.nan, step_sq)
        out[sl] = (per_block.double() * step_sq).sum(-1)
    return out.reshape(b, m).sum(-1)


def cast(packed: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, rule: str,
         arithmetic: str, chunk_elems: int = 1 << 22) -> tuple[nvfp4.Quantized, torch.Tensor]:
    """NVFP4 (block 16, `arithmetic`'s per-tensor scale for the nominal `amax` [B]) of MXFP4
    matrices packed [B, M, K/2] (uint8, even element low) with E8M0 scales [B, M, K/32]:
    exact blocks cast, the others encoded by `rule`. Returns the encoding and int64 [B] the
    32-element source blocks cast exactly."""
    b, _, half = packed.shape
    nb = scales.shape[-1]
    if half != nb * MX_BLOCK_BYTES:
        raise ValueError(f"MXFP4 packed {list(packed.shape)} does not fit scales "
                         f"{list(scales.shape)}")
    device = packed.device
    gs = nvfp4.tensor_scale(amax.to(device), arithmetic)
    m_exp = _exponent_m(amax).to(device)
    exact = exact_blocks(packed, scales, m_exp)
    delta = scales.to(torch.int32) - BIAS - m_exp.view(b, 1, 1)
    codes = _POW2_CODES.to(device)[(delta.clamp(E4M3_KMIN, E4M3_KMAX) - E4M3_KMIN).long()]
    codes = codes.repeat_interleave(2, dim=-1)  # both 16-halves of a 32-block
    err = torch.zeros(b, dtype=torch.float64, device=device)
    out = packed
    rows = (~exact).any(-1).nonzero()  # (matrix, row) of every row with a fallback block
    if len(rows):
        out, codes = packed.clone(), codes.clone()
        err = _fallback(out, codes, scales, exact, rows, amax.to(device), gs, rule,
                        arithmetic, chunk_elems)
    q = nvfp4.Quantized(out, codes.view(torch.float8_e4m3fn), gs, err,
                        _squares(packed, scales, max(1, chunk_elems // (2 * half))))
    return q, exact.flatten(1).sum(-1)


def _fallback(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, exact: torch.Tensor,
              rows: torch.Tensor, amax: torch.Tensor, gs: torch.Tensor, rule: str,
              arithmetic: str, chunk_elems: int) -> torch.Tensor:
    """Encode the non-exact blocks of `rows` [(matrix, row)] by `rule` into `out` and `codes`
    (in place); float64 [B]: their squared error against the source."""
    b, _, half = out.shape
    nb = scales.shape[-1]
    mi, ri = rows[:, 0], rows[:, 1]
    src = mxfp4_dequantize(out[mi, ri].unsqueeze(0), scales[mi, ri].unsqueeze(0))[0]
    q = nvfp4.quantize(src.unsqueeze(1), amax[mi], rule, chunk_elems,
                       arithmetic=arithmetic)
    keep = exact[mi, ri]  # [R, nb]: exact blocks keep the cast's bytes and scales
    row_bytes = torch.where(keep.unsqueeze(-1), out[mi, ri].view(-1, nb, MX_BLOCK_BYTES),
                            q.packed[:, 0].view(-1, nb, MX_BLOCK_BYTES))
    row_codes = torch.where(keep.repeat_interleave(2, -1), codes[mi, ri],
                            q.block_scales[:, 0].view(torch.uint8))
    out[mi, ri] = row_bytes.reshape(-1, half)
    codes[mi, ri] = row_codes
    decoded = nvfp4.dequantize(out[mi, ri].unsqueeze(1), row_codes.unsqueeze(1), gs[mi],
                               arithmetic)[:, 0]
    row_err = (decoded - src).double().square().sum(-1)
    return torch.zeros(b, dtype=torch.float64, device=out.device).index_add_(0, mi, row_err)


class ExactCast:
    """What an NVFP4 codec adds to cast MXFP4 sources exactly: it reads their packed bytes
    and E8M0 scales (on any device) and records per matrix its exact blocks."""

    @classmethod
    def casts(cls, source: type[Codec]) -> bool:
        """Whether modules in `source`'s format are cast (MXFP4, either layout)."""
        return issubclass(source, Mxfp4Codec)

    @classmethod
    def reads_packed(cls, source: type[Codec], device: torch.device) -> bool:
        return cls.casts(source)

    @classmethod
    def packed_amax(cls, source: type[Codec], params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The nominal amax (its largest over a fused set is the set's k_max)."""
        return nominal_amax(params[source.params[1]])

    @classmethod
    def encode_packed(cls, source, params, spec, amax) -> Encoded:
        packed, scale = source.params
        q, exact = cast(params[packed], params[scale], amax, spec.rule,
                        cls.arithmetic, spec.chunk_elems)  # type: ignore[attr-defined]
        enc = cls.stored(q, amax)  # type: ignore[attr-defined]
        blocks = params[scale][0].numel()
        enc.records = [{"cast": {"exact_blocks": int(n), "blocks": blocks}}
                       for n in exact.tolist()]
        return enc


class Nvfp4CastCodec(ExactCast, Nvfp4Codec):
    """compressed-tensors NVFP4, MXFP4 sources cast exactly."""

    name = "nvfp4-compressed-tensors-cast"
    description = "NVFP4 (compressed-tensors), exact MXFP4 cast"


class ModeloptNvfp4CastCodec(ExactCast, ModeloptNvfp4Codec):
    """ModelOpt NVFP4, MXFP4 sources cast exactly."""

    name = "nvfp4-modelopt-cast"
    description = "NVFP4 (ModelOpt), exact MXFP4 cast"


# An output format -> the codec that writes it casting MXFP4 exactly (dense NVFP4 only).
CAST_CODECS: dict[type[Codec], type[Codec]] = {
    Nvfp4Codec: Nvfp4CastCodec, ModeloptNvfp4Codec: ModeloptNvfp4CastCodec}
