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
the same run writes the same bytes. Under torchrun every rank trains a share of each batch
(kconvert.pruning.learned_team), and the bytes are one process's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kconvert.common import distributed
from kconvert.gpu.devices import Stopwatch
from kconvert.gpu.host_copies import HostCopies
from kconvert.io.checkpoint import Checkpoint
from kconvert.methods.expert_training import Adam, lr_factor
from kconvert.model.arch import arch_of
from kconvert.pruning import recode
from kconvert.pruning.compensate import mse
from kconvert.pruning.learned_pairs import Matrices, Pairs, routed_sum
from kconvert.pruning.learned_team import Team


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
    bf16 copy and gradient for the products (Pairs.gradients), and the previous batch's
    one-shot values and written parameters on their way to the host (KeptExperts.write; bf16,
    a bound for the encoded), and the activations of every fit token routed into the batch
    (at most every token, k times), their gradients and the batch's slot sums (fp32: a bound
    for bf16 products too)."""
    per_expert = (3 * 4 + 2 * 2 + 2 * 2) * 3 * hidden * inter
    rows = min(tokens * top_k, tokens * top_k * batch // max(keep, 1) * 4)
    return batch * per_expert + rows * (3 * hidden + 6 * inter) * 4 + tokens * hidden * 4 * 3


def learned_bytes(text: dict, tokens: int, keep: int) -> int:
    """`plan_bytes` at the default batch for a model's text config, over `tokens` fit tokens
    and `keep` kept experts per layer."""
    return plan_bytes(text["hidden_size"], text["moe_intermediate_size"],
                      text[arch_of(text).top_k_key], tokens, keep, LearnedSettings().batch)


@dataclass(frozen=True)
class Layer:
    """What every rank needs of a layer's training, sent by the lead (`Team.leads`) before its
    first batch, then its fit inputs, routing weights and ids: their sizes and dtypes, the
    kept experts' count and matrices' sizes, the settings. None sent instead ends the layer."""

    tokens: int
    hidden: int
    top_k: int
    inter: int
    experts: int
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # of x, the routing weights, the ids
    settings: LearnedSettings


def fit(pairs: Pairs, params: list[torch.Tensor] | None, residual: torch.Tensor | None,
        norm: torch.Tensor | None, layer: Layer, team: Team, dtype: torch.dtype,
        watch: Stopwatch, first: bool) -> list[torch.Tensor]:
    """Train one batch's experts (module docstring) from the lead's `params` (gate_up
    [E, 2I, H], down [E, H, I] fp32, trained in place in one process) on its `residual`
    [T_B, H] and `norm`, each rank its share (kconvert.pruning.learned_team); returns the
    batch's trained matrices on every rank. `first`: the layer's first batch on this
    process, whose first step is charged apart (where the update compiles)."""
    n, dev, s = len(pairs.counts), pairs.x.device, layer.settings
    shapes = ((n, 2 * layer.inter, layer.hidden), (n, layer.hidden, layer.inter))
    mine = team.share(n)
    residual = team.send(residual, (len(pairs.tokens), layer.hidden), torch.float32, dev)
    norm = team.send(norm, (), torch.float32, dev)
    starts = [team.send(p, shape, torch.float32, dev)
              for p, shape in zip(params or [None, None], shapes, strict=True)]
    # each expert's RMS taken over the whole batch on every rank: a GPU's reduction over a
    # share of the experts may add in another order, and the bytes would depend on the ranks
    scales = [team.own(p.square().mean((-1, -2), keepdim=True).sqrt().clamp(min=1e-12), mine)
              for p in starts]
    params = [team.own(p, mine) for p in starts]
    del starts
    grads = tuple(torch.empty_like(p, dtype=dtype) for p in params)
    opt = Adam(params, scales)
    steps = range(s.steps)
    for name, some in ((("learned first step", steps[:1]), ("learned steps", steps[1:]))
                       if first else (("learned steps", steps),)):
        with watch.phase(name):
            for step in some:
                gate_up, down = (p.to(dtype) for p in params)
                pairs.gradients(gate_up, down, residual, norm, grads, mine,
                                lambda rows: team.rows(rows, pairs.counts))
                opt.apply(grads, s.lr * lr_factor(step, s.steps))
    return [team.experts(p, n) for p in params]


def batches(layer: Layer) -> list[range]:
    """The layer's batches of kept experts, ascending."""
    step = layer.settings.batch
    return [range(a, min(a + step, layer.experts)) for a in range(0, layer.experts, step)]


def train(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, goal: torch.Tensor,
          experts: int, read: Matrices,
          write: Callable[[range, torch.Tensor, torch.Tensor], None],
          settings: LearnedSettings, watch: Stopwatch | None = None,
          team: Team | None = None) -> None:
    """Train the `experts` kept experts so that their weighted sum under routing (weights,
    ids) [T, k] on fit inputs x [T, H] approaches `goal` [T, H] fp32 (module docstring): each
    batch starts from `read(part)` and its result goes to `write(part, gate_up, down)` (fp32),
    after which `read` gives what was written (the next batches' residual is of those). On
    the lead rank of a `team`, the other ranks follow (`follow`). `watch` is charged per
    phase: the batches' set-up, the first step (where the update compiles on a GPU), the
    other steps, and the writes."""
    watch, team = watch or Stopwatch(x.device), team or Team()
    dtype = settings.dtype(x.device)
    inter = read(range(0, 1))[1].shape[-1]
    layer = Layer(x.shape[0], x.shape[1], ids.shape[1], inter, experts,
                  (x.dtype, weights.dtype, ids.dtype), settings)
    with torch.no_grad():
        with watch.phase("learned setup"):
            current = routed_sum(x, weights, ids, experts, read, settings.batch, dtype)
            if team.world > 1:
                distributed.broadcast_object(layer)
                for t in (x, weights, ids):
                    distributed.broadcast_(t.contiguous())
        first = True
        for part in batches(layer):
            with watch.phase("learned setup"):
                pairs = Pairs.of(x, weights, ids, part, dtype)
                if not pairs.depth:
                    continue
                params = [t.float().clone() for t in read(part)]
                before = pairs.output(*params)
                residual = goal[pairs.tokens] - current[pairs.tokens] + before
                norm = residual.square().sum().clamp(min=1e-30)
            params = fit(pairs, params, residual, norm, layer, team, dtype, watch, first)
            first = False
            with watch.phase("learned write"):
                write(part, params[0], params[1])
                current[pairs.tokens] += pairs.output(*(t.float() for t in read(part))) - before


def follow(team: Team, device: torch.device) -> None:
    """A rank other than the lead's, while the lead's repair stream works on a layer: train
    this rank's share of each batch of every `train` the lead runs, until the lead ends the
    layer (kconvert.pruning.repair)."""
    watch = Stopwatch(device)
    with torch.no_grad():
        while (layer := distributed.broadcast_object(None)) is not None:
            dtype = layer.settings.dtype(device)
            x, weights, ids = (distributed.broadcast_(torch.empty(
                layer.tokens, width, dtype=d, device=device)) for width, d in zip(
                (layer.hidden, layer.top_k, layer.top_k), layer.dtypes, strict=True))
            first = True
            for part in batches(layer):
                pairs = Pairs.of(x, weights, ids, part, dtype)
                if pairs.depth:
                    fit(pairs, None, None, None, layer, team, dtype, watch, first)
                    first = False


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
    batch written in the source's format (recode) and decoded back into the block. The
    written parameters and the one-shot values they replace go to the host behind the next
    batch's training (HostCopies); the one-shot values stay there until the guard has judged
    (`restore`). `watch` is charged for the writes' parts. A context manager: leaving it ends
    the copying thread."""

    def __init__(self, ckpt: Checkpoint, moe, keep: list[int],
                 linears: dict[str, list[recode.SourceLinear]], rule: str | None,
                 device: torch.device, watch: Stopwatch):
        self.ckpt, self.moe, self.keep, self.rule, self.device = ckpt, moe, keep, rule, device
        self.linears = linears  # proj -> the kept experts' source linears, in keep order
        self.watch = watch
        self.copies = HostCopies(device)
        self.params: dict[str, torch.Tensor] = {}  # output name -> written parameter
        self.saved: dict[tuple[int, str], torch.Tensor] = {}  # (i, matrix) -> one-shot values

    def __enter__(self) -> KeptExperts:
        return self

    def __exit__(self, *exc) -> None:
        self.copies.__exit__(*exc)

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
        experts = self.moe.experts
        with self.watch.phase("learned write waits for the host"):
            self.copies.wait()  # the previous batch's copies are made: one batch in flight
        written, decoded = {}, {}
        for proj, w in matrices.items():
            lins = [self.linears[proj][i] for i in part]
            with self.watch.phase("learned write encode"):
                encoded = recode.encode(self.ckpt, lins, lambda j, w=w: w[j], self.rule,
                                        self.device, amax[proj])
            for i, lin, params in zip(part, lins, encoded, strict=True):
                for param, t in params.items():
                    written[recode.output_name(f"{lin.module}.{param}", i)] = t
            with self.watch.phase("learned write decode"):
                into = experts.down if proj == "down_proj" else experts.gate_up
                decoded[proj] = recode.decode_all(lins, encoded, self.device).to(into.dtype)
        ids = [self.keep[i] for i in part]
        before = self.read(part)  # copies, not the block's storage
        self.copies.submit(written, self.params)
        self.copies.submit({(i, matrix): t[n] for n, i in enumerate(part)
                            for matrix, t in zip(("gate_up", "down"), before, strict=True)},
                           self.saved)
        experts.gate_up[ids] = torch.cat([decoded["gate_proj"], decoded["up_proj"]], 1)
        experts.down[ids] = decoded["down_proj"]

    def written(self) -> dict[str, torch.Tensor]:
        """The written parameters by output name, on the host."""
        self.copies.wait()
        return self.params

    def restore(self) -> None:
        """Put the one-shot values back (the guard refused the learned ones)."""
        self.copies.wait()
        for (i, matrix), values in self.saved.items():
            getattr(self.moe.experts, matrix)[self.keep[i]].copy_(values)


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
          settings, watch, Team.here())
    with torch.no_grad(), watch.phase("learned errors"):
        fit_after, held_after = errors()
    if held_after < held_before:
        return Outcome(fit_before, fit_after, held_before, held_after, kept.written())
    with watch.phase("learned restore"):
        kept.restore()
    return Outcome(fit_before, fit_after, held_before, held_after, {})
