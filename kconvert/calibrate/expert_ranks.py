"""Expert-parallel MoE layers under torchrun (docs/many-gpus.md).

A MoE layer's routed experts are split among the ranks in contiguous blocks of expert ids,
balanced by the bytes of their tensors (`ExpertRanks.of_layer`; the same blocks on every rank,
from the checkpoint's headers alone): each rank reads, decodes and holds only its block.
Attention, router and shared expert stay data-parallel: each rank runs its own batches
(distributed.own_batches: batch b on rank b % N) through them.

The exchange (`ExpertRanks.exchange`), once per batch step, every rank together (a rank whose
batches ran out serves the others' rows with an empty step, MoEBlock.idle):
1. each rank sorts its batch's (token, slot) pairs by expert, as one process does; the pairs of
   a block of experts are then one contiguous run of that order. To each rank it sends the
   rows of the tokens with a pair in that rank's block (once per token, however many of its
   k experts are there), their top-k ids and gate weights, and where the run starts;
2. each rank, for each sender in rank order (= the batches' order in a one-process run),
   selects the pairs of its own experts, in the same order, and computes their expert outputs
   and statistics exactly as one process does for those experts (MoEBlock.expert_outputs:
   the same rows, the statistics' row steps cut at the same places of the whole batch);
3. the expert outputs (before gating, in the compute dtype) go back to the tokens' rank, which
   weights and sums each token's k slots in slot order, as one process does.
Every expert therefore sees the same rows, in the same batches, in the same order as in a
one-process run: its statistics are added in the same order (the sums over ranks then add
zeros: exact), the hidden states after the layer are the same, and so is every later layer.
What may differ is the grouped matrix product's own kernel choice, which can depend on the
total rows it is given (on a GPU; a CPU runs one product per expert): see the docs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import pairwise

import torch

from kconvert.calibrate.moe import Experts, MoEBlock
from kconvert.common import distributed
from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, parse_name

log = logging.getLogger(__name__)

# Real calibration tokens per rank below which an expert-parallel calibration is expected to be
# no faster than one process: each rank still starts up, reads the layers' non-expert tensors
# and runs the exchange's collectives per batch, which fewer tokens do not pay for. Measured at
# this point (docs/many-gpus.md): 2 ranks x 2^18 tokens on two H200s were 1.04x faster than one
# process, 4 ranks x 2^17 on four H200s 0.96x (slower) and 4 ranks x 2^19 1.14x.
MIN_TOKENS_PER_RANK = 1 << 18


def note_small_run(tokens: int, ranks: int) -> None:
    """Say (with -v) when `tokens` real calibration tokens over `ranks` ranks are likely to run
    no faster than one process."""
    if ranks > 1 and tokens < MIN_TOKENS_PER_RANK * ranks:
        log.info("%d calibration tokens over %d ranks is %d per rank, below the ~%d per rank "
                 "where expert-parallel calibration starts to pay (docs/many-gpus.md): one "
                 "process may be as fast", tokens, ranks, tokens // ranks, MIN_TOKENS_PER_RANK)


def blocks(sizes: list[int], ranks: int) -> list[range]:
    """Items 0..len(sizes)-1 in `ranks` contiguous blocks, balanced by `sizes`: block r ends
    where the running total comes nearest to (r + 1) / ranks of the whole."""
    total = sum(sizes)
    running = [0]
    for s in sizes:
        running.append(running[-1] + s)
    cuts = [0]
    for r in range(1, ranks):
        goal = total * r / ranks
        best = min(range(cuts[-1], len(sizes) + 1), key=lambda i: (abs(running[i] - goal), i))
        cuts.append(best)
    cuts.append(len(sizes))
    return [range(a, b) for a, b in pairwise(cuts)]


def model_ranks(layer_tensors: dict[int, dict[str, TensorInfo]], n_experts: int,
                moe_layers: Iterable[int]) -> dict[int, ExpertRanks]:
    """The blocks of every MoE layer (`layer_tensors`: each decoder layer's tensors, as
    calibrate.load.tensors_by_layer gives them): what the calibration reads and what a
    conversion beside it computes on each rank."""
    return {layer: ExpertRanks.of_layer(layer_tensors[layer], n_experts) for layer in moe_layers}


class ExpertRanks:
    """Every rank's block of a MoE layer's routed experts (in rank order, ascending ids) and
    the exchange of their rows (module docstring)."""

    def __init__(self, owned: list[range]):
        self.owned = owned
        self.mine = owned[distributed.rank()]

    @classmethod
    def of_layer(cls, tensors: dict[str, TensorInfo], n_experts: int) -> ExpertRanks:
        """The blocks of the layer whose tensors are `tensors` (its `n_experts` routed experts,
        balanced by the bytes of their tensors)."""
        sizes = [0] * n_experts
        for name, info in tensors.items():
            tn = parse_name(name)
            if tn.role is Role.ROUTED_EXPERT and tn.expert is not None and tn.expert < n_experts:
                sizes[tn.expert] += info.nbytes
        return cls(blocks(sizes, distributed.world()))

    def gather(self, experts: Experts) -> Experts | None:
        """Every rank's block of decoded experts joined on rank 0, as one process decodes them
        (REAP's repair runs there); None on the other ranks."""
        sizes = [len(block) for block in self.owned]
        main = distributed.is_main()

        def to_main(t: torch.Tensor) -> torch.Tensor:
            return distributed.all_to_all(t, [t.shape[0]] + [0] * (len(sizes) - 1),
                                          sizes if main else [0] * len(sizes))

        gate_up, down = to_main(experts.gate_up), to_main(experts.down)
        return Experts(gate_up, down, experts.names) if main else None

    def owner(self, expert: int) -> int:
        """The rank that holds expert `expert`."""
        return next(r for r, block in enumerate(self.owned) if expert in block)

    def exchange(self, moe: MoEBlock, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One step of the exchange for MoE block `moe` (kconvert.calibrate.moe.MoEBlock):
        this rank's batch x [t, hidden] with its router's top-k `indices` and `weights`
        [t, k], the token of each of its real (token, slot) pairs sorted by expert (`tokens`)
        and the pairs per expert (`counts`). Returns the expert outputs of those pairs, in
        their order, computed where the experts are."""
        k = indices.shape[1]
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        bounds = starts[[b.start for b in self.owned] + [self.owned[-1].stop]].tolist()
        rows, meta, sent = [], [], []
        for d in range(len(self.owned)):
            # the tokens with a pair in rank d's block, in token order
            u = torch.unique(tokens[bounds[d]:bounds[d + 1]])
            rows.append(x[u])
            meta.append(torch.cat([indices[u].reshape(-1).double(),
                                   weights[u].reshape(-1).double(),
                                   torch.tensor([bounds[d]], dtype=torch.float64,
                                                device=x.device)]))
            sent.append(u.numel())
        got = distributed.all_to_all_counts(sent)
        # meta: per token its k ids and k weights, then where the sender's run starts
        rows_in = distributed.all_to_all(torch.cat(rows), sent, got)
        meta_in = distributed.all_to_all(torch.cat(meta), [2 * k * n + 1 for n in sent],
                                         [2 * k * n + 1 for n in got])
        del rows, meta
        outs = []
        r = m = 0
        for n in got:  # the senders in rank order: their batches in a one-process run's order
            part = meta_in[m:m + 2 * k * n + 1]
            outs.append(self._serve(moe, rows_in[r:r + n], part[:k * n].long().reshape(n, k),
                                    part[k * n:2 * k * n].float(), int(part[-1])))
            r, m = r + n, m + 2 * k * n + 1
        return distributed.all_to_all(torch.cat(outs), [f.shape[0] for f in outs],
                                      [b - a for a, b in pairwise(bounds)])

    def _serve(self, moe: MoEBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               offset: int) -> torch.Tensor:
        """The expert outputs of one sender's pairs routed to this rank's experts: tokens x
        [n, hidden] with their top-k `ids` [n, k] and gate `weights` [n * k]; `offset`: where
        those pairs start among the sender's batch's pairs sorted by expert."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        mine = ((flat >= self.mine.start) & (flat < self.mine.stop)).nonzero().squeeze(1)
        exp = flat[mine]
        order = torch.argsort(exp, stable=True)
        mine, exp = mine[order], exp[order]
        if moe.capture and x.shape[0]:
            moe.keep(x, ids)
        if not mine.numel():
            return x.new_empty(0, x.shape[1])
        counts = torch.bincount(exp, minlength=moe.n_experts)
        return moe.expert_outputs(x[mine // k], exp, weights[mine], counts, offset)
