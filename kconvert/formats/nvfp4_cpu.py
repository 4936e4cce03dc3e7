"""The NVFP4 encoder fused into one pass per row, for CPUs (numba).

Eager torch makes ~12 full passes over a matrix per candidate block scale; on a CPU that is
memory-bound and far slower than the per-block work needs to be. These kernels do the same
float32 operations in the same order as the torch path (`nvfp4.amax_block_codes`,
`nvfp4_scales.block_error`, `_nibbles`: true divisions, a multiply and a subtract for the
error, the fixed pairwise block sum, strict comparisons against the same cut points,
round-to-nearest-even into FP8), so their bytes are identical to the torch path's; tests hold
the two together.

The block search runs on LANES blocks side by side, stored transposed (a row per element
position, in bit-reversed order, a column per block): every step of it, the pairwise tree sum
included, is then an element-wise operation on LANES-wide rows that LLVM vectorises, and the
tree still adds in the torch path's order.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kconvert.formats import nvfp4_grid as grid

# Blocks searched side by side: two AVX-512 vectors of fp32 per row of a block, which keeps
# the loop overhead per element low; Kimi's rows (448, 224, 128 or 64 blocks) fill every lane.
LANES = 32
CHUNK_ROWS = 4  # rows a thread takes at a time, with one allocation of scratch
_FP8 = grid.FP8_VALUES.numpy()  # fp32 value of each FP8 e4m3 code 0..127
_CUTS = tuple(np.float32(c) for c in grid.cut_points(torch.device("cpu")).tolist())
_ZERO = np.int32(grid.ZERO_CODE)
_SIX = np.float32(grid.FP4_MAX)
_FP8_MAX = np.float32(grid.FP8_MAX)
_MIN_NORMAL = np.float32(2.0**-6)  # smallest normal FP8 e4m3; below it codes step by 2^-9
_MIN_SCALE = np.float32(2.0**-9)  # smallest FP8 e4m3 above 0, ModelOpt's floor for a scale
# error_model="numpy": a float division has no zero-division branch, which would stop LLVM
# from vectorising the loops (the torch path divides the same way: x / 0 -> inf).
# The parallel kernels below release the GIL while they run (nogil=True), so that the engine's
# reader and writer threads keep moving bytes meanwhile.
_JIT = {"cache": True, "error_model": "numpy"}


@numba.njit(inline="always", **_JIT)
def _fp8_codes(v, out):
    """out[i] = the FP8 e4m3 code nearest to fp32 v[i] >= 0, ties to even, v above 448 clamped
    to 448: torch's float32 -> float8_e4m3fn cast after nvfp4's clamp (NaN -> 0x7F, as
    torch's). Branch-free on the fp32 bits, so a loop over lanes vectorises."""
    bits = v.view(np.int32)
    for i in range(v.shape[0]):
        f, b = v[i], bits[i]
        # Normal range: round the 23 mantissa bits to 3 (ties to even); a carry moves into the
        # exponent, and the fp32 exponent bias 127 becomes FP8's 7.
        c = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - (120 << 3)
        # Below 2^-6 (FP8 subnormals and 0): multiples of 2^-9, codes 0..8.
        sub = np.int32(np.rint((f if f < _MIN_NORMAL else _MIN_NORMAL) * np.float32(512.0)))
        c = sub if f < _MIN_NORMAL else c
        c = 0x7E if f >= _FP8_MAX else c
        out[i] = 0x7F if f != f else c


@numba.njit(inline="always", **_JIT)
def _e2m1_index(y):
    """E2M1 code 0..7 of y >= 0: the number of cut points strictly below it (bucketize)."""
    one = np.int32(1)
    return ((one if y > _CUTS[0] else 0) + (one if y > _CUTS[1] else 0)
            + (one if y > _CUTS[2] else 0) + (one if y > _CUTS[3] else 0)
            + (one if y > _CUTS[4] else 0) + (one if y > _CUTS[5] else 0)
            + (one if y > _CUTS[6] else 0))


@numba.njit(inline="always", **_JIT)
def _e2m1_value(y):
    """E2M1 magnitude of y >= 0, the value _e2m1_index's code stands for, in a few vector ops:
    E2M1 is a grid of step 0.5 below 2, 1 below 4 and 2 up to 6, and rounding to it with the
    cut points' ties (to the even code) is rint (ties to even) on that grid, exact in fp32."""
    two, four, six = np.float32(2.0), np.float32(4.0), np.float32(6.0)
    unit = np.float32(0.5) if y < two else (np.float32(1.0) if y < four else two)
    inv = two if y < two else (np.float32(1.0) if y < four else np.float32(0.5))
    return min(np.rint(y * inv) * unit, six)


@numba.njit(inline="always", **_JIT)
def _nibble(y):
    """sign << 3 | E2M1 code of y; the sign from y < 0, as compressed-tensors' (so -0.0 and
    +0.0, a pruned p48 pair, give 0x0)."""
    return _e2m1_index(abs(y)) | (8 if y < 0 else 0)


@numba.njit(inline="always", **_JIT)
def _bit_reversal(n):
    """rev [n]: each index 0..n-1 with its log2(n) bits in reverse order (n a power of 2)."""
    rev = np.zeros(n, dtype=np.int64)
    bit, weight = 1, n // 2
    while weight >= 1:
        for e in range(n):
            rev[e] += weight if e & bit else 0
        bit, weight = bit * 2, weight // 2
    return rev


@numba.njit(**_JIT)
def _workspace(block):
    """_encode_row's scratch arrays for `block`, allocated once per chunk of rows."""
    half = block // 2
    rev = _bit_reversal(block)
    # Gather tables, uint32 (numba adds no negative-index wraparound, so the loops vectorise):
    # xt[r, lane] = group[load[r * LANES + lane]] for a group of LANES blocks, and byte j of
    # lane's block = pair[store[lane * half + j]].
    load = np.empty(block * LANES, dtype=np.uint32)
    for r in range(block):
        for lane in range(LANES):
            load[r * LANES + lane] = lane * block + rev[r]
    store = np.empty(half * LANES, dtype=np.uint32)
    for lane in range(LANES):
        for j in range(half):  # elements 2j and 2j + 1 are at rows rev[2j], rev[2j] + half
            store[lane * half + j] = rev[2 * j] * LANES + lane
    return (load, store,
            np.zeros(block * LANES, dtype=np.float32),  # a last group of < LANES blocks, padded
            np.empty((block, LANES), dtype=np.float32),  # xt: the group, transposed
            np.empty((block, LANES), dtype=np.float32),  # mag: |xt|
            np.empty((half, LANES), dtype=np.float32),  # sq: the tree's level sums
            np.empty((half, LANES), dtype=np.uint8),  # pair: packed bytes, transposed
            np.empty(_FP8.shape[0], dtype=np.float32),  # steps: fp32(d) / gs of every code d
            np.empty(LANES, dtype=np.float32),  # vec: block amax, then FP8 scale input
            np.empty(LANES, dtype=np.float32),  # step: of the candidate, then of the best
            np.empty(LANES, dtype=np.int32),  # base: the search's offset-0 codes
            np.empty(LANES, dtype=np.int32),  # cand
            np.empty(LANES, dtype=np.int32),  # best
            np.empty(LANES, dtype=np.float32),  # best_err
            np.empty(LANES, dtype=np.float64),  # err: per lane, summed over the row
            np.empty(LANES, dtype=np.float64))  # ref: likewise


@numba.njit(**_JIT)
def _encode_row(x, gs, codes, codes_in, offsets, block, modelopt, packed, ws):
    """Encode one row x [K] fp32 with per-tensor scale gs: packed [K/2], block scale codes
    codes [K/block]; returns (sum of squared errors, sum of squares), float64. `modelopt`
    follows ModelOpt's scale arithmetic (nvfp4.ARITHMETIC), else compressed-tensors'.

    Each block's scale is the first of base + offsets[o] (offsets[0] = 0, the others clamped to
    1..0x7E) with the smallest block error, as nvfp4_scales.choose; the base codes are the amax
    rule's, computed here, unless `codes_in` says `codes` already holds them.

    LANES blocks at a time are stored transposed, element e of lane l's block at row rev[e]
    (bit reversal): nvfp4.block_sum's pairwise tree, (0+1), (2+3), ... then pairs of those,
    is then row r + row r + h at every level, for h = block/2, block/4, ..., 1, in that order.
    """
    (load, store, tail, xt, mag, sq, pair, steps, vec, step, base, cand, best, best_err, err,
     ref) = ws
    nb = x.shape[0] // block
    half = block // 2
    xt_flat = xt.reshape(block * LANES)
    sq_flat = sq.reshape(half * LANES)  # the tree's levels as flat loops, which LLVM vectorises
    pair_flat = pair.reshape(half * LANES)
    for c in range(steps.shape[0]):
        steps[c] = _FP8[c] * gs if modelopt else _FP8[c] / gs
    err[:] = 0
    ref[:] = 0
    for b0 in range(0, nb, LANES):
        n = min(LANES, nb - b0)
        group = x[b0 * block:(b0 + n) * block]
        if n < LANES:  # the lanes past the row's last block hold zeros and are dropped
            tail[:n * block] = group
            group = tail
        for i in range(block * LANES):
            xt_flat[i] = group[load[i]]
        vec[:] = 0  # block amax, NaN kept as torch's amax keeps it
        for r in range(block):
            for lane in range(LANES):
                a = abs(xt[r, lane])
                mag[r, lane] = a
                ref[lane] += np.float64(a) * np.float64(a)
                vec[lane] = a if a > vec[lane] or a != a else vec[lane]
        if codes_in:
            for lane in range(LANES):
                base[lane] = codes[b0 + lane] if lane < n else _ZERO
        elif modelopt:  # nvfp4.amax_block_codes, ModelOpt's arithmetic
            six_g = _SIX * gs
            for lane in range(LANES):
                v = vec[lane] / six_g
                v = np.float32(1.0) if v == 0 else v
                vec[lane] = v if v > _MIN_SCALE or v != v else _MIN_SCALE
            _fp8_codes(vec, base)
        else:  # nvfp4.amax_block_codes with local dtype fp32
            for lane in range(LANES):
                vec[lane] = gs * (vec[lane] / _SIX)
            _fp8_codes(vec, base)
            for lane in range(LANES):
                base[lane] = _ZERO if base[lane] == 0 else base[lane]
        for o in range(offsets.shape[0]):
            off = offsets[o]
            lo, hi = (0, 0x7F) if o == 0 else (1, 0x7E)
            for lane in range(LANES):
                c = min(max(base[lane] + off, lo), hi)
                cand[lane] = c
                step[lane] = steps[c]
            for r in range(half):  # the squared errors of each pair of elements, summed
                for lane in range(LANES):
                    s, a0, a1 = step[lane], mag[r, lane], mag[r + half, lane]
                    e0 = _e2m1_value(a0 / s) * s - a0
                    e1 = _e2m1_value(a1 / s) * s - a1
                    sq[r, lane] = e0 * e0 + e1 * e1
            h = half * LANES
            while h > LANES:
                h //= 2
                for i in range(h):
                    sq_flat[i] = sq_flat[i] + sq_flat[i + h]
            for lane in range(LANES):
                e = sq[0, lane]  # the tree's root
                better = o == 0 or e < best_err[lane]  # strict: ties keep the earlier code
                best_err[lane] = e if better else best_err[lane]
                best[lane] = cand[lane] if better else best[lane]
        for lane in range(LANES):
            err[lane] += best_err[lane]
            step[lane] = steps[best[lane]]
        for r in range(half):  # the byte of each pair of elements, rows r and r + half
            for lane in range(LANES):
                s = step[lane]
                pair[r, lane] = _nibble(xt[r, lane] / s) | (_nibble(xt[r + half, lane] / s) << 4)
        out = packed[b0 * half:(b0 + n) * half]
        for i in range(n * half):
            out[i] = pair_flat[store[i]]
        for lane in range(n):
            codes[b0 + lane] = best[lane]
    return err.sum(), ref.sum()


@numba.njit(parallel=True, nogil=True, **_JIT)
def quantize_rows(x, row_gs, codes, codes_in, offsets, block, modelopt, packed, row_err,
                  row_ref):
    """Rows x [R, K] fp32, global scales row_gs [R] -> packed [R, K/2], codes [R, K/block]
    (input too when `codes_in`), row_err / row_ref [R]; see _encode_row."""
    rows = x.shape[0]
    for c in numba.prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        ws = _workspace(block)
        for r in range(c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, rows)):
            err, ref = _encode_row(x[r], row_gs[r], codes[r], codes_in, offsets, block,
                                   modelopt, packed[r], ws)
            row_err[r] = err
            row_ref[r] = ref


@numba.njit(inline="always", **_JIT)
def _int4_code(word, t):
    """INT4 code -8..7 of element t (0..7) of a pack-quantized int32 word (low nibble first)."""
    return ((word >> (4 * t)) & 0xF) - 8


@numba.njit(parallel=True, nogil=True, **_JIT)
def quantize_int4_rows(words, scale, row_gs, offsets, block, modelopt, packed, codes, row_err,
                       row_ref):
    """quantize_rows of INT4 rows (words int32 [R, K/8], fp32 scales [R, G], whole words per
    group), each decoded to fp32 (code * scale, exactly as Int4Codec.decode) first."""
    rows, k = words.shape[0], words.shape[1] * 8
    per_group = words.shape[1] // scale.shape[1]
    for c in numba.prange((rows + CHUNK_ROWS - 1) // CHUNK_ROWS):
        ws = _workspace(block)
        x = np.empty(k, dtype=np.float32)
        for r in range(c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, rows)):
            for g in range(scale.shape[1]):
                s = scale[r, g]
                for w in range(g * per_group, (g + 1) * per_group):
                    word = words[r, w]
                    for t in range(8):
                        x[8 * w + t] = np.float32(_int4_code(word, t)) * s
            err, ref = _encode_row(x, row_gs[r], codes[r], False, offsets, block, modelopt,
                                   packed[r], ws)
            row_err[r] = err
            row_ref[r] = ref


@numba.njit(parallel=True, nogil=True, **_JIT)
def int4_row_amax(words, scale, out):
    """out [R] = max |code * scale| of each INT4 row (as quantize_int4_rows takes them): each
    group's largest |code| times |scale|, exact since fp32 rounding is monotone; NaN
    propagates."""
    per_group = words.shape[1] // scale.shape[1]
    for r in numba.prange(words.shape[0]):
        m = np.float32(0.0)
        for g in range(scale.shape[1]):
            c = 0
            for w in range(g * per_group, (g + 1) * per_group):
                word = words[r, w]
                for t in range(8):
                    c = max(c, abs(_int4_code(word, t)))
            v = np.float32(c) * abs(scale[r, g])
            m = v if v > m or v != v else m
        out[r] = m


@numba.njit(parallel=True, nogil=True, **_JIT)
def widen_bf16(bits, out):
    """out [R, G] fp32 = the bf16 values whose bits are `bits` [R, G] uint16: the bits shifted
    into the top half of an fp32, exactly torch's bf16 -> fp32 (NaN payloads included). Here
    rather than torch's cast: a torch op between two kernels wakes torch's own thread pool while
    numba's still holds the cores, and took 5-15x its time alone (measured in the engine)."""
    wide = out.view(np.uint32)
    for r in numba.prange(bits.shape[0]):
        for g in range(bits.shape[1]):
            wide[r, g] = np.uint32(bits[r, g]) << np.uint32(16)
