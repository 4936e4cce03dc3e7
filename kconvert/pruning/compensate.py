"""Closed-form compensation of a pruned MoE block (reap.md, "Compensation").

After pruning (and router repair, if any), the pruned block computes
``y = sum_j g'_j(x) W_j a_j(x) + W_s a_s(x)``: the kept experts' down_proj W_j applied to their
intermediate activations a_j = act(gate_j x) * up_j x, weighted by the pruned model's
renormalised routing g'_j, plus the shared expert's down_proj W_s on its activations a_s.
`y` is linear in every down_proj, so re-fitting them to the unpruned block's output on the
calibration tokens is a least-squares problem: ridge regression (pulled toward the source
matrix, not toward zero) with float64 normal equations. The shared expert (every token) and
then each kept expert in ascending id (its routed tokens) are solved in turn on the residual
the others leave, `sweeps` times (block Gauss-Seidel); everything is in a fixed order, so the
result does not depend on thread counts.

`which` picks the matrices: "shared" (the shared expert's down_proj only) or "down" (the
shared expert's and every kept expert's down_proj).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kconvert import gpu_budget


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
    and features (gate-weighted activations), and the current matrices in whatever dtype and
    place they are held (the layer's own tensors, fitted ones on the host): each is used in
    fp32 on the features' device one at a time, since fp32 copies of a Kimi layer's 193
    down_proj matrices alone take 11 GB of GPU memory."""

    rows: list[torch.Tensor]  # token indices the matrix sees
    features: list[torch.Tensor]  # [n_rows, inter] fp32
    weights: list[torch.Tensor]  # [hidden, inter]

    def weight(self, b: int) -> torch.Tensor:
        """Matrix b in fp32 on the features' device."""
        return self.weights[b].to(self.features[b].device, torch.float32)

    def output(self, n_tokens: int, hidden: int) -> torch.Tensor:
        out = torch.zeros(n_tokens, hidden, dtype=torch.float32, device=self.features[0].device)
        for b, (rows, a) in enumerate(zip(self.rows, self.features, strict=True)):
            out[rows] += a @ self.weight(b).T  # a token reaches each matrix at most once
        return out


def block(moe, kept: list[int], routing: Routing, x: torch.Tensor,
          down: list[torch.Tensor], shared_down: torch.Tensor) -> Block:
    """The pieces of the pruned block on x [T, hidden]: the shared expert first, then kept
    expert i (source id kept[i]) on its routed tokens with features g'_i a_i; `down` and
    `shared_down` the matrices to start from."""
    t = x.shape[0]
    rows = [torch.arange(t, device=x.device)]
    feats = [shared_activations(moe.shared_experts, x)]
    for i, src in enumerate(kept):
        tok, slot = (routing.ids == i).nonzero(as_tuple=True)
        rows.append(tok)
        g = routing.weights[tok, slot].unsqueeze(1)
        feats.append(activations(moe.experts.gate_up[src], moe.act_fn, x[tok]) * g)
    return Block(rows, feats, [shared_down, *down])


def solve(features: torch.Tensor, target: torch.Tensor, start: torch.Tensor,
          ridge: float) -> torch.Tensor:
    """argmin_W |target - features W^T|^2 + lam |W - start|^2, lam = ridge x mean diagonal of
    features^T features; float64 normal equations, Cholesky (fp32 result)."""
    a = features.double()
    gram = a.T @ a
    lam = ridge * float(gram.diagonal().mean().clamp(min=1e-30))
    gram.diagonal().add_(lam)
    rhs = a.T @ target.double() + lam * start.double().T
    return torch.cholesky_solve(rhs, torch.linalg.cholesky(gram)).T.float()


def fit(pieces: Block, target: torch.Tensor, which: str, ridge: float, sweeps: int) -> Block:
    """`pieces` with its matrices re-fitted to `target` [T, hidden] (module docstring); the
    re-fitted ones stay fp32 on the features' device where they fit in what the command's GPU
    memory budget leaves (gpu_budget.room, with a quarter to spare), else they go to the host
    (see Block): the host round trips of a Kimi layer's 193 matrices, per sweep and ridge,
    cost minutes on an H100."""
    fitted = Block(pieces.rows, pieces.features, list(pieces.weights))
    residual = target.float() - pieces.output(target.shape[0], target.shape[1])
    count = 1 if which == "shared" else len(fitted.weights)
    device = target.device
    need = 4 * sum(w.numel() for w in pieces.weights[:count])
    home = device if device.type == "cpu" or need * 5 // 4 < gpu_budget.room(device) else "cpu"
    for _ in range(sweeps if count > 1 else 1):
        for b in range(count):
            rows, a = pieces.rows[b], pieces.features[b]
            if a.shape[0] == 0:
                continue
            goal = residual[rows] + a @ fitted.weight(b).T
            solved = solve(a, goal, pieces.weight(b), ridge)
            residual[rows] = goal - a @ solved.T
            fitted.weights[b] = solved.to(home)
    return fitted
