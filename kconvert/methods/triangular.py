"""The inverse Cholesky factor L^-1 of a batch of SPD matrices from batched matrix products
(docs/obs.md, "The inverse"): what obs.prepare_inverse needs.

A Cholesky then `torch.linalg.solve_triangular(L, I)` costs n^3 / 6 + n^3 / 2 multiply-adds
per matrix: the solve treats every column of the identity as a full right-hand side, so two
thirds of its work goes to the zeros above the diagonal. Split into halves,

    A = [[A11, A21^T],     L = [[L11, 0  ],     L^-1 = [[L11^-1,                 0     ],
         [A21, A22  ]],         [L21, L22]],             [-L22^-1 L21 L11^-1,    L22^-1]],

with L21 = A21 L11^-T and L22 L22^T = A22 - L21 L21^T: `inverse_cholesky_factor_` recurses
on the two diagonal blocks (down to leaves of LEAF to 2 LEAF - 1 columns, where torch's
Cholesky and solve do them)
and gets L21, the Schur complement and the off-diagonal block of L^-1 from products with
triangular factors, each of which splits its triangle the same way and skips the zero (or
unread) quarter: about n^3 / 3 multiply-adds in all, nearly all in large batched GEMMs.
`invert_lower_` is the inverse half alone, for a factor from elsewhere (n^3 / 6).

Fixed split points and plain products (no atomics): the same input gives the same bits on
the same device. The sums run in another order than a Cholesky's and a triangular solve's, so
the result differs from theirs by fp32 rounding (measured in docs/obs.md); for n < 2 * leaf
(one leaf) it is exactly theirs.
"""

from __future__ import annotations

import torch

# Diagonal blocks of LEAF to 2 * LEAF - 1 columns are factored and inverted by torch's Cholesky
# and solve_triangular (small batched cuSOLVER / cuBLAS calls on a GPU); a matrix of fewer than
# 2 * LEAF columns is one leaf, so small matrices take those two calls and nothing else.
LEAF = 128
# Products with a triangular factor of fewer than 2 * PRODUCT_LEAF columns are one plain GEMM
# (its zero part included: too small to be worth more launches).
PRODUCT_LEAF = 128


def _split(n: int, leaf: int) -> int | None:
    """Where a block of n columns splits: after half of its whole leaf-sized pieces (so the
    leaves are leaf to 2 * leaf - 1 wide, full-sized wherever n allows); None: n is a leaf."""
    pieces = n // leaf
    return leaf * (pieces // 2) if pieces > 1 else None


def _triangular_product(t: torch.Tensor, m: torch.Tensor, lower: bool, out: torch.Tensor
                        ) -> None:
    """out = t @ m for triangular t [B, p, p] (lower or upper; the other part is read as zero)
    and m [B, p, q]; out [B, p, q] may be a view."""
    h = _split(t.shape[-1], PRODUCT_LEAF)
    if h is None:
        torch.bmm(t.tril() if lower else t.triu(), m, out=out)
        return
    _triangular_product(t[:, :h, :h], m[:, :h], lower, out[:, :h])
    _triangular_product(t[:, h:, h:], m[:, h:], lower, out[:, h:])
    if lower:  # bottom rows also see the top of m through t's lower-left block
        out[:, h:].baddbmm_(t[:, h:, :h], m[:, :h])
    else:  # top rows also see the bottom of m through t's upper-right block
        out[:, :h].baddbmm_(t[:, :h, h:], m[:, h:])


def _invert_lower_(t: torch.Tensor, leaf: int) -> None:
    """Replace lower-triangular t [B, n, n] (a view; above the diagonal zero) by its inverse."""
    h = _split(t.shape[-1], leaf)
    if h is None:
        eye = torch.eye(t.shape[-1], dtype=t.dtype, device=t.device).expand_as(t)
        t.copy_(torch.linalg.solve_triangular(t, eye, upper=False))
        return
    a, c, b = t[:, :h, :h], t[:, h:, :h], t[:, h:, h:]
    _invert_lower_(a, leaf)
    _invert_lower_(b, leaf)
    # C A^-1 = (A^-T C^T)^T, A^-T upper: a product with a triangular factor on the left.
    ca = torch.empty_like(c)
    _triangular_product(a.transpose(1, 2), c.transpose(1, 2), False, ca.transpose(1, 2))
    _triangular_product(b, ca, True, c)
    c.neg_()


def _subtract_gram_(out: torch.Tensor, m: torch.Tensor) -> None:
    """out -= m @ m^T on and below the diagonal of out [B, p, p] (a view; above it, some
    entries are updated and others not: not to be read), m [B, p, q]."""
    h = _split(out.shape[-1], PRODUCT_LEAF)
    if h is None:
        out.baddbmm_(m, m.transpose(1, 2), alpha=-1.0)
        return
    _subtract_gram_(out[:, :h, :h], m[:, :h])
    out[:, h:, :h].baddbmm_(m[:, h:], m[:, :h].transpose(1, 2), alpha=-1.0)
    _subtract_gram_(out[:, h:, h:], m[:, h:])


def _leaf_inverse(t: torch.Tensor) -> torch.Tensor:
    """L^-1 (zero above the diagonal) of SPD t [B, n, n] by torch's Cholesky, which reads the
    lower triangle only (LAPACK's potrf 'L'), and one solve_triangular against I."""
    eye = torch.eye(t.shape[-1], dtype=t.dtype, device=t.device).expand_as(t)
    return torch.linalg.solve_triangular(torch.linalg.cholesky(t), eye, upper=False)


def _factor_and_invert_(t: torch.Tensor, leaf: int) -> None:
    """Replace SPD t [B, n, n] (a view; its lower triangle is read) by L^-1, L its lower
    Cholesky factor (above the diagonal: not to be read)."""
    h = _split(t.shape[-1], leaf)
    if h is None:
        t.copy_(_leaf_inverse(t))
        return
    a, c, b = t[:, :h, :h], t[:, h:, :h], t[:, h:, h:]
    _factor_and_invert_(a, leaf)  # A = L11 L11^T; a := L11^-1
    l21 = torch.empty_like(c)  # L21 = C L11^-T = (L11^-1 C^T)^T
    _triangular_product(a, c.transpose(1, 2), True, l21.transpose(1, 2))
    _subtract_gram_(b, l21)  # the Schur complement B - L21 L21^T = L22 L22^T
    _factor_and_invert_(b, leaf)  # b := L22^-1
    # the inverse's lower-left block: -L22^-1 L21 L11^-1, with c and l21 as scratch
    _triangular_product(a.transpose(1, 2), l21.transpose(1, 2), False, c.transpose(1, 2))
    _triangular_product(b, c, True, l21)
    torch.neg(l21, out=c)


def inverse_cholesky_factor_(spd: torch.Tensor, leaf: int = LEAF) -> torch.Tensor:
    """L^-1, L the lower Cholesky factor of SPD matrices A [B, n, n] (float; the lower triangle
    is read), zero above the diagonal, in A's storage (A overwritten) unless n < 2 * leaf: the
    Cholesky and the inverse in one recursion of batched GEMMs (about n^3 / 3 multiply-adds
    in all), Cholesky and solve_triangular only on diagonal blocks of leaf to 2 * leaf - 1
    columns.
    Products as in `invert_lower_` (obs.prepare_inverse sets TF32 as its caller asks)."""
    _check_square(spd)
    if _split(spd.shape[-1], leaf) is None:
        return _leaf_inverse(spd)
    _factor_and_invert_(spd, leaf)
    return spd.tril_()


def _check_square(t: torch.Tensor) -> None:
    if t.dim() != 3 or t.shape[-1] != t.shape[-2]:
        raise ValueError(f"expected a batch of square matrices [B, n, n], not {list(t.shape)}")


def invert_lower_(lower: torch.Tensor, leaf: int = LEAF) -> torch.Tensor:
    """Overwrite lower-triangular matrices L [B, n, n] (float, contiguous; what lies above the
    diagonal is not read) with L^-1 (zero above the diagonal) and return them. With n < 2 * leaf
    it is exactly solve_triangular(L, I). The products follow torch's matmul settings: TF32
    off for an fp32 inverse, on for a TF32 one (obs.prepare_inverse sets it)."""
    _check_square(lower)
    _invert_lower_(lower.tril_(), leaf)
    return lower


__all__ = ["LEAF", "PRODUCT_LEAF", "inverse_cholesky_factor_", "invert_lower_"]
