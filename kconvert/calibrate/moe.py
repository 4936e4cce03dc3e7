"""The MoE block of the calibration forward: transformers' router and shared expert, and the
routed experts as grouped matrix products in which each expert sees only its routed tokens
while the calibration statistics accumulate (per expert, over the same rows, without a host
sync).

Under torchrun the block is expert-parallel (kconvert.calibrate.expert_ranks): this rank holds
only its share of the routed experts, and the rows routed to another rank's experts go there
and come back as their expert outputs. Every expert's rows, statistics and outputs are then
computed exactly as in a one-process run (the same rows in the same order, the same batches in
the same order), so the statistics and the hidden states the next layer sees are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from kconvert.calibrate import block_amax
from kconvert.calibrate.block_amax import BLOCK_AMAX_STAT
from kconvert.errors import KconvertError

# Rows per step of the per-expert activation statistics (fp32 temporaries of rows x width).
GROUP_STAT_ROWS = 1 << 15


def _accumulate_groups(rows: torch.Tensor, counts: torch.Tensor, amax: torch.Tensor,
                       sq: torch.Tensor, hist: torch.Tensor, offset: int = 0) -> None:
    """amax[g] <- max(amax[g], max|x|), sq[g] += sum over rows of x^2 and hist[g] += the
    rows' per-block amaxes (kconvert.calibrate.block_amax) for each group g of
    consecutive rows (counts[g] of them), GROUP_STAT_ROWS rows at a time (bounds the fp32
    temporaries). `rows` are rows offset.. of a batch's rows sorted by expert: the steps are
    cut at multiples of GROUP_STAT_ROWS of the whole batch's rows, so a group's sums are added
    in the same pieces whichever rank holds it (kconvert.calibrate.expert_ranks)."""
    ends = counts.cumsum(0) + offset
    starts = ends - counts
    stop_all = offset + rows.shape[0]
    for start in range(offset - offset % GROUP_STAT_ROWS, stop_all, GROUP_STAT_ROWS):
        lo, hi = max(start, offset), min(start + GROUP_STAT_ROWS, stop_all)
        # the rows of each group inside [lo, hi)
        lengths = ends.clamp(lo, hi) - starts.clamp(lo, hi)
        chunk = rows[lo - offset:hi - offset].float()
        row_max = torch.linalg.vector_norm(chunk, ord=math.inf, dim=-1)
        torch.maximum(amax, torch.segment_reduce(row_max, "max", lengths=lengths, initial=0),
                      out=amax)
        sq += torch.segment_reduce(chunk.square(), "sum", lengths=lengths).double()
        block_amax.add_grouped_rows(chunk, lengths, hist)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows x[ends[g-1]:ends[g]] times weight[g]^T for every group g at once ([rows, in] x
    [G, out, in] -> [rows, out]): torch's grouped GEMM (CUTLASS on Hopper in bf16; elsewhere
    torch's own loop over the groups)."""
    return nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=ends)


class ForwardContext:
    """Per-batch state shared by the hooks and the MoE block: which positions are real."""

    valid: torch.Tensor | None = None  # [b, s] bool, None when every position is real

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, ...] or [b, 1, s, ...] (MLA latents) as rows of real positions [n, in]."""
        if self.valid is None:
            return x.reshape(-1, x.shape[-1])
        b, s = self.valid.shape
        return x.reshape(b, s, -1)[self.valid]


@dataclass
class Experts:
    """A layer's routed experts decoded to the compute dtype, stacked like transformers': all of
    them, or under torchrun this rank's share, experts first..first + len - 1."""

    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor  # [E, H, I]
    names: list[dict[str, str]]  # every expert of the layer -> proj -> checkpoint module
    first: int = 0  # the layer's expert id of gate_up[0]

    @property
    def held(self) -> range:
        """The layer's expert ids whose weights are here."""
        return range(self.first, self.first + self.down.shape[0])

    def index(self, expert: int) -> int:
        """Where expert `expert` (the layer's id) lies in gate_up and down."""
        if expert not in self.held:
            raise KconvertError(f"expert {expert} is not among the experts held here "
                                f"({self.held.start}..{self.held.stop - 1})")
        return expert - self.first


class RoutedRows(NamedTuple):
    """Per expert of a layer, ascending: the captured rows (tokens) routed to it, and their
    slots among the captured top-k ids (token * top_k + choice: where its gate weight is)."""

    tokens: list[torch.Tensor]
    slots: list[torch.Tensor]


class Exchange(Protocol):
    """An expert-parallel layer's exchange (kconvert.calibrate.expert_ranks.ExpertRanks)."""

    def exchange(self, moe: MoEBlock, x: torch.Tensor, indices: torch.Tensor,
                 weights: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor
                 ) -> torch.Tensor: ...


class MoEBlock(nn.Module):
    """DeepseekV3MoE with our routed experts (grouped matrix products over each expert's
    tokens), which accumulate the REAP and activation statistics. `gate` and `shared_experts` are
    transformers' own modules (same names, so the checkpoint's tensors load into them). With
    `ranks` (torchrun), expert-parallel: `experts` holds this rank's share."""

    def __init__(self, cfg, ctx: ForwardContext, experts: Experts, device: torch.device,
                 ranks: Exchange | None = None):
        from transformers.activations import ACT2FN
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3MLP,
            DeepseekV3TopkRouter,
        )

        super().__init__()
        with torch.device("meta"):
            self.gate = DeepseekV3TopkRouter(cfg)
            self.shared_experts = DeepseekV3MLP(
                cfg, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.act_fn = ACT2FN[cfg.hidden_act]
        self.ctx, self.experts, self.ranks = ctx, experts, ranks
        n, inter, hidden = len(experts.names), experts.down.shape[2], experts.down.shape[1]
        self.n_experts, self.inter = n, inter
        # Statistics of every expert of the layer (under torchrun only this rank's experts'
        # entries are added to here; the others stay 0 until the sums over ranks).
        f64 = {"dtype": torch.float64, "device": device}
        self.count = torch.zeros(n, dtype=torch.int64, device=device)
        self.gate_sum = torch.zeros(n, **f64)
        self.reap_sum = torch.zeros(n, **f64)
        self.ean_sum = torch.zeros(n, **f64)
        self.ean_sq_sum = torch.zeros(n, **f64)
        self.amax_in = torch.zeros(n, dtype=torch.float32, device=device)
        self.amax_down = torch.zeros(n, dtype=torch.float32, device=device)
        self.sq_in = torch.zeros(n, hidden, **f64)
        self.sq_down = torch.zeros(n, inter, **f64)
        self.block_amax_in = block_amax.new_histogram(n, device=device)
        self.block_amax_down = block_amax.new_histogram(n, device=device)
        # With `capture`, the real rows of every batch's input and their top-k expert ids are
        # kept (SparseGPT builds each expert's Hessian from them); `captured()` joins them.
        # With `capture_rows` (the layer's real tokens, when known) they are written into one
        # buffer as they come, so joining them never holds two copies (GPU memory plan).
        # Expert-parallel, the rows kept are those routed to this rank's experts.
        self.capture = False
        self.capture_rows = 0
        self._filled = 0
        # Without `collect`, the block only computes its output (no REAP/activation sums).
        self.collect = True
        self._inputs: list[torch.Tensor] = []
        self._indices: list[torch.Tensor] = []
        self._routed_rows: RoutedRows | None = None
        # Set by `kconvert eval` on a W4A4 checkpoint: (linear 0 gate/up or 1 down, input rows,
        # each row's expert) -> the rows as the serving kernel quantizes them
        # (evaluate/activations.py).
        self.quantize_input: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None \
            = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, topk_weights, topk_indices = self.gate(x)
        if self.capture and self.ranks is None:
            real = self.ctx.valid.reshape(-1) if self.ctx.valid is not None else slice(None)
            self.keep(x[real], topk_indices[real])
        routed = self._routed(x, topk_indices, topk_weights)
        return routed.to(x.dtype).reshape(shape) + self.shared_experts(hidden_states)

    def idle(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """Expert-parallel: one step of the exchange with no batch of this rank's own (its
        batches ran out before the other ranks'), serving the rows the others send."""
        k = self.gate.top_k
        self.ctx.valid = None
        self._routed(torch.empty(0, hidden, dtype=dtype, device=device),
                     torch.empty(0, k, dtype=torch.long, device=device),
                     torch.empty(0, k, dtype=torch.float32, device=device))

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """Every routed expert on its tokens: the (token, slot) pairs sorted by expert once,
        each expert's rows one group of two grouped matrix products (`expert_outputs`; here, or
        expert-parallel on the ranks that hold the experts). No host sync on one process."""
        t, k = indices.shape
        slot = torch.arange(t * k, device=x.device)  # token * k + j: the j-th choice of a token
        exp, w = indices.reshape(-1), weights.reshape(-1).float()
        if self.ctx.valid is not None:  # padding is never routed, so never counted
            keep = self.ctx.valid.reshape(-1).repeat_interleave(k)
            slot, exp, w = slot[keep], exp[keep], w[keep]
        order = torch.argsort(exp, stable=True)
        slot, exp, w = slot[order], exp[order], w[order]
        counts = torch.bincount(exp, minlength=self.n_experts)
        if self.ranks is None:
            f = self.expert_outputs(x[slot // k], exp, w, counts)
        else:
            f = self.ranks.exchange(self, x, indices, weights, slot // k, counts)
        # Each (token, slot) written once, then a token's k slots summed in slot order: the
        # same sum whatever the expert order, and no atomic adds (deterministic on a GPU).
        slots = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
        slots[slot] = f.float() * w[:, None]
        return slots.view(t, k, x.shape[1]).sum(1)

    def expert_outputs(self, xs: torch.Tensor, exp: torch.Tensor, w: torch.Tensor,
                       counts: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """f_j(x) (expert outputs before gating, in the compute dtype) of rows xs routed to
        experts exp (sorted; counts: the rows of each of the layer's experts, all of them held
        here) with gate weights w, the statistics accumulated; `offset`: where xs starts among
        its batch's rows sorted by expert (`_accumulate_groups`)."""
        held = self.experts.held
        ends = counts[held.start:held.stop].cumsum(0).to(torch.int32)
        q = self.quantize_input
        gate, up = grouped_linear(xs if q is None else q(0, xs, exp), self.experts.gate_up,
                                  ends).chunk(2, dim=-1)
        a = self.act_fn(gate) * up
        # f_j(x): before gating
        f = grouped_linear(a if q is None else q(1, a, exp), self.experts.down, ends)
        if not self.collect:
            return f
        norms = torch.linalg.vector_norm(f, dim=-1, dtype=torch.float32)
        self.count += counts
        for acc, values in ((self.gate_sum, w), (self.reap_sum, w * norms),
                            (self.ean_sum, norms), (self.ean_sq_sum, norms.square())):
            acc += torch.segment_reduce(values.double(), "sum", lengths=counts)
        _accumulate_groups(xs, counts, self.amax_in, self.sq_in, self.block_amax_in, offset)
        _accumulate_groups(a, counts, self.amax_down, self.sq_down, self.block_amax_down,
                           offset)
        return f

    def keep(self, x: torch.Tensor, indices: torch.Tensor) -> None:
        """Keep real input rows and their top-k expert ids (`capture`)."""
        if not self.capture_rows:
            self._inputs.append(x)
            self._indices.append(indices)
            return
        if not self._inputs:
            self._inputs = [x.new_empty(self.capture_rows, x.shape[1])]
            self._indices = [indices.new_empty(self.capture_rows, indices.shape[1])]
        end = self._filled + x.shape[0]
        if end > self.capture_rows:
            raise KconvertError(f"the MoE layer saw more than the {self.capture_rows} real "
                                "tokens it was given")
        self._inputs[0][self._filled:end] = x
        self._indices[0][self._filled:end] = indices
        self._filled = end

    def captured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [tokens, hidden], top-k expert ids [tokens, k]) of every real token (under
        torchrun: of every real token routed to an expert of this rank)."""
        if self.capture_rows:
            return self._inputs[0][:self._filled], self._indices[0][:self._filled]
        if not self._inputs:
            k = self.gate.top_k
            return (self.experts.down.new_empty(0, self.experts.down.shape[1]),
                    torch.empty(0, k, dtype=torch.long, device=self.count.device))
        if len(self._inputs) > 1:  # joined once; later calls reuse the joined tensors
            self._inputs, self._indices = [torch.cat(self._inputs)], [torch.cat(self._indices)]
        return self._inputs[0], self._indices[0]

    def routed_rows(self) -> RoutedRows:
        """Each of the layer's experts' rows of `captured()`: the captured top-k ids sorted by
        expert once (stable, so tokens stay ascending within an expert, as a per-expert mask
        would select them) and split on the host's counts: one device sync per layer instead
        of one per expert. Made at the first call, once the layer's capture is done (the
        engine asks after the hand-over), and kept with the layer."""
        if self._routed_rows is None:
            _, idx = self.captured()
            flat = idx.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.n_experts).tolist()
            self._routed_rows = RoutedRows(list((order // idx.shape[1]).split(counts)),
                                           list(order.split(counts)))
        return self._routed_rows

    def routed_inputs(self, expert: int) -> torch.Tensor:
        """The inputs of gate/up [tokens, hidden] over the tokens routed to `expert`."""
        return self.captured()[0].index_select(0, self.routed_rows().tokens[expert])

    def expert_inputs(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs of gate/up, inputs of down) over the tokens routed to `expert`."""
        xe = self.routed_inputs(expert)
        gate, up = nn.functional.linear(
            xe, self.experts.gate_up[self.experts.index(expert)]).chunk(2, dim=-1)
        return xe, self.act_fn(gate) * up

    def results(self, layer: int) -> dict[str, torch.Tensor]:
        count = self.count.cpu()
        reap_sum = self.reap_sum.cpu()
        saliency = torch.where(count > 0, reap_sum / count.clamp(min=1), 0.0)
        base = f"layers.{layer}"
        out = {f"{base}.count": count, f"{base}.saliency": saliency,
               f"{base}.reap_sum": reap_sum, f"{base}.gate_sum": self.gate_sum.cpu(),
               f"{base}.ean_sum": self.ean_sum.cpu(), f"{base}.ean_sq_sum": self.ean_sq_sum.cpu()}
        amax_in, amax_down = self.amax_in.cpu(), self.amax_down.cpu()
        sq_in, sq_down = self.sq_in.float().cpu(), self.sq_down.float().cpu()
        hist_in, hist_down = self.block_amax_in.cpu(), self.block_amax_down.cpu()
        for e in range(self.n_experts):
            for proj, amax, sq, hist in (("gate_proj", amax_in, sq_in, hist_in),
                                         ("up_proj", amax_in, sq_in, hist_in),
                                         ("down_proj", amax_down, sq_down, hist_down)):
                key = f"layers.{layer}.experts.{e}.{proj}"
                out[f"{key}.input_amax"] = amax[e].clone()
                out[f"{key}.input_sq_sum"] = sq[e].clone()
                out[f"{key}.{BLOCK_AMAX_STAT}"] = hist[e].clone()
        return out
