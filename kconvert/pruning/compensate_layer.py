"""One pruned layer's compensation in the repair stream (kconvert.pruning.repair): what its
kind (kconvert.pruning.kinds.CompensationKind) re-fits, by least squares at each ridge with the
lowest held-out error kept (kconvert.pruning.compensate), encoded in the source's format and
kept only where its guard passes it; then, for a kind that `trains`, the kept experts trained
from there (kconvert.pruning.compensate_learned)."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from kconvert.calibrate.moe import MoEBlock
from kconvert.errors import KconvertError
from kconvert.gpu.devices import Stopwatch
from kconvert.io.checkpoint import Checkpoint
from kconvert.pruning import recode
from kconvert.pruning.compensate import Judged, Refit, Routing, block
from kconvert.pruning.compensate_learned import KeptExperts, LearnedSettings, Outcome, learn
from kconvert.pruning.kinds import CompensationKind
from kconvert.pruning.plan import LayerCompensation, LearnedCompensation
from kconvert.pruning.reap import tensor_hash
from kconvert.pruning.router_fit import route


class Compensator:
    """Compensation of kind `kind` for each pruned layer of one checkpoint: the source linears
    it may re-fit and the block-scale rule of the quantized ones are found at once (a format
    it cannot write fails before the first layer)."""

    def __init__(self, ckpt: Checkpoint, kind: type[CompensationKind],
                 ridges: tuple[float, ...], sweeps: int, learned: LearnedSettings) -> None:
        self.ckpt, self.kind, self.ridges, self.sweeps = ckpt, kind, ridges, sweeps
        self.learned = learned
        self.linears = {proj: recode.expert_linears(ckpt, proj) for proj in kind.projs()}
        self.block_scale = recode.block_scale_rule(ckpt) if any(
            lin.codec.quantized for by_layer in self.linears.values()
            for layer in by_layer.values() for lin in layer.values()) else None

    def layer(self, layer: int, keep: list[int], moe: MoEBlock, x: torch.Tensor,
              target: torch.Tensor, n_fit: int, router: nn.Module, watch: Stopwatch
              ) -> tuple[LayerCompensation, dict[str, torch.Tensor]]:
        """Re-fit the layer's down_proj matrices (kconvert.pruning.compensate) on the fit
        tokens at each ridge, take the ridge with the lowest held-out error (Refit.best), and
        encode its matrices in the source's format; when the guard passes them (Judged.applied:
        their held-out error as written, decoded again, below the source matrices'), write
        them into `moe` (the stream moves on with what is written) and keep their encoded
        parameters for the output; a kind that `trains` then trains from there (`learn`).
        Returns the layer's record and the tensors to write, by output name."""
        sources = self.sources(layer, keep)
        w, ids = route(router, x)
        fitted_on, held_on = (Routing(w[part], ids[part]) for part in (slice(None, n_fit),
                                                                       slice(n_fit, None)))
        down = [moe.experts.down[e] for e in keep]
        shared_down = moe.shared_experts.down_proj.weight
        with watch.phase("compensation setup"):
            pieces = block(moe, keep, fitted_on, x[:n_fit], down, shared_down)
            held = block(moe, keep, held_on, x[n_fit:], down, shared_down)
        count = len(sources) if self.kind.kept_downs else 1
        n_held = x.shape[0] - n_fit
        fit_target, held_target = target[:n_fit], target[n_fit:]
        refit = Refit(pieces, fit_target, held, n_held, count, watch)
        ridge, offsets = refit.best(self.kind.ridges or self.ridges, self.sweeps, held_target)
        with watch.phase("compensation encode"):
            encoded = recode.encode(self.ckpt, sources[:count],
                                    functools.partial(refit.matrix, offsets), self.block_scale,
                                    x.device)
        del offsets, refit

        def written(b: int) -> torch.Tensor:
            return recode.decode(sources[b], encoded[b], x.device) if b < count \
                else pieces.weight(b)

        with watch.phase("compensation guard"):
            judged = Judged.of(pieces, held, written, fit_target, held_target)
        kept = {}
        if judged.applied:
            for i, (lin, params) in enumerate(zip(sources, encoded, strict=False)):
                for param, t in params.items():
                    kept[recode.output_name(f"{lin.module}.{param}", i - 1)] = t.cpu()
                into = shared_down if i == 0 else moe.experts.down[keep[i - 1]]
                into.copy_(written(i).to(into.dtype))
        learned = None
        if self.kind.trains:
            with watch.phase("learned compensation"):
                learned = self.learn(layer, keep, moe, x, target, n_fit, (w, ids), watch)
            kept.update(learned.tensors)
        ruled = any(lin.codec.uses_scale_rule for lin in sources[:count])
        return LayerCompensation(
            method=self.kind.declaration.name, applied=judged.applied, fit_tokens=n_fit,
            heldout_tokens=n_held, ridge=ridge,
            matrices_xxh3={name: tensor_hash(t) for name, t in sorted(kept.items())},
            block_scale=self.block_scale if ruled else None,
            learned=None if learned is None else LearnedCompensation(
                applied=learned.applied, steps=self.learned.steps, lr=self.learned.lr,
                batch=self.learned.batch, fit_mse_before=learned.fit_mse_before,
                fit_mse_after=learned.fit_mse_after,
                heldout_mse_before=learned.heldout_mse_before,
                heldout_mse_after=learned.heldout_mse_after),
            **dataclasses.asdict(judged)), kept

    def learn(self, layer: int, keep: list[int], moe: MoEBlock, x: torch.Tensor,
              target: torch.Tensor, n_fit: int, routing: tuple[torch.Tensor, torch.Tensor],
              watch: Stopwatch) -> Outcome:
        """Train the kept experts' gate, up and down against the unpruned block from what the
        closed form left in `moe` (kconvert.pruning.compensate_learned)."""
        linears = {proj: self.sources(layer, keep, proj)[1:] for proj in self.kind.projs()}
        goal = target - moe.shared_experts(x).float()  # the shared expert as written, fixed
        with KeptExperts(self.ckpt, moe, keep, linears, self.block_scale, x.device,
                         watch) as experts:
            return learn(experts, *routing, x, goal, n_fit, self.learned, watch)

    def sources(self, layer: int, keep: list[int], proj: str = "down_proj"
                ) -> list[recode.SourceLinear]:
        """The source linears `proj` of the shared expert and the kept experts, the shared
        expert's first."""
        linears = self.linears[proj].get(layer, {})
        missing = [e for e in (None, *keep) if e not in linears]
        if missing:
            raise KconvertError(f"layer {layer}: compensation needs the {proj} of every kept "
                                f"expert and of the shared expert; missing {missing}",
                                tensor=f"layers.{layer}.mlp")
        return [linears[e] for e in (None, *keep)]
