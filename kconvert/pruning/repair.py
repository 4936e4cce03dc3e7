"""REAP router repair: re-fit each pruned MoE layer's router so that the pruned block computes
what the unpruned block computed on the same input (reap.md, "Router repair").

It runs inside calibration's layer-streamed pass (`calibrate(..., on_weights=repair)`): beside
the source stream that scores the experts, `RouterRepair` carries a second stream of the first
calibration sequences through the pruned-and-repaired model. At MoE layer L, with layer L's
weights loaded and its statistics taken, it
1. chooses the kept experts exactly as the plan will (same scores, same rule);
2. runs layer L's attention on its own stream and captures the MoE inputs x;
3. takes the target from the unpruned block on those x (transformers' router, all experts);
4. fits the kept experts' router on the first sequences (`fit`), with Kimi's routing: sigmoid
   scores, bias for selection only, weights renormalised over the selected experts times
   routed_scaling_factor. `bias` fits e_score_correction_bias, `router` the gate rows too.
   The fit is full-batch Adam; the selection is hard in the forward pass and differentiable in
   the backward pass through a sigmoid around the top-k threshold (straight-through), each
   token choosing among its `candidates` best kept experts under the source rows, whose outputs
   are computed once;
5. keeps the fitted rows only when the block's error on the held-out sequences falls (errors
   measured with transformers' router over all kept experts and the rows as written: gate rows
   rounded to the source dtype, bias F32);
6. moves its stream on through the pruned block with the rows written.
Expert weights are never changed by the repair (compensation re-fits them, in the same pass:
kconvert.pruning.compensate_layer). The shared expert is the same in both blocks, so the
block output error is the routed part's error. The fit itself: kconvert.pruning.router_fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.forward import embed, model_config, padding_aware_mask
from kconvert.calibrate.moe import MoEBlock
from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.gpu.devices import Stopwatch, deterministic
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name
from kconvert.pruning import recode
from kconvert.pruning.compensate import mse
from kconvert.pruning.compensate_layer import Compensator
from kconvert.pruning.compensate_learned import follow
from kconvert.pruning.learned_team import Team
from kconvert.pruning.plan import (
    LayerCompensation,
    LayerRepair,
    PrunePlan,
)
from kconvert.pruning.reap import keep_ids, row_hashes, statistic, with_means
from kconvert.pruning.router_fit import (
    REPAIR_TOKENS,
    Candidates,
    RepairSettings,
    fit,
    pruned_router,
    routed_output,
)

log = logging.getLogger(__name__)

def stream_bytes(hidden: int, dtype_bytes: int, tokens: int) -> int:
    """Device bytes of the repair stream over `tokens` calibration tokens, at most
    REPAIR_TOKENS (the GPU memory plan's term, kconvert.gpu.parts.Forward.repair_bytes)."""
    return min(REPAIR_TOKENS, tokens) * hidden * (dtype_bytes + 4 * 4)


class _CaptureInput(nn.Module):
    """Stands in for the MoE block: records its real input rows, adds nothing."""

    def __init__(self):
        super().__init__()
        self.valid: torch.Tensor | None = None
        self.inputs: list[torch.Tensor] = []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.inputs.append(hidden_states[self.valid])
        return torch.zeros_like(hidden_states)


@dataclass
class RouterRepair:
    """The pruned-and-repaired stream beside calibration (module docstring); the hook
    `calibrate(..., on_weights=repair)` calls per decoder layer."""

    ckpt: Checkpoint
    input_ids: torch.Tensor  # the calibration sequences, as calibrate gets them
    settings: RepairSettings
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    batch_size: int = 8
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kept: dict[int, list[int]] = field(default_factory=dict)
    records: dict[int, LayerRepair] = field(default_factory=dict)
    compensations: dict[int, LayerCompensation] = field(default_factory=dict)
    matrices: dict[str, torch.Tensor] = field(default_factory=dict)  # output name -> written
    # per layer, seconds per phase of its repair (kconvert.gpu.devices.Stopwatch; -v logs them)
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)
    # Where each layer's re-fitted matrices go (one file per layer, memory-mapped back), so
    # host memory does not grow with the layers; None: held in memory.
    spill: Path | None = None

    def __post_init__(self):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3RotaryEmbedding,
        )

        s = self.settings
        if not s.repair.fits and not s.compensation.refits:
            raise KconvertError("neither router repair nor compensation asked")
        n_seq, seq_len = self.input_ids.shape
        n = min(n_seq, max(2, self.settings.max_tokens // seq_len))
        if n < 2:
            asked = [what for what, on in (("router repair", s.repair.fits), (
                f"{s.compensate} compensation", s.compensation.refits)) if on]
            raise KconvertError(f"{' and '.join(asked)}: at least 2 calibration sequences (fit "
                                "and held-out) are needed; give data for --samples 2 or more")
        self.n_fit = n - max(1, round(n * self.settings.heldout))
        ids = self.input_ids[:n]
        self.valid = (ids != PAD_ID).to(self.device)
        self.hidden = embed(self.ckpt, ids, self.dtype, self.device)
        self.cfg = model_config(self.ckpt)
        positions = torch.arange(seq_len, device=self.device).unsqueeze(0)
        rotary = DeepseekV3RotaryEmbedding(self.cfg).to(self.device)
        self.forward_kw = {"position_ids": positions, "position_embeddings": rotary(
            torch.empty(0, device=self.device, dtype=self.dtype), positions)}
        self.source_routers = {}
        for name, info in self.ckpt.tensors.items():
            tn = parse_name(name)
            if tn.role is Role.ROUTER_WEIGHT and tn.param != "weight":
                raise KconvertError("router repair re-fits a plain float router; this one is "
                                    "quantized (MXFP4): dequantize it first", tensor=name)
            if tn.role in (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS):
                self.source_routers.setdefault(tn.layer, {})[tn.role] = info
        # checked before the first layer: a format compensation cannot write fails at once
        self.compensator = Compensator(self.ckpt, s.compensation, s.ridges, s.sweeps,
                                       s.learned)

    def _run(self, module: nn.Module, capture: _CaptureInput | None = None) -> None:
        """Decoder layer `module` over the stream, in place."""
        for start in range(0, self.hidden.shape[0], self.batch_size):
            rows = slice(start, start + self.batch_size)
            v = self.valid[rows]
            if capture is not None:
                capture.valid = v
            all_valid = bool(v.all())
            self.hidden[rows] = module(self.hidden[rows],
                                       attention_mask=padding_aware_mask(v, all_valid),
                                       **self.forward_kw)

    def __call__(self, layer: int, module: nn.Module) -> None:
        """Layer `layer`'s repair on the lead rank (or the one process); on the other ranks of
        a torchrun, their share of its learned compensation (kconvert.pruning.learned_team)
        until the lead ends the layer."""
        team = Team.here()
        trains = team.world > 1 and self.settings.compensation.trains
        if not team.leads:
            if trains:
                follow(team, self.device)
            return
        try:
            self._stream(layer, module)
        finally:
            if trains:  # the followers go on to the next layer
                distributed.broadcast_object(None)

    def _stream(self, layer: int, module: nn.Module) -> None:
        """The stream through decoder layer `layer` (`module`), its MoE block repaired."""
        with torch.no_grad():
            moe = module.mlp
            if not isinstance(moe, MoEBlock):
                self._run(module)
                return
            capture = _CaptureInput()
            module.mlp = capture
            try:
                self._run(module, capture)  # the stream is now residual + attention
            finally:
                module.mlp = moe
            x = torch.cat(capture.inputs)
            out = self._repair(layer, moe, x)
            self.hidden[self.valid] += out.to(self.dtype)

    def _repair(self, layer: int, moe: MoEBlock, x: torch.Tensor) -> torch.Tensor:
        """Fit layer `layer`'s kept router rows on inputs x [T, hidden]; record them; return
        the pruned block's output with the rows written."""
        s = self.settings
        scores = with_means({name.rsplit(".", 1)[1]: t.double()
                             for name, t in moe.results(layer).items() if name.count(".") == 2})
        keep = self.kept[layer] = keep_ids(scores[statistic(s.criterion)], s.keep)
        kept = torch.tensor(keep, device=x.device)
        infos = self.source_routers.get(layer, {})
        if set(infos) != {Role.ROUTER_WEIGHT, Role.ROUTER_BIAS}:
            raise KconvertError(f"layer {layer}: router repair needs the gate weight and "
                                "e_score_correction_bias", tensor=f"layers.{layer}.mlp.gate")
        w_info, b_info = infos[Role.ROUTER_WEIGHT], infos[Role.ROUTER_BIAS]
        w_src = self.ckpt.reader_for(w_info).read(w_info).to(x.device)[kept]
        b_src = self.ckpt.reader_for(b_info).read(b_info).to(x.device).float()[kept]
        if b_info.dtype != "F32":
            raise KconvertError(f"e_score_correction_bias is {b_info.dtype}; repair writes F32",
                                tensor=b_info.name)

        watch = Stopwatch(x.device)
        with watch.phase("target"):
            target = routed_output(moe, moe.gate, x)
        n_fit = int(self.valid[:self.n_fit].sum())
        w_out, b_out = w_src, b_src
        if s.repair.fits:
            w_out, b_out = self._fit_router(layer, moe, x, target, n_fit, kept, w_src, b_src,
                                            watch)
            self.rows[layer] = (w_out.cpu(), b_out.float().cpu())
        written = pruned_router(self.cfg, w_out.float(), b_out)
        if self.compensator.kind.refits:
            with watch.phase("compensation setup"):
                shared = moe.shared_experts(x).float()
            record, kept_tensors = self.compensator.layer(
                layer, self.kept[layer], moe, x, target + shared, n_fit, written, watch)
            self.compensations[layer] = record
            self.matrices.update(recode.spilled(self.spill, layer, kept_tensors)
                                 if kept_tensors else {})
        with watch.phase("output"):
            out = routed_output(moe, written, x, kept) + moe.shared_experts(x).float()
        self.seconds[layer] = watch.seconds
        log.info("layer %d repair: %s", layer,
                 ", ".join(f"{k} {v:.2f} s" for k, v in watch.seconds.items()))
        return out

    def _fit_router(self, layer: int, moe: MoEBlock, x: torch.Tensor, target: torch.Tensor,
                    n_fit: int, kept: torch.Tensor, w_src: torch.Tensor, b_src: torch.Tensor,
                    watch: Stopwatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The router rows to write (fitted, or the source's when the guard refuses them)."""
        s = self.settings
        with watch.phase("router guard"):
            before = pruned_router(self.cfg, w_src.float(), b_src)
            pruned = routed_output(moe, before, x, kept)
            fit_before, held_before = (mse(pruned[:n_fit], target[:n_fit]),
                                       mse(pruned[n_fit:], target[n_fit:]))
        xs = x[:n_fit]
        with watch.phase("router candidates"):
            c = min(s.keep, s.candidates * self.cfg.num_experts_per_tok)
            choice = (xs.float() @ w_src.float().T).sigmoid() + b_src
            cand = Candidates.measure(moe, xs, target[:n_fit], choice.topk(c, dim=-1).indices,
                                      kept)
        with watch.phase("router fit"), torch.enable_grad(), deterministic():
            w_fit, b_fit = fit(xs, w_src.float(), b_src, cand, self.cfg, s)
        with watch.phase("router guard"):
            w_new = w_fit.to(w_src.dtype) if s.repair.tunes_gate else w_src
            after = pruned_router(self.cfg, w_new.float(), b_fit)
            repaired = routed_output(moe, after, x, kept)
            fit_after, held_after = (mse(repaired[:n_fit], target[:n_fit]),
                                     mse(repaired[n_fit:], target[n_fit:]))
        applied = held_after < held_before
        w_out, b_out = (w_new, b_fit) if applied else (w_src, b_src)
        self.records[layer] = LayerRepair(
            method=s.method, applied=applied, fit_tokens=n_fit,
            heldout_tokens=x.shape[0] - n_fit,
            fit_mse_before=fit_before, fit_mse_after=fit_after, heldout_mse_before=held_before,
            heldout_mse_after=held_after, gate_rows_xxh3=row_hashes(w_out.cpu()),
            bias=b_out.float().cpu().tolist())
        return w_out, b_out

def with_repair(plan: PrunePlan, repair: RouterRepair) -> PrunePlan:
    """The plan with each layer's repair and compensation records; refuses a plan whose kept
    experts differ from those the repair chose."""
    layers = {}
    s = repair.settings
    stream_skips = arch_of(repair.ckpt.text_config).mtp_layers
    for key, entry in plan.layers.items():
        if int(key) in stream_skips:  # the repair stream runs the decoder layers (docs/mtp.md)
            layers[key] = entry
            continue
        if int(key) not in repair.kept:
            raise KconvertError(f"layer {key} of the plan was not repaired")
        if entry.keep != repair.kept[int(key)]:
            raise KconvertError(f"layer {key}: the plan keeps other experts than the repair")
        layers[key] = entry.model_copy(update={"repair": repair.records.get(int(key)),
                                               "compensation": repair.compensations.get(int(key))})
    update = {"layers": layers}
    if s.repair.fits:
        update["repair"] = s.method
    if s.compensation.refits:
        update["compensation"] = s.compensate
    return plan.model_copy(update=update)
