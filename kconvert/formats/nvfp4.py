"""NVFP4 math (formats.md §2), vectorised over a batch of matrices: encode and decode (the
scales they use: kconvert.formats.nvfp4_scales).

Blocks of 16 elements (dense NVFP4) or 32 (one FP8 scale per 32 input elements, what sparse
NVFP4 kernels read, p48.md); the formulas are the same for both.

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

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kconvert.formats.nvfp4_grid import (
    BLOCK,
    BLOCK_SIZES,
    E2M1,
    FP4_MAX,
    FP8_MAX,
    FP8_VALUES,
    GLOBAL_NUMERATOR,
    MSE_CODE_OFFSETS,
    ZERO_BLOCK_SCALE,
    ZERO_CODE,
    block_step,
    block_sum,
    cut_points,
    pack_codes,
    round_e2m1,
    unpack_codes,
)
from kconvert.formats.nvfp4_scales import (
    ARITHMETIC,
    CHOOSERS,
    amax_block_codes,
    check_arithmetic,
    check_rule,
    choose_block_codes,
    fake_quantize,
    global_scale,
    recorded_scale,
    rounding,
    stored_scale,
    tensor_scale,
    use_triton,
)


@dataclass
class Quantized:
    """NVFP4 encoding of a batch of B matrices [B, M, K], blocks of K / block_scales.shape[-1]."""

    packed: torch.Tensor  # uint8 [B, M, K/2], even element in the low nibble
    block_scales: torch.Tensor  # float8_e4m3fn [B, M, K/group_size]
    # float32 [B]: the per-tensor scale as the flavour stores it (compressed-tensors'
    # weight_global_scale = 2688 / amax, or ModelOpt's weight_scale_2 = amax / 2688)
    global_scale: torch.Tensor
    err_sq: torch.Tensor  # float64 [B], sum of squared error against the source
    ref_sq: torch.Tensor  # float64 [B], sum of squared source values


def _num_blocks(k: int, group_size: int) -> int:
    if group_size not in BLOCK_SIZES:
        raise ValueError(f"group_size (elements per scale block) must be one of {BLOCK_SIZES}, "
                         f"not {group_size}")
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of {group_size}")
    return k // group_size


def _checked_codes(codes: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if codes.dtype != torch.uint8 or tuple(codes.shape) != shape:
        raise ValueError(f"block_codes must be uint8 {list(shape)}, not {codes.dtype} "
                         f"{list(codes.shape)}")
    if ((codes == 0) | (codes > 0x7E)).any():  # 0: a zero step; above: NaN or negative
        raise ValueError("block_codes must be positive finite FP8 e4m3 codes (1..0x7E)")
    return codes


def _offsets(search: bool) -> np.ndarray:
    """Code offsets the CPU kernels try around their base codes (0 first: the base itself)."""
    return np.array(MSE_CODE_OFFSETS if search else MSE_CODE_OFFSETS[:1], dtype=np.int32)


@dataclass
class _Rows:
    """Per-row outputs for B*M rows, filled chunk by chunk by torch or the CPU kernels."""

    packed: torch.Tensor  # uint8 [R, K/2]
    codes: torch.Tensor  # uint8 [R, K/block], the FP8 block scales' bits
    err: torch.Tensor  # float64 [R]
    ref: torch.Tensor  # float64 [R]

    @classmethod
    def empty(cls, rows: int, k: int, group_size: int, device: torch.device) -> _Rows:
        return cls(torch.empty(rows, k // 2, dtype=torch.uint8, device=device),
                   torch.empty(rows, k // group_size, dtype=torch.uint8, device=device),
                   torch.empty(rows, dtype=torch.float64, device=device),
                   torch.empty(rows, dtype=torch.float64, device=device))

    def result(self, b: int, m: int, gs: torch.Tensor) -> Quantized:
        return Quantized(self.packed.reshape(b, m, -1),
                         self.codes.view(torch.float8_e4m3fn).reshape(b, m, -1), gs,
                         self.err.reshape(b, m).sum(-1), self.ref.reshape(b, m).sum(-1))


def quantize(
    w: torch.Tensor, amax: torch.Tensor, scale_rule: str = "mse", chunk_elems: int = 1 << 22,
    fused_cpu: bool = True, local_dtype: torch.dtype = torch.float32, *, group_size: int = BLOCK,
    block_codes: torch.Tensor | None = None, arithmetic: str = "compressed-tensors",
    kernel: str = "auto",
) -> Quantized:
    """Encode fp32 matrices w [B, M, K] with one global scale per matrix from `amax` [B].

    `amax` is passed in (not taken from w) because a fused set's members share the largest
    amax of the set. `group_size` (16 or 32) elements share one FP8 block scale, chosen by the
    `scale_rule` ("amax" or "mse"), unless `block_codes` (uint8 FP8 e4m3 codes
    [B, M, K/block], 1..0x7E) gives them: then the elements are encoded with exactly those
    scales and the rule is not used. All B*M rows are processed together in chunks of about
    `chunk_elems` elements, which bounds temporary memory and keeps kernel launches few on a
    GPU. On a CPU the encoder runs in the fused numba kernel (`fused_cpu`), which gives the
    same bytes. `arithmetic` is the flavour whose scale arithmetic is followed (see ARITHMETIC).
    Elsewhere `kernel` (CHOOSERS: torch, or Triton's one launch each) chooses and encodes.
    """
    check_rule(scale_rule)
    check_arithmetic(arithmetic)
    b, m, k = w.shape
    nb = _num_blocks(k, group_size)
    device = w.device
    lut = torch.tensor(E2M1, dtype=torch.float32, device=device)
    cuts = cut_points(device)
    gs = tensor_scale(amax.to(device), arithmetic)
    rows = w.reshape(b * m, nb, group_size)
    row_gs = gs.repeat_interleave(m).unsqueeze(-1)  # [B*M, 1]
    out = _Rows.empty(b * m, k, group_size, device)
    if block_codes is not None:
        out.codes.copy_(_checked_codes(block_codes.to(device), (b, m, nb)).reshape(b * m, nb))
    cpu = _cpu_kernels() if fused_cpu and device.type == "cpu" else None
    offsets = _offsets(block_codes is None and scale_rule == "mse")
    step_rows = max(1, chunk_elems // k)
    for r0 in range(0, b * m, step_rows):
        sl = slice(r0, r0 + step_rows)
        blocks, gsi, codes = rows[sl].float(), row_gs[sl], out.codes[sl]
        if cpu is not None:
            # The kernel computes the amax rule's codes itself in fp32; another local dtype's
            # come from torch, and given codes are used as they are (no search).
            codes_in = block_codes is not None or local_dtype != torch.float32
            if block_codes is None and codes_in:
                codes.copy_(amax_block_codes(blocks, gsi, local_dtype, arithmetic))
            with _launch():
                cpu.quantize_rows(blocks.reshape(-1, k).contiguous().numpy(),
                                  gsi[:, 0].contiguous().numpy(), codes.numpy(), codes_in,
                                  offsets, group_size, arithmetic == "modelopt",
                                  out.packed[sl].numpy(), out.err[sl].numpy(),
                                  out.ref[sl].numpy())
            continue
        if block_codes is None:
            codes.copy_(choose_block_codes(blocks, gsi, scale_rule, local_dtype, arithmetic,
                                           kernel))
        if use_triton(kernel, device):
            from kconvert.formats import nvfp4_triton

            out.packed[sl], err = nvfp4_triton.encode(blocks, codes, gsi, arithmetic)
        else:
            y, idx, step = rounding(blocks, codes, gsi, cuts, arithmetic)
            err = lut[idx] * step - blocks.abs()  # block_error, from the nibbles' rounding
            nibbles = idx.to(torch.uint8) | (y < 0).to(torch.uint8) << 3  # sign: rounding's
            out.packed[sl], err = pack_codes(nibbles.flatten(-2)), block_sum(err * err)
        out.err[sl] = err.sum(-1, dtype=torch.float64)
        out.ref[sl] = blocks.double().square().sum((-1, -2))
    return out.result(b, m, gs)


def _int4_rows(kernels: ModuleType, packed: torch.Tensor, scale: torch.Tensor,
               ) -> tuple[np.ndarray, np.ndarray]:
    """INT4 words [B*M, K/8] and fp32 scales [B*M, G] as numpy arrays for the CPU kernels
    (bf16 scales widened by the kernels' own `widen_bf16`)."""
    b, m, words = packed.shape
    if scale.shape[:2] != (b, m):
        raise ValueError(f"INT4 scale {list(scale.shape)} does not fit packed {list(packed.shape)}")
    rows = scale.reshape(b * m, -1).contiguous()
    if rows.dtype == torch.bfloat16:
        wide = np.empty(rows.shape, dtype=np.float32)
        with _launch():
            kernels.widen_bf16(rows.view(torch.int16).numpy().view(np.uint16), wide)
    else:
        wide = rows.float().numpy()
    return packed.reshape(b * m, words).contiguous().numpy(), wide


def _int4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from kconvert.formats.int4 import Int4Codec

    shape = (packed.shape[1], packed.shape[2] * 8)
    return Int4Codec.decode({"weight_packed": packed, "weight_scale": scale}, shape)


def int4_amax(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """max |value| [B] f32 of each INT4 pack-quantized matrix (packed int32 [B, M, K/8], scale
    [B, M, G]; see `quantize_int4`), NaN or Inf where a scale is.

    With the CPU kernels no fp32 copy of the matrices is made: the max is taken over each
    group's largest |code| times |scale|, which is exact (fp32 rounding is monotone).
    """
    kernel = _int4_kernels(packed, scale)
    if kernel is None:
        return _int4_decode(packed, scale).abs().amax(dim=(1, 2))
    words, scales = _int4_rows(kernel, packed, scale)
    row_amax = np.empty(words.shape[0], dtype=np.float32)
    with _launch():
        kernel.int4_row_amax(words, scales, row_amax)
    return torch.from_numpy(row_amax).reshape(packed.shape[:2]).amax(-1)


def quantize_int4(packed: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                  scale_rule: str = "mse", group_size: int = BLOCK, chunk_elems: int = 1 << 22,
                  fused_cpu: bool = True, arithmetic: str = "compressed-tensors") -> Quantized:
    """`quantize` of compressed-tensors pack-quantized INT4 matrices (formats.md §1), same bytes
    as quantize(Int4Codec.decode(...), amax, scale_rule, local_dtype=torch.float32).

    packed: int32 [B, M, K/8], 8 codes per word, low nibble first, value = (nibble - 8) *
    scale in fp32; scale: [B, M, G] bf16 or fp32, one per K/G elements; amax [B] (a fused
    set's shared amax, or `int4_amax`). On a CPU with numba (`fused_cpu`), for groups of whole
    words (group % 8 == 0), each row is decoded inside the fused encoder, so no fp32 copy of
    the matrices is made; otherwise the matrices are decoded and passed to `quantize`.
    """
    check_rule(scale_rule)
    check_arithmetic(arithmetic)
    b, m, words = packed.shape
    k = words * 8
    kernel = _int4_kernels(packed, scale, fused_cpu)
    if kernel is None:
        return quantize(_int4_decode(packed, scale), amax, scale_rule, chunk_elems, fused_cpu,
                        group_size=group_size, arithmetic=arithmetic)
    _num_blocks(k, group_size)
    gs = tensor_scale(amax, arithmetic)
    out = _Rows.empty(b * m, k, group_size, packed.device)
    words, scales = _int4_rows(kernel, packed, scale)
    with _launch():
        kernel.quantize_int4_rows(words, scales, gs.repeat_interleave(m).numpy(),
                                  _offsets(scale_rule == "mse"), group_size,
                                  arithmetic == "modelopt", out.packed.numpy(),
                                  out.codes.numpy(), out.err.numpy(), out.ref.numpy())
    return out.result(b, m, gs)


def _int4_kernels(packed: torch.Tensor, scale: torch.Tensor, fused_cpu: bool = True):
    """The CPU kernels for these INT4 tensors, or None (then they are decoded with torch). The
    kernels take whole words per scale group (group % 8 == 0: Kimi's 32, compressed-tensors'
    usual 32/64/128)."""
    if not fused_cpu or packed.device.type != "cpu" or packed.shape[-1] % scale.shape[-1]:
        return None
    return _cpu_kernels()


# The CPU kernels release the GIL while they run. numba's workqueue threading layer (its
# fallback where neither OpenMP nor TBB is present) aborts the process when two threads launch
# parallel kernels at once, so launches from different threads take turns, as under the GIL.
_KERNEL_LAUNCH = threading.Lock()


@contextlib.contextmanager
def _launch() -> Iterator[None]:
    """One launch of a CPU kernel (one thread's at a time), torch's thread count kept: numba's
    OpenMP layer, started by a thread's first launch, sets that thread's OpenMP count to
    numba's (every CPU), which is torch's count too, so the process's later CPU arithmetic
    (learned compensation's sums) would add in another order than in a fresh process."""
    with _KERNEL_LAUNCH:
        threads = torch.get_num_threads()
        try:
            yield
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


def _cpu_kernels():
    """The fused CPU kernels (module kconvert.nvfp4_cpu), or None where numba is missing."""
    try:
        from kconvert.formats import nvfp4_cpu
    except ImportError:
        return None
    return nvfp4_cpu


def warm_cpu_kernels(float_rows: bool = True, int4_rows: bool = True) -> None:
    """Load the fused CPU kernels now (numba compiles them on the first run after installing,
    ~15 s, and caches them), through the same calls and argument types a conversion makes, so
    the time is spent where a caller can say what is happening rather than at 0% mid-run.
    `float_rows`: the encoder of decoded matrices (`quantize`); `int4_rows`: the encoder that
    decodes INT4 itself (`quantize_int4`). Each is most of the compile; a run loads those its
    modules use."""
    if _cpu_kernels() is None:
        return
    if float_rows:
        quantize(torch.zeros(1, 1, BLOCK), torch.ones(1))
    packed = torch.zeros(1, 1, 4, dtype=torch.int32)
    for scale_dtype in (torch.bfloat16, torch.float32) if int4_rows else ():
        scale = torch.ones(1, 1, 1, dtype=scale_dtype)
        quantize_int4(packed, scale, int4_amax(packed, scale))


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """CPU work launched from this thread (the fused kernels, torch's ops) uses at most `n`
    threads (never more than each was set to). numba's count is per launching thread, torch's
    the process's; both are restored after."""
    torch_before = torch.get_num_threads()
    torch.set_num_threads(min(n, torch_before))
    try:
        if _cpu_kernels() is None:
            yield
            return
        import numba

        numba_before = numba.get_num_threads()
        numba.set_num_threads(min(n, numba_before))
        try:
            yield
        finally:
            numba.set_num_threads(numba_before)
    finally:
        torch.set_num_threads(torch_before)


def dequantize(packed: torch.Tensor, block_scales: torch.Tensor, gs: torch.Tensor,
               arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """fp32 [B, M, K] from packed [B, M, K/2], block scales [B, M, K/block] (float8_e4m3fn;
    the block size is read off the shapes), per-tensor scales [B] of `arithmetic`."""
    step = block_step(block_scales, gs.float().reshape(-1, 1, 1), arithmetic)
    return decode_steps(packed, step[..., 0])


def decode_steps(packed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """fp32 [B, M, K] from packed [B, M, K/2] and each block's step [B, M, K/block] (the value
    of E2M1 1.0 in that block): the one place packed NVFP4 becomes numbers, whichever way a
    format stores its scales (compressed-tensors divides by gs, ModelOpt multiplies)."""
    b, m, half = packed.shape
    k, nb = 2 * half, step.shape[-1]
    if k % nb:
        raise ValueError(f"{nb} block scales do not divide a row of {k} elements")
    nibbles = unpack_codes(packed).reshape(b, m, nb, k // nb)
    values = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)[(nibbles & 7).long()]
    return (torch.where((nibbles & 8).bool(), -values, values)
            * step.unsqueeze(-1)).reshape(b, m, k)


__all__ = ["ARITHMETIC", "BLOCK", "BLOCK_SIZES", "CHOOSERS", "E2M1", "FP4_MAX", "FP8_MAX",
           "FP8_VALUES", "GLOBAL_NUMERATOR", "MSE_CODE_OFFSETS", "ZERO_BLOCK_SCALE", "ZERO_CODE",
           "Quantized", "amax_block_codes", "block_step", "block_sum", "choose_block_codes",
           "cpu_threads", "cut_points", "decode_steps", "dequantize", "fake_quantize",
           "global_scale", "int4_amax", "pack_codes", "quantize", "quantize_int4",
           "recorded_scale", "round_e2m1", "stored_scale", "tensor_scale", "unpack_codes",
           "warm_cpu_kernels"]
