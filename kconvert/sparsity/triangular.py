"""The inverse of a batch of lower-triangular matrices from batched matrix products
(docs/obs.md, "The inverse").

`torch.linalg.solve_triangular(L, I)` solves for every column of the identity as if it were a
full right-hand side: about n^3 / 2 multiply-adds per matrix, of which two thirds go to the
zeros above the diagonal. Splitting L into halves,

    L = [[A, 0],      L^-1 = [[A^-1,               0   ],
         [C, B]]               [-B^-1 C A^-1,      B^-1]],

inverts A and B the same way (down to LEAF columns, where solve_triangular does it) and the
off-diagonal block by two products of a full matrix with a triangular one; each of those
splits its triangular factor the same way and skips the zero quarter, so in all the inverse
costs about n^3 / 6 multiply-adds, nearly all of them in large batched GEMMs.

Fixed split points and plain fp32 products (no atomics): the same input gives the same bits
on the same device. The products are summed in another order than a triangular solve's, so
the result differs from solve_triangular's by fp32 rounding (measured in docs/obs.md).
"""

from __future__ import annotations

import torch

# Columns at and below which a diagonal block is inverted by one solve_triangular.
LEAF = 128
# Columns at and below which a product with a triangular factor is one plain GEMM (its zero
# part included: too small to be worth more launches).
PRODUCT_LEAF = 256


def _split(n: int, leaf: int) -> int:
    """Where a block of n columns splits: half of its leaf-sized pieces, so that leaves are
    full-sized wherever n allows."""
    pieces = -(-n // leaf)
    return leaf * (pieces // 2) if pieces > 1 else n // 2


def _triangular_product(t: torch.Tensor, m: torch.Tensor, lower: bool, out: torch.Tensor
                        ) -> None:
    """out = t @ m for triangular t [B, p, p] (lower or upper; the other part is read as zero)
    and m [B, p, q]; out [B, p, q] may be a view."""
    p = t.shape[-1]
    if p <= PRODUCT_LEAF:
        torch.bmm(t.tril() if lower else t.triu(), m, out=out)
        return
    h = _split(p, PRODUCT_LEAF)
    _triangular_product(t[:, :h, :h], m[:, :h], lower, out[:, :h])
    _triangular_product(t[:, h:, h:], m[:, h:], lower, out[:, h:])
    if lower:  # bottom rows also see the top of m through t's lower-left block
        out[:, h:].baddbmm_(t[:, h:, :h], m[:, :h])
    else:  # top rows also see the bottom of m through t's upper-right block
        out[:, :h].baddbmm_(t[:, :h, h:], m[:, h:])


def _invert_lower_(t: torch.Tensor, leaf: int) -> None:
    """Replace lower-triangular t [B, n, n] (a view; above the diagonal zero) by its inverse."""
    n = t.shape[-1]
    if n <= leaf:
        eye = torch.eye(n, dtype=t.dtype, device=t.device).expand_as(t)
        t.copy_(torch.linalg.solve_triangular(t, eye, upper=False))
        return
    h = _split(n, leaf)
    a, c, b = t[:, :h, :h], t[:, h:, :h], t[:, h:, h:]
    _invert_lower_(a, leaf)
    _invert_lower_(b, leaf)
    # C A^-1 = (A^-T C^T)^T, A^-T upper: a product with a triangular factor on the left.
    ca = torch.empty_like(c)
    _triangular_product(a.transpose(1, 2), c.transpose(1, 2), False, ca.transpose(1, 2))
    _triangular_product(b, ca, True, c)
    c.neg_()


def invert_lower_(lower: torch.Tensor, leaf: int = LEAF) -> torch.Tensor:
    """Overwrite lower-triangular matrices L [B, n, n] (float, contiguous; what lies above the
    diagonal is not read) with L^-1 (zero above the diagonal) and return them. With leaf >= n
    it is exactly solve_triangular(L, I). The products follow torch's matmul settings: keep
    TF32 off for an fp32 inverse (obs.prepare_inverse does)."""
    if lower.dim() != 3 or lower.shape[-1] != lower.shape[-2]:
        raise ValueError(f"expected a batch of square matrices [B, n, n], not "
                         f"{list(lower.shape)}")
    _invert_lower_(lower.tril_(), leaf)
    return lower


__all__ = ["LEAF", "PRODUCT_LEAF", "invert_lower_"]
