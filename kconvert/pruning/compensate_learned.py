"""Learned compensation of a pruned MoE block (reap.md, "Learned compensation").

The closed-form re-fit (kconvert.pruning.compensate) changes only the down_proj matrices, in
which the block is linear. `--compensate learned` starts from its result and trains every kept
expert's gate, up and down together against the unpruned block's output on the fit tokens,
with the router (repaired or not) and the shared expert fixed: the loss is the block's,
  sum_t |sum_j g'_tj f_j(x_t) - r_t|^2 / sum_t |r_t|^2,
where r is what the kept routed experts should add (the unpruned block's output less the
shared expert's). The experts' sum couples them, so they train in batches of `batch` kept
experts in ascending order, each batch on the residual the others leave (block coordinate
descent, as the closed form's Gauss-Seidel sweeps): a Kimi layer's 192 kept experts with Adam
state do not fit one GPU together (0.7 GB each in fp32).

A batch trains full-batch (every fit token routed to it, every step), Adam with each matrix's
step a fraction of its RMS (kconvert.methods.expert_training.Adam), cosine decay; the products
run per expert over its own rows, in bf16 on a GPU (fp32 masters, moments and loss) and in
fp32 on a CPU (LearnedSettings.dtype). The backward is autograd's written out
(Pairs.gradients): gradients land in one buffer per batch in the products' dtype and go
straight into the fused update, with no graph, no fp32 gradient and no per-expert slice's
backward (which wrote a batch-sized zero tensor per expert). There is no random draw, and
each token's sum over its slots in the batch is taken in a fixed order (no atomic adds), so
the same run writes the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kconvert.gpu.devices import Stopwatch
from kconvert.io.checkpoint import Checkpoint
from kconvert.methods.expert_training import Adam, expert_outputs, lr_factor
from kconvert.model.arch import arch_of
from kconvert.pruning import recode
from kconvert.pruning.compensate import mse


@dataclass(frozen=True)
class LearnedSettings:
    steps: int = 200  # Adam steps per batch of experts
    lr: float = 2e-3  # a step, as a fraction of each matrix's RMS
    batch: int = 16  # kept experts trained together
    bf16: bool | None = None  # products in bf16 (fp32 masters and loss); None: on a GPU

    def dtype(self, device: torch.device) -> torch.dtype:
        """The products' dtype on `device`."""
        on = device.type == "cuda" if self.bf16 is None else self.bf16
        return torch.bfloat16 if on else torch.float32


def plan_bytes(hidden: int, inter: int, top_k: int, tokens: int, keep: int, batch: int) -> int:
    """Device bytes of one batch's training (the GPU memory plan's term beside the repair
    stream): per expert its three matrices' fp32 masters and Adam moments (3 copies) and their
    bf16 copy and gradient for the products (Pairs.gradients), and the activations of every
    fit token routed into the batch (at most every token, k times), their gradients and the
    batch's slot sums (fp32: a bound for bf16 products too)."""
    per_expert = (3 * 4 + 2 * 2) * 3 * hidden * inter
    rows = min(tokens * top_k, tokens * top_k * batch // max(keep, 1) * 4)
    return batch * per_expert + rows * (3 * hidden + 6 * inter) * 4 + tokens * hidden * 4 * 3


def learned_bytes(text: dict, tokens: int, keep: int) -> int:
    """`plan_bytes` at the default batch for a model's text config, over `tokens` fit tokens
    and `keep` kept experts per layer."""
    return plan_bytes(text["hidden_size"], text["moe_intermediate_size"],
                      text[arch_of(text).top_k_key], tokens, keep, LearnedSettings().batch)


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
                  norm: torch.Tensor, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The gradients of |output(gate_up, down) - residual|^2 / norm in gate_up [E, 2I, H]
        and down [E, H, I] (the rows' dtype) into `grads` (same shapes and dtype): autograd's
        backward of `output`, op for op, written out so that no fp32 gradient of a whole
        batch's matrices, no per-expert slice of one and no graph is made (on a CPU in fp32 the
        same bits as autograd's: tests/pruning/test_compensate_learned.py)."""
        saved, outs = [], []
        for x, gu, dn in zip(self.x.split(self.counts), gate_up, down, strict=True):
            x = x.unsqueeze(0)
            gate, up = torch.bmm(x, gu.unsqueeze(0).transpose(1, 2)).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            outs.append(torch.bmm(act, dn.unsqueeze(0).transpose(1, 2))[0])
            saved.append((x, gate, up, act))
        # d loss / d token sum: 2 (sum - residual) / norm
        d_sum = (self.token_sums(torch.cat(outs)) - residual) * (2 / norm)
        d_rows = (d_sum[self.local] * self.gate.unsqueeze(-1)).to(self.x.dtype)
        for j, ((x, gate, up, act), d_out) in enumerate(
                zip(saved, d_rows.split(self.counts), strict=True)):
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


def train(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, goal: torch.Tensor,
          experts: int, read: Matrices,
          write: Callable[[range, torch.Tensor, torch.Tensor], None],
          settings: LearnedSettings, watch: Stopwatch | None = None) -> None:
    """Train the `experts` kept experts so that their weighted sum under routing (weights,
    ids) [T, k] on fit inputs x [T, H] approaches `goal` [T, H] fp32 (module docstring): each
    batch starts from `read(part)` and its result goes to `write(part, gate_up, down)` (fp32),
    after which `read` gives what was written (the next batches' residual is of those).
    `watch` is charged per phase: the batches' set-up, the first step (where the update
    compiles on a GPU), the other steps, and the writes."""
    watch = watch or Stopwatch(x.device)
    dtype = settings.dtype(x.device)
    first = True
    with torch.no_grad():
        with watch.phase("learned setup"):
            current = routed_sum(x, weights, ids, experts, read, settings.batch, dtype)
        for start in range(0, experts, settings.batch):
            part = range(start, min(start + settings.batch, experts))
            with watch.phase("learned setup"):
                pairs = Pairs.of(x, weights, ids, part, dtype)
                if not pairs.depth:
                    continue
                params = [t.float().clone() for t in read(part)]
                before = pairs.output(*params)
                residual = goal[pairs.tokens] - current[pairs.tokens] + before
                norm = residual.square().sum().clamp(min=1e-30)
                scales = [p.square().mean((-1, -2), keepdim=True).sqrt().clamp(min=1e-12)
                          for p in params]
                grads = tuple(torch.empty_like(p, dtype=dtype) for p in params)
                opt = Adam(params, scales)
            steps = range(settings.steps)
            for name, some in ((("learned first step", steps[:1]), ("learned steps", steps[1:]))
                               if first else (("learned steps", steps),)):
                with watch.phase(name):
                    for step in some:
                        gate_up, down = (p.to(dtype) for p in params)
                        pairs.gradients(gate_up, down, residual, norm, grads)
                        opt.apply(grads, settings.lr * lr_factor(step, settings.steps))
            first = False
            with watch.phase("learned write"):
                write(part, params[0], params[1])
                current[pairs.tokens] += pairs.output(*(t.float() for t in read(part))) - before


@dataclass(frozen=True)
class Outcome:
    """A layer's learned compensation judged: the block's mean squared errors against the
    unpruned block with the one-shot matrices (before) and the learned ones as written (after),
    on the fit and held-out tokens, and the written parameters (output name -> tensor, on the
    host) where the guard took them."""

    fit_mse_before: float
    fit_mse_after: float
    heldout_mse_before: float
    heldout_mse_after: float
    tensors: dict[str, torch.Tensor]

    @property
    def applied(self) -> bool:
        return self.heldout_mse_after < self.heldout_mse_before


class KeptExperts:
    """The kept experts of a MoE layer as the repair stream's block holds them, and a trained
    batch written in the source's format (recode) and decoded back into the block; the
    one-shot values stay on the host until the guard has judged (`restore`)."""

    def __init__(self, ckpt: Checkpoint, moe, keep: list[int],
                 linears: dict[str, list[recode.SourceLinear]], rule: str | None,
                 device: torch.device):
        self.ckpt, self.moe, self.keep, self.rule, self.device = ckpt, moe, keep, rule, device
        self.linears = linears  # proj -> the kept experts' source linears, in keep order
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.params: dict[str, torch.Tensor] = {}

    def read(self, part: range) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [self.keep[i] for i in part]
        return self.moe.experts.gate_up[ids], self.moe.experts.down[ids]

    def write(self, part: range, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        inter = down.shape[-1]
        matrices = {"gate_proj": gate_up[:, :inter], "up_proj": gate_up[:, inter:],
                    "down_proj": down}
        # gate and up are one fused set: their per-tensor scales are made for the larger amax
        fused = gate_up.abs().amax((-1, -2))
        amax = {"gate_proj": fused, "up_proj": fused, "down_proj": None}
        written = {}
        for proj, w in matrices.items():
            lins = [self.linears[proj][i] for i in part]
            encoded = recode.encode(self.ckpt, lins, lambda j, w=w: w[j], self.rule,
                                    self.device, amax[proj])
            for n, (i, lin, params) in enumerate(zip(part, lins, encoded, strict=True)):
                for param, t in params.items():
                    self.params[recode.output_name(f"{lin.module}.{param}", i)] = t.cpu()
                written[proj, n] = recode.decode(lin, params, self.device)
        experts = self.moe.experts
        for n, i in enumerate(part):
            e = self.keep[i]
            # copies (on a CPU, .cpu() would be the block's own storage)
            self.saved.setdefault(i, (experts.gate_up[e].to("cpu", copy=True),
                                      experts.down[e].to("cpu", copy=True)))
            experts.gate_up[e].copy_(torch.cat([written["gate_proj", n], written["up_proj", n]])
                                     .to(experts.gate_up.dtype))
            experts.down[e].copy_(written["down_proj", n].to(experts.down.dtype))

    def restore(self) -> None:
        """Put the one-shot values back (the guard refused the learned ones)."""
        for i, (gate_up, down) in self.saved.items():
            e = self.keep[i]
            self.moe.experts.gate_up[e].copy_(gate_up)
            self.moe.experts.down[e].copy_(down)


def learn(kept: KeptExperts, weights: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
          goal: torch.Tensor, n_fit: int, settings: LearnedSettings, watch: Stopwatch
          ) -> Outcome:
    """Train the kept experts on the first n_fit tokens of x [T, H] (routing (weights, ids)
    [T, k]; `goal` [T, H]: what the routed experts should add) and judge them on the others:
    the learned matrices stay in the block only where the held-out error falls."""
    fit, held = slice(None, n_fit), slice(n_fit, None)

    def errors() -> tuple[float, float]:
        out = routed_sum(x, weights, ids, len(kept.keep), kept.read, settings.batch)
        return mse(out[fit], goal[fit]), mse(out[held], goal[held])

    with torch.no_grad(), watch.phase("learned errors"):
        fit_before, held_before = errors()
    train(x[fit], weights[fit], ids[fit], goal[fit], len(kept.keep), kept.read, kept.write,
          settings, watch)
    with torch.no_grad(), watch.phase("learned errors"):
        fit_after, held_after = errors()
    if held_after < held_before:
        return Outcome(fit_before, fit_after, held_before, held_after, kept.params)
    kept.restore()
    return Outcome(fit_before, fit_after, held_before, held_after, {})
