"""The NVFP4 block search fused into one pass per block, for CPUs (numba).

Eager torch makes ~12 full passes over a matrix per candidate block scale; on a CPU that is
memory-bound and far slower than the per-block work needs to be. This kernel does the same
float32 operations in the same order as `nvfp4._block_error` / `nvfp4._nibbles` (one
division for the step, one for y, a multiply and a subtract for the error, the fixed pairwise
block sum, strict comparisons against the same cut points), so its bytes are identical to the
torch path's; a test holds the two together.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def _e2m1_index(y, cuts):
    idx = 0
    for c in range(7):
        if y > cuts[c]:
            idx += 1
    return idx


@numba.njit(cache=True, inline="always")
def _e2m1_value(y, cuts):
    """E2M1 magnitude of y without a table or branches (so LLVM can vectorise): the steps
    0.5, 0.5, 0.5, 0.5, 1, 1, 2 between the codes' values add up exactly in float32."""
    half, one, two = np.float32(0.5), np.float32(1.0), np.float32(2.0)
    return (half * np.float32(y > cuts[0]) + half * np.float32(y > cuts[1])
            + half * np.float32(y > cuts[2]) + half * np.float32(y > cuts[3])
            + one * np.float32(y > cuts[4]) + one * np.float32(y > cuts[5])
            + two * np.float32(y > cuts[6]))


@numba.njit(cache=True)
def _block_error(x, r, k0, step, cuts, sq):
    for j in range(16):
        a = abs(x[r, k0 + j])
        e = _e2m1_value(a / step, cuts) * step - a
        sq[j] = e * e
    # Pairwise tree, as nvfp4._block_sum: (0+1), (2+3), ... then pairs of those.
    n = 16
    while n > 1:
        for j in range(n // 2):
            sq[j] = sq[2 * j] + sq[2 * j + 1]
        n //= 2
    return sq[0]


@numba.njit(parallel=True, cache=True)
def quantize_rows(x, row_gs, base, offsets, fp8_values, cuts, packed, codes, row_err, row_ref):
    """x [R, K] f32, row_gs [R] f32, base [R, K/16] u8 (amax-rule codes) -> packed, codes."""
    rows, k = x.shape
    for r in numba.prange(rows):
        gs = row_gs[r]
        sq = np.empty(16, dtype=np.float32)
        err_total = 0.0
        ref_total = 0.0
        for b in range(k // 16):
            k0 = b * 16
            c0 = np.int32(base[r, b])
            best = c0
            best_err = _block_error(x, r, k0, fp8_values[c0] / gs, cuts, sq)
            for o in range(1, offsets.shape[0]):
                c = min(max(c0 + offsets[o], 1), 0x7E)
                err = _block_error(x, r, k0, fp8_values[c] / gs, cuts, sq)
                if err < best_err:  # strict: ties keep the earlier candidate
                    best_err = err
                    best = c
            codes[r, b] = best
            step = fp8_values[best] / gs
            for j in range(0, 16, 2):
                y0 = x[r, k0 + j] / step
                y1 = x[r, k0 + j + 1] / step
                n0 = _e2m1_index(abs(y0), cuts) | (8 if y0 < 0 else 0)
                n1 = _e2m1_index(abs(y1), cuts) | (8 if y1 < 0 else 0)
                packed[r, (k0 + j) // 2] = n0 | (n1 << 4)
                ref_total += np.float64(x[r, k0 + j]) ** 2 + np.float64(x[r, k0 + j + 1]) ** 2
            err_total += best_err
        row_err[r] = err_total
        row_ref[r] = ref_total
