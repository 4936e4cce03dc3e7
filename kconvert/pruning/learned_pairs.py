"""The (token, slot) pairs of a batch of kept experts in learned compensation
(kconvert.pruning.compensate_learned), their routed sum, and the gradients of the batch's loss
on them, written out (autograd's backward, op for op)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kconvert.methods.expert_training import expert_outputs


@dataclass
class Pairs:
    """The (token, slot) pairs of a batch of kept experts: their rows, expert after expert
    (ascending), each expert's tokens ascending, and where each row's output goes among the
    batch's tokens (`local`; `ranks`: the rows by their place among their token's pairs in the
    batch, ascending expert). Rows are not padded to the busiest expert's count: under uneven
    routing the padding was most of a batch's work (2.4x the rows at a load spread of 0.5 in
    the logits)."""

    tokens: torch.Tensor  # the batch's tokens [T_B] (indices into the fit tokens), ascending
    x: torch.Tensor  # [N, H] the rows' inputs in the compute dtype
    gate: torch.Tensor  # [N] fp32 the rows' router weights
    counts: list[int]  # rows per expert of the batch
    local: torch.Tensor  # [N] token position in `tokens` of each row
    # per place r among a token's pairs: (the rows in place r, their tokens' positions); a
    # token has at most one row in each
    ranks: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def depth(self) -> int:
        """The most pairs a token has in the batch."""
        return len(self.ranks)

    @classmethod
    def of(cls, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: range,
           dtype: torch.dtype = torch.float32) -> Pairs:
        """The pairs of kept experts `experts` (new ids) under routing (weights, ids) [T, k],
        inputs in `dtype`."""
        rows = [(ids == e).nonzero(as_tuple=True) for e in experts]
        tok = torch.cat([t for t, _ in rows]) if rows else ids.new_zeros(0)
        slot = torch.cat([s for _, s in rows]) if rows else ids.new_zeros(0)
        tokens, local = torch.unique(tok, return_inverse=True)
        order = torch.argsort(local, stable=True)  # by token, then expert
        counts = torch.bincount(local, minlength=len(tokens))
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(local)
        rank[order] = torch.arange(len(local), device=x.device) - starts[local[order]]
        depth = int(counts.max()) if len(tok) else 0
        places = [(rank == r).nonzero(as_tuple=True)[0] for r in range(depth)]
        return cls(tokens, x[tok].to(dtype), weights[tok, slot].float(),
                   [len(t) for t, _ in rows], local, [(p, local[p]) for p in places])

    def output(self, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """sum over the batch's experts of g f_j(x) per token [T_B, H] fp32, from gate_up
        [E, 2I, H] and down [E, H, I] (each expert's products in the rows' dtype, with fp32
        accumulation)."""
        gate_up, down = gate_up.to(self.x.dtype), down.to(self.x.dtype)
        out = torch.cat([expert_outputs(x.unsqueeze(0), g.unsqueeze(0), d.unsqueeze(0))[0]
                         for x, g, d in zip(self.x.split(self.counts), gate_up, down,
                                            strict=True)])
        return self.token_sums(out)

    def token_sums(self, out: torch.Tensor) -> torch.Tensor:
        """The rows' outputs [N, H] weighted by their router weights and summed per token
        [T_B, H] fp32, each token's pairs added in a fixed order (no atomic adds) and no
        [T_B, depth, H] buffer (up to 6 GB on a Kimi layer)."""
        out = out.float() * self.gate.unsqueeze(-1)
        total = out.new_zeros(len(self.tokens), out.shape[-1])
        for rows, at in self.ranks:  # no token twice in one place: no two adds meet
            total[at] += out[rows]
        return total

    def gradients(self, gate_up: torch.Tensor, down: torch.Tensor, residual: torch.Tensor,
                  norm: torch.Tensor, grads: tuple[torch.Tensor, torch.Tensor],
                  mine: range, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The gradients of |output(all experts) - residual|^2 / norm in the matrices of the
        batch's experts `mine` (positions in the batch), gate_up [M, 2I, H] and down
        [M, H, I] in the rows' dtype, into `grads` (same shapes and dtype): autograd's
        backward of `output`, op for op, written out so that no fp32 gradient of a whole
        batch's matrices, no per-expert slice of one and no graph is made (a test holds it to
        autograd's). `gather(rows)`: these experts' output rows -> every expert's, in expert
        order (the other ranks' under torchrun: kconvert.pruning.learned_team)."""
        first = sum(self.counts[:mine.start])
        counts = self.counts[mine.start:mine.stop]
        rows = slice(first, first + sum(counts))
        saved, outs = [], [self.x.new_zeros(0, self.x.shape[1])]
        for x, gu, dn in zip(self.x[rows].split(counts), gate_up, down, strict=True):
            x = x.unsqueeze(0)
            gate, up = torch.bmm(x, gu.unsqueeze(0).transpose(1, 2)).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            outs.append(torch.bmm(act, dn.unsqueeze(0).transpose(1, 2))[0])
            saved.append((x, gate, up, act))
        # d loss / d token sum: 2 (sum - residual) / norm
        d_sum = (self.token_sums(gather(torch.cat(outs))) - residual) * (2 / norm)
        d_rows = (d_sum[self.local[rows]] * self.gate[rows].unsqueeze(-1)).to(self.x.dtype)
        for j, ((x, gate, up, act), d_out) in enumerate(
                zip(saved, d_rows.split(counts), strict=True)):
            d_out = d_out.unsqueeze(0)
            torch.bmm(act.transpose(1, 2), d_out, out=grads[1][j:j + 1].transpose(1, 2))
            d_act = torch.bmm(d_out, down[j].unsqueeze(0))
            d_gate = torch.ops.aten.silu_backward(d_act * up, gate)
            d_up = d_act * torch.nn.functional.silu(gate)
            d_h = torch.cat([d_gate, d_up], dim=-1)
            torch.bmm(x.transpose(1, 2), d_h, out=grads[0][j:j + 1].transpose(1, 2))


Matrices = Callable[[range], tuple[torch.Tensor, torch.Tensor]]


def routed_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: int,
               read: Matrices, batch: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kept routed experts' weighted sum [T, H] fp32 on x under routing (weights, ids),
    products in `dtype`; `read(part)`: the (gate_up [E, 2I, H], down [E, H, I]) of kept
    experts `part`."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, experts, batch):
        part = range(start, min(start + batch, experts))
        pairs = Pairs.of(x, weights, ids, part, dtype)
        if pairs.depth:
            gate_up, down = read(part)
            out[pairs.tokens] += pairs.output(gate_up.float(), down.float())
    return out
