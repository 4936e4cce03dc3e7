"""REAP compensation's solver (kconvert.pruning.compensate.Refit) against a direct float64
oracle: block Gauss-Seidel written out in the test, each matrix's ridge regression solved as
the augmented least-squares problem [A; sqrt(lam) I] W^T = [goal; sqrt(lam) W_src^T] by
torch.linalg.lstsq. The problem mixes matrices that see more tokens than they have inputs
(the solver's input form), fewer (its token form, as a Kimi expert) and none."""

from __future__ import annotations

import pytest
import torch

from kconvert.gpu.devices import Stopwatch
from kconvert.pruning.compensate import Block, Judged, Refit

INTER, HIDDEN, TOKENS, HELD = 16, 8, 60, 24
ROWS_PER_EXPERT = (40, 10, 0, 5, 25)  # > INTER: input form; < INTER: token form


def _pieces(tokens: int, g: torch.Generator, weights: list[torch.Tensor]) -> Block:
    rows = [torch.arange(tokens)]
    for n in ROWS_PER_EXPERT:
        n = n * tokens // TOKENS
        rows.append(torch.randperm(tokens, generator=g)[:n].sort().values)
    feats = [torch.randn(len(r), INTER, generator=g) for r in rows]
    return Block(rows, feats, weights)


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(HIDDEN, INTER, generator=g) for _ in range(len(ROWS_PER_EXPERT) + 1)]
    fit, held = _pieces(TOKENS, g, weights), _pieces(HELD, g, weights)
    truth = [w + 0.3 * torch.randn(HIDDEN, INTER, generator=g) for w in weights]
    target = fit.output(TOKENS, HIDDEN, lambda b: truth[b])
    target += 0.05 * torch.randn(TOKENS, HIDDEN, generator=g)
    return fit, held, target


def _oracle(fit: Block, target: torch.Tensor, ridge: float, sweeps: int) -> list[torch.Tensor]:
    """Block Gauss-Seidel, each matrix by augmented least squares in float64."""
    w = [s.double() for s in fit.weights]
    residual = target.double() - sum(
        torch.zeros_like(target.double()).index_add(0, r, a.double() @ m.T)
        for r, a, m in zip(fit.rows, fit.features, w, strict=True))
    for _ in range(sweeps):
        for b, (rows, a) in enumerate(zip(fit.rows, fit.features, strict=True)):
            if len(rows) == 0:
                continue
            a = a.double()
            lam = ridge * float((a * a).sum()) / a.shape[1]
            goal = residual[rows] + a @ w[b].T
            eye = (lam ** 0.5) * torch.eye(INTER, dtype=torch.float64)
            lhs = torch.cat([a, eye])
            rhs = torch.cat([goal, (lam ** 0.5) * fit.weights[b].double().T])
            w[b] = torch.linalg.lstsq(lhs, rhs).solution.T
            residual[rows] = goal - a @ w[b].T
    return w


@pytest.mark.parametrize("ridge", [1e-3, 1e-1])
def test_refit_is_the_direct_float64_solution(ridge):
    fit, held, target = _problem()
    refit = Refit(fit, target, held, HELD, len(fit.weights), Stopwatch(torch.device("cpu")))
    forms = {eq.dual for eq in refit.normals if eq is not None}
    assert forms == {True, False} and None in refit.normals
    offsets = refit.solve(ridge, 2)
    want = _oracle(fit, target, ridge, 2)
    for b, w in enumerate(want):
        torch.testing.assert_close(refit.matrix(offsets, b), w.float(), atol=1e-5, rtol=1e-5)
    # the held-out output read from the offsets is the block's with the re-fitted matrices
    torch.testing.assert_close(refit.held_output(offsets),
                               held.output(HELD, HIDDEN, lambda b: want[b].float()),
                               atol=1e-4, rtol=1e-4)


def test_refit_extremes_and_one_matrix():
    fit, held, target = _problem(1)
    watch = Stopwatch(torch.device("cpu"))
    # a huge ridge keeps the source matrices; count 1 re-fits the first matrix alone
    refit = Refit(fit, target, held, HELD, len(fit.weights), watch)
    big = refit.solve(1e9, 2)
    for b, w in enumerate(fit.weights):
        torch.testing.assert_close(refit.matrix(big, b), w, atol=1e-4, rtol=1e-4)
    one = Refit(fit, target, held, HELD, 1, watch)
    got = one.matrix(one.solve(1e-12, 2), 0)
    others = fit.output(TOKENS, HIDDEN, lambda b: 0 * fit.weights[b] if b == 0
                        else fit.weights[b])
    want = torch.linalg.lstsq(fit.features[0].double(), (target - others).double()).solution
    torch.testing.assert_close(got, want.T.float(), atol=1e-4, rtol=1e-4)
    assert {"compensation setup", "compensation factor", "compensation solve"} <= set(
        watch.seconds)



RIDGES = (1e-3, 1e-2, 1e-1, 1.0)


def _with_heldout_target(seed: int, noise: float):
    """A block problem whose fit and held-out targets both come from the same true matrices,
    plus `noise` on every output."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(HIDDEN, INTER, generator=g) for _ in range(len(ROWS_PER_EXPERT) + 1)]
    fit, held = _pieces(TOKENS, g, weights), _pieces(HELD, g, weights)
    truth = [w + 0.3 * torch.randn(HIDDEN, INTER, generator=g) for w in weights]
    fit_target = fit.output(TOKENS, HIDDEN, lambda b: truth[b])
    fit_target += noise * torch.randn(TOKENS, HIDDEN, generator=g)
    held_target = held.output(HELD, HIDDEN, lambda b: truth[b])
    held_target += noise * torch.randn(HELD, HIDDEN, generator=g)
    return fit, held, fit_target, held_target


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().square().mean())


@pytest.mark.parametrize("noise,lowest", [(0.05, 1e-1), (3.0, 1.0)])
def test_the_ridge_taken_has_the_lowest_heldout_error(noise, lowest):
    """Each ridge's held-out error from the oracle's matrices; the crafted problems put the
    lowest at a middle ridge and at the last one."""
    fit, held, fit_target, held_target = _with_heldout_target(0, noise)
    errors = {}
    for ridge in RIDGES:
        want = _oracle(fit, fit_target, ridge, 2)
        errors[ridge] = _mse(held.output(HELD, HIDDEN, lambda b, w=want: w[b].float()),
                             held_target)
    assert min(errors, key=errors.get) == lowest, errors
    refit = Refit(fit, fit_target, held, HELD, len(fit.weights), Stopwatch(torch.device("cpu")))
    ridge, offsets = refit.best(RIDGES, 2, held_target)
    assert ridge == lowest
    assert _mse(refit.held_output(offsets), held_target) == pytest.approx(errors[lowest],
                                                                         rel=1e-4)


def test_the_guard_refuses_a_refit_that_raises_the_heldout_error():
    """Held-out targets the source matrices compute exactly: any re-fit can only move the
    held-out output away from them, so the guard must refuse; with held-out targets from the
    same truth as the fit's, it applies. Judged's errors against those computed here."""
    fit, held, fit_target, truth_held = _with_heldout_target(0, 0.05)
    exact_held = held.output(HELD, HIDDEN)
    for held_target, applied in ((exact_held, False), (truth_held, True)):
        refit = Refit(fit, fit_target, held, HELD, len(fit.weights),
                      Stopwatch(torch.device("cpu")))
        _, offsets = refit.best(RIDGES, 2, held_target)
        refitted = [refit.matrix(offsets, b) for b in range(len(fit.weights))]
        judged = Judged.of(fit, held, lambda b, m=refitted: m[b], fit_target, held_target)
        assert judged.applied is applied
        assert judged == Judged(
            fit_mse_before=_mse(fit.output(TOKENS, HIDDEN), fit_target),
            fit_mse_after=_mse(fit.output(TOKENS, HIDDEN, lambda b, m=refitted: m[b]),
                               fit_target),
            heldout_mse_before=_mse(held.output(HELD, HIDDEN), held_target),
            heldout_mse_after=_mse(held.output(HELD, HIDDEN, lambda b, m=refitted: m[b]),
                                   held_target))
    assert judged.fit_mse_after < judged.fit_mse_before
