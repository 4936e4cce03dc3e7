"""Closed-form compensation of a pruned MoE block (reap.md, "Compensation").

After pruning (and router repair, if any), the pruned block computes
``y = sum_j g'_j(x) W_j a_j(x) + W_s a_s(x)``: the kept experts' down_proj W_j applied to their
intermediate activations a_j = act(gate_j x) * up_j x, weighted by the pruned model's
renormalised routing g'_j, plus the shared expert's down_proj W_s on its activations a_s.
`y` is linear in every down_proj, so re-fitting them to the unpruned block's output on the
calibration tokens is a least-squares problem: ridge regression (pulled toward the source
matrix, not toward zero) in float64. The shared expert (every token) and then each kept expert
in ascending id (its routed tokens) are solved in turn on the residual the others leave,
`sweeps` times (block Gauss-Seidel); everything is in a fixed order, so the same run writes
the same bytes (at the same torch thread count: BLAS splits its sums by threads, so another
count may round differently).

Each matrix's system is solved in the smaller of two equal forms (`Normal`): over its inputs
(A^T A + lam I) X = A^T R, or, when it sees fewer tokens than it has inputs (a Kimi expert
sees about 1000 fit tokens and has 2048 inputs), over its tokens (A A^T + lam I) Y = R with
X = A^T Y. The Gram matrix is formed once for every ridge and sweep, its Cholesky factor once
per ridge; the unknown is the offset from the source matrix, so the first sweep needs no
product with it, and in the token form the residual a solve leaves is lam Y.

`which` picks the matrices: "shared" (the shared expert's down_proj only) or "down" (the
shared expert's and every kept expert's down_proj).

Each layer takes, of the ridges tried, the one whose re-fit has the lowest error on the
held-out tokens (`Refit.best`), and the re-fit is written only where its held-out error as
written (quantized matrices decoded again) is below the source matrices' (`Judged.applied`,
the guard).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kconvert.gpu.devices import Stopwatch


@dataclass(frozen=True)
class Routing:
    """The pruned model's routing of a set of tokens: weights [T, k] fp32 (renormalised, times
    routed_scaling_factor) and kept-expert indices [T, k] (0..K-1, new ids)."""

    weights: torch.Tensor
    ids: torch.Tensor


def activations(gate_up: torch.Tensor, act_fn, x: torch.Tensor) -> torch.Tensor:
    """act(gate x) * up x [T, inter] fp32 of one expert (gate_up [2 inter, hidden])."""
    gate, up = nn.functional.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
    return act_fn(gate) * up


def shared_activations(shared: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The shared expert's down_proj input [T, inter] fp32 (transformers' DeepseekV3MLP)."""
    xf = x.float()
    gate = nn.functional.linear(xf, shared.gate_proj.weight.float())
    up = nn.functional.linear(xf, shared.up_proj.weight.float())
    return shared.act_fn(gate) * up


@dataclass
class Block:
    """The linear pieces of a pruned block on a set of tokens: per fitted matrix its token rows
    and features (gate-weighted activations), and its source matrix as the layer holds it
    (each is used in fp32 on the features' device one at a time, since fp32 copies of a Kimi
    layer's 193 down_proj matrices alone take 11 GB of GPU memory)."""

    rows: list[torch.Tensor]  # token indices the matrix sees
    features: list[torch.Tensor]  # [n_rows, inter] fp32
    weights: list[torch.Tensor]  # [hidden, inter]

    def weight(self, b: int) -> torch.Tensor:
        """Source matrix b in fp32 on the features' device."""
        return self.weights[b].to(self.features[b].device, torch.float32)

    def output(self, n_tokens: int, hidden: int,
               weight: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The block's output [n_tokens, hidden] fp32 with matrix b = weight(b) (default: the
        source matrices)."""
        weight = weight or self.weight
        out = torch.zeros(n_tokens, hidden, dtype=torch.float32, device=self.features[0].device)
        for b, (rows, a) in enumerate(zip(self.rows, self.features, strict=True)):
            out[rows] += a @ weight(b).T  # a token reaches each matrix at most once
        return out


def block(moe, kept: list[int], routing: Routing, x: torch.Tensor,
          down: list[torch.Tensor], shared_down: torch.Tensor) -> Block:
    """The pieces of the pruned block on x [T, hidden]: the shared expert first, then kept
    expert i (source id kept[i]) on its routed tokens with features g'_i a_i; `down` and
    `shared_down` the source matrices."""
    t = x.shape[0]
    rows = [torch.arange(t, device=x.device)]
    feats = [shared_activations(moe.shared_experts, x)]
    for i, src in enumerate(kept):
        tok, slot = (routing.ids == i).nonzero(as_tuple=True)
        rows.append(tok)
        g = routing.weights[tok, slot].unsqueeze(1)
        feats.append(activations(moe.experts.gate_up[src], moe.act_fn, x[tok]) * g)
    return Block(rows, feats, [shared_down, *down])


@dataclass(frozen=True)
class Normal:
    """The ridge-independent part of one matrix's normal equations (module docstring): the
    Gram matrix in float64, over the tokens (`dual`: A A^T [n, n], when n < inputs) or over
    the inputs (A^T A [inter, inter]), and `scale`, the mean diagonal of A^T A (the ridge is
    relative to it)."""

    gram: torch.Tensor
    scale: float
    dual: bool

    @classmethod
    def of(cls, features: torch.Tensor) -> Normal:
        a = features.double()
        dual = a.shape[0] < a.shape[1]
        gram = a @ a.T if dual else a.T @ a
        # trace(A A^T) = trace(A^T A): the same scale in both forms
        scale = float(gram.diagonal().sum()) / a.shape[1]
        return cls(gram, max(scale, 1e-30), dual)

    def factor(self, ridge: float) -> torch.Tensor:
        """Cholesky factor of gram + ridge x scale x I."""
        g = self.gram.clone()
        g.diagonal().add_(ridge * self.scale)
        return torch.linalg.cholesky(g)


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().square().mean()) if a.numel() else 0.0


@dataclass(frozen=True)
class Judged:
    """A layer's block-output mean squared errors against the unpruned block, on the fit and
    the held-out tokens, with the source matrices (before) and the re-fitted ones as written
    (after)."""

    fit_mse_before: float
    fit_mse_after: float
    heldout_mse_before: float
    heldout_mse_after: float

    @property
    def applied(self) -> bool:
        """The guard: the re-fit is written only where it lowers the held-out error."""
        return self.heldout_mse_after < self.heldout_mse_before

    @classmethod
    def of(cls, fit: Block, held: Block, written: Callable[[int], torch.Tensor],
           fit_target: torch.Tensor, held_target: torch.Tensor) -> Judged:
        """The errors of the blocks on the fit and held-out tokens with their source matrices
        and with matrix b = written(b)."""
        dims = fit_target.shape[1]
        n_fit, n_held = fit_target.shape[0], held_target.shape[0]
        return cls(fit_mse_before=mse(fit.output(n_fit, dims), fit_target),
                   fit_mse_after=mse(fit.output(n_fit, dims, written), fit_target),
                   heldout_mse_before=mse(held.output(n_held, dims), held_target),
                   heldout_mse_after=mse(held.output(n_held, dims, written), held_target))


class Refit:
    """The re-fit of the first `count` matrices of a block (`fit` tokens, `target` their
    unpruned output) and its judge (`held`: the held-out tokens' pieces, same matrices).

    `solve(ridge, sweeps)` gives the offsets from the source matrices (per matrix X [inter,
    hidden] or, in the token form, Y [n, hidden], fp32; None for a matrix that sees no token);
    `matrix` and `held_output` read them."""

    def __init__(self, fit: Block, target: torch.Tensor, held: Block, n_held: int, count: int,
                 watch: Stopwatch):
        self.fit, self.held, self.count, self.watch = fit, held, count, watch
        hidden = target.shape[1]
        with watch.phase("compensation setup"):
            self.fit_before = fit.output(target.shape[0], hidden)
            self.held_before = held.output(n_held, hidden)
            self.residual = target.float() - self.fit_before
            self.normals = [Normal.of(a) if a.shape[0] else None
                            for a in fit.features[:count]]
            # held-out features times A^T, once: the held-out output of a token-form offset Y
            # is then one product with Y per ridge
            self.cross = [held.features[b] @ fit.features[b].T if eq is not None and eq.dual
                          else None for b, eq in enumerate(self.normals)]

    def solve(self, ridge: float, sweeps: int) -> list[torch.Tensor | None]:
        with self.watch.phase("compensation factor"):
            factors = [eq.factor(ridge) if eq is not None else None for eq in self.normals]
        with self.watch.phase("compensation solve"):
            residual = self.residual.clone()
            offsets: list[torch.Tensor | None] = [None] * self.count
            for _ in range(sweeps if self.count > 1 else 1):
                for b, (eq, factor) in enumerate(zip(self.normals, factors, strict=True)):
                    if eq is None:
                        continue
                    rows, old = self.fit.rows[b], offsets[b]
                    r = residual[rows].double()
                    if eq.dual:
                        goal = r if old is None else r + eq.gram @ old.double()
                        y = torch.cholesky_solve(goal, factor)
                        # (G + lam) Y = goal: what the matrix leaves of goal is lam Y
                        residual[rows] = (ridge * eq.scale * y).float()
                        offsets[b] = y.float()
                    else:
                        a = self.fit.features[b].double()
                        rhs = a.T @ r
                        if old is not None:
                            rhs += eq.gram @ old.double()
                        x = torch.cholesky_solve(rhs, factor)
                        change = x if old is None else x - old.double()
                        residual[rows] = (r - a @ change).float()
                        offsets[b] = x.float()
        return offsets

    def best(self, ridges: Sequence[float], sweeps: int, held_target: torch.Tensor
             ) -> tuple[float, list[torch.Tensor | None]]:
        """Of `ridges`, the one whose re-fit has the lowest mean squared error against
        `held_target` on the held-out tokens (ties: the smaller ridge), and its offsets; only
        the best offsets so far are held."""
        best = None
        for ridge in ridges:
            offsets = self.solve(ridge, sweeps)
            with self.watch.phase("compensation choice"):
                got = (mse(self.held_output(offsets), held_target), ridge, offsets)
            if best is None or got[:2] < best[:2]:
                best = got
            del offsets, got
        return best[1], best[2]

    def matrix(self, offsets: list[torch.Tensor | None], b: int) -> torch.Tensor:
        """Matrix b re-fitted [hidden, inter], fp32 on the features' device."""
        source, off = self.fit.weight(b), offsets[b]
        if off is None:
            return source
        if self.normals[b].dual:
            off = (self.fit.features[b].double().T @ off.double()).float()
        return source + off.T

    def held_output(self, offsets: list[torch.Tensor | None]) -> torch.Tensor:
        """The block's output on the held-out tokens with the re-fitted matrices."""
        out = self.held_before.clone()
        for b, off in enumerate(offsets):
            if off is None or self.held.rows[b].shape[0] == 0:
                continue
            by = self.cross[b] if self.normals[b].dual else self.held.features[b]
            out[self.held.rows[b]] += by @ off
        return out
