"""obs.prepare_inverse's inverse Cholesky factor from batched GEMMs (kconvert.methods.triangular)
against the Cholesky and solve_triangular it replaces (tests/oracles.py `inverse_by_solve`) and
against a float64 solution; the effect of its rounding on GPTQ and SparseGPT.

Tolerance (docs/obs.md, "The inverse"): U within 4e-6 of the oracle's, relative in the
Frobenius norm (measured up to 1.5e-6 here), on well-conditioned, rank-deficient and
zero-diagonal Hessians, and no further from the float64 U than 1.5 times the oracle's own
distance to it (measured 0.80 to 0.99 times). Leaves and product leaves are shrunk to 16 and
8 columns in most cases so that small matrices go through every level of both recursions.
"""

from __future__ import annotations

import pytest
import torch

from helpers import obs_problem
from kconvert.methods import obs, sparsegpt, triangular
from oracles import inverse_by_solve

TOL = 4e-6


@pytest.fixture
def small_leaves(monkeypatch):
    """Product leaves of 8 under leaves of 16 (blocks of 8-15 and 16-31 columns): the Schur
    complements' updates then skip upper-right quarters inside diagonal leaves too, which the
    leaves' Cholesky must not read."""
    monkeypatch.setattr(triangular, "PRODUCT_LEAF", 8)
    return 16


def _hessian(b: int, n: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, tokens, n, generator=g) * (torch.rand(n, generator=g) * 3 + 0.1)
    return x.transpose(1, 2) @ x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=(1, 2)) / b.norm(dim=(1, 2))).max())


def _float64_u(h: torch.Tensor) -> torch.Tensor:
    """U in float64 from the damped Hessian (the same damping, in fp32, as both functions), by
    the old function's steps in float64, where their rounding is far below fp32's."""
    d = h.float().clone()
    diag = d.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag += obs.PERCDAMP * diag.mean(-1, keepdim=True)
    lower = torch.linalg.cholesky(d.double().flip(-2, -1))
    eye = torch.eye(d.shape[-1], dtype=torch.float64).expand_as(lower)
    return torch.linalg.solve_triangular(lower, eye, upper=False).flip(-2, -1)


@pytest.mark.parametrize("n,tokens,leaf", [
    (200, 1000, 16),   # full rank, deep recursion, a partial last leaf
    (200, 60, 16),     # rank-deficient (fewer tokens than columns), as Kimi's experts are
    (300, 2000, None),  # the default leaf: 128 + 172 columns
    (96, 500, 16)])
def test_blocked_inverse_is_the_solves_within_tolerance(small_leaves, n, tokens, leaf):
    h = _hessian(2, n, tokens, seed=n + tokens)
    h[1, 7, :] = h[1, :, 7] = 0.0  # a column no token touched
    h[1, 50, :] = h[1, :, 50] = 0.0
    u, ref, exact = obs.prepare_inverse(h, leaf=leaf), inverse_by_solve(h), _float64_u(h)
    print(f"n {n} tokens {tokens}: |U - U_solve| {_rel(u, ref):.2e}, "
          f"|U - U64| {_rel(u.double(), exact):.2e}, |U_solve - U64| "
          f"{_rel(ref.double(), exact):.2e}")
    assert _rel(u, ref) <= TOL
    assert _rel(u.double(), exact) <= 1.5 * _rel(ref.double(), exact)
    assert torch.equal(u, u.triu())
    assert bool((u.diagonal(dim1=-2, dim2=-1) > 0).all())
    # an untouched column neither receives nor passes error: its row of U is zero off the
    # diagonal (its damped Hessian row is diagonal)
    assert not bool(u[1, 7, 8:].any()) and not bool(u[1, :7, 7].any())


def test_leaf_at_least_n_is_exactly_the_solve():
    """With one leaf, torch's Cholesky (which reads the lower triangle) and one solve: the old
    function's bits, also where the Gram matrix is not exactly symmetric (a GPU's may not be)."""
    h = _hessian(3, 64, 300, seed=1)
    h = h + 1e-3 * torch.randn(h.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(obs.prepare_inverse(h, leaf=64), inverse_by_solve(h))
    assert torch.equal(obs.prepare_inverse(h), inverse_by_solve(h))  # 64 < 2 * LEAF: one leaf


def test_blocked_inverse_is_deterministic(small_leaves):
    h = _hessian(2, 160, 400, seed=2)
    first = obs.prepare_inverse(h, leaf=16)
    for _ in range(2):
        assert torch.equal(obs.prepare_inverse(h, leaf=16), first)


@pytest.mark.parametrize("n", [160, 77])
def test_the_two_halves_alone(small_leaves, n):
    """invert_lower_ of a Cholesky factor, and inverse_cholesky_factor_ of an SPD matrix:
    lower-triangular inverses of L within tolerance of solve_triangular's."""
    spd = _hessian(2, n, 3 * n, seed=n) + torch.eye(n)
    lower = torch.linalg.cholesky(spd)
    ref = torch.linalg.solve_triangular(lower, torch.eye(n).expand(2, -1, -1), upper=False)
    for got in (triangular.invert_lower_(lower.clone(), 16),
                triangular.inverse_cholesky_factor_(spd.clone(), 16)):
        assert torch.equal(got, got.tril())
        assert _rel(got, ref) <= TOL


def test_a_non_square_batch_is_refused():
    for fn in (triangular.invert_lower_, triangular.inverse_cholesky_factor_):
        with pytest.raises(ValueError, match=r"\[B, n, n\]"):
            fn(torch.ones(2, 4, 5))


def test_the_inverse_runs_in_fp32_or_tf32_only():
    h = torch.eye(8)[None] * 2
    assert torch.equal(obs.prepare_inverse(h, precision="tf32"), obs.prepare_inverse(h))
    with pytest.raises(ValueError, match="fp32 or tf32"):
        obs.prepare_inverse(h, precision="bf16")


def test_gptq_and_sparsegpt_barely_move_with_the_new_rounding(small_leaves):
    """The same OBS problem under the oracle's U and the blocked U: block codes and W-hat
    values that differ, and the reconstruction error, as measured in docs/obs.md."""
    w, h, gs = obs_problem(2, 64, 256, 600, seed=3, arithmetic="compressed-tensors")
    row_gs = gs.repeat_interleave(64).reshape(2, 64)
    u_old, u_new = inverse_by_solve(h), obs.prepare_inverse(h, leaf=16)
    for mask in (None, sparsegpt.p48_mask):
        old = obs.obs_quantize(w, u_old, row_gs, 16, "mse", mask=mask, kernel="torch")
        new = obs.obs_quantize(w, u_new, row_gs, 16, "mse", mask=mask, kernel="torch")
        err = [float(obs.output_error(w, r[0], h).sum() / obs.output_error(w, 0 * w, h).sum())
               for r in (old, new)]
        codes = int((old[1] != new[1]).sum())
        values = int((old[0] != new[0]).sum())
        print(f"mask {mask is not None}: codes differing {codes}/{old[1].numel()}, values "
              f"{values}/{w.numel()}, rel error {err[0]:.6f} -> {err[1]:.6f}")
        assert codes <= old[1].numel() // 1000 and values <= w.numel() // 100
        assert abs(err[1] - err[0]) <= 0.01 * err[0]
