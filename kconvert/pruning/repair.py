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
Expert weights are never changed. The shared expert is the same in both blocks, so the block
output error is the routed part's error.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.forward import embed, model_config, padding_aware_mask
from kconvert.calibrate.moe import MoEBlock
from kconvert.devices import Stopwatch, deterministic
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.names import Role, parse_name
from kconvert.options import COMPENSATIONS, REPAIRS
from kconvert.pruning import recode
from kconvert.pruning.compensate import Judged, Refit, Routing, block, mse
from kconvert.pruning.compensate_learned import (
    KeptExperts,
    LearnedSettings,
    Outcome,
    learn,
)
from kconvert.pruning.plan import (
    COMPENSATION_KINDS,
    LayerCompensation,
    LayerRepair,
    LearnedCompensation,
    PrunePlan,
)
from kconvert.pruning.reap import CRITERIA, keep_ids, row_hashes, tensor_hash, with_means

log = logging.getLogger(__name__)

# Calibration tokens the repair stream carries by default, as whole sequences (bounds its
# memory: hidden states, MoE inputs, targets and `candidates` expert outputs per token, fp32).
REPAIR_TOKENS = 32768


def stream_bytes(hidden: int, dtype_bytes: int, tokens: int) -> int:
    """Device bytes of the repair stream over `tokens` calibration tokens, at most
    REPAIR_TOKENS (the GPU memory plan's term, kconvert.gpu_plan.Forward.repair_bytes)."""
    return min(REPAIR_TOKENS, tokens) * hidden * (dtype_bytes + 4 * 4)


@dataclass(frozen=True)
class RepairSettings:
    method: str  # "bias" or "router"
    keep: int  # experts kept per layer
    criterion: str  # how the plan ranks experts (kconvert.pruning.reap.CRITERIA)
    max_tokens: int = REPAIR_TOKENS  # calibration tokens of the repair stream
    heldout: float = 0.25  # fraction of those sequences held out for the guard
    steps: int = 600
    lr_bias: float = 2e-3
    lr_gate: float = 3e-3  # relative to each gate row's RMS
    candidates: int = 2  # per token, candidates x top_k kept experts the fit may select
    temperature: float = 0.02  # width of the soft top-k threshold, in score units
    compensate: str = "none"  # kconvert.pruning.compensate.COMPENSATIONS
    # compensation's ridges, relative to the mean Gram diagonal: each layer takes the one with
    # the lowest held-out error
    ridges: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)
    sweeps: int = 2  # compensation's block Gauss-Seidel sweeps
    learned: LearnedSettings = field(default_factory=LearnedSettings)  # --compensate learned


def route(router: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from transformers' router module."""
    _, weights, ids = router(x)
    return weights.float(), ids


def pruned_router(cfg, weight: torch.Tensor, bias: torch.Tensor) -> nn.Module:
    """transformers' DeepseekV3TopkRouter for a pruned layer (n_group = topk_group = 1, as the
    pruned config says) holding `weight` [K, hidden] and `bias` [K] F32."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = copy.copy(cfg)
    cfg.n_routed_experts, cfg.n_group, cfg.topk_group = weight.shape[0], 1, 1
    with torch.device("meta"):
        router = DeepseekV3TopkRouter(cfg)
    router.load_state_dict({"weight": weight, "e_score_correction_bias": bias.float()},
                           assign=True)
    return router.eval()


def expert_outputs(moe: MoEBlock, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """f_j(x) [T, C, hidden] fp32 for expert ids [T, C] (source ids): each expert runs once,
    on the tokens that name it."""
    t, c = ids.shape
    out = torch.empty(t * c, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.n_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        gate, up = nn.functional.linear(x[slots // c], moe.experts.gate_up[e]).chunk(2, dim=-1)
        out[slots] = nn.functional.linear(moe.act_fn(gate) * up, moe.experts.down[e]).float()
        start += n
    return out.reshape(t, c, -1)


def routed_output(moe: MoEBlock, router: nn.Module, x: torch.Tensor,
                  expert_ids: torch.Tensor | None = None, chunk: int = 4096) -> torch.Tensor:
    """The routed experts' weighted sum [T, hidden] fp32 under `router`; `expert_ids` maps the
    router's expert i to source expert expert_ids[i] (None: the same)."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs = x[s:s + chunk]
        w, ids = route(router, xs)
        src = ids if expert_ids is None else expert_ids[ids]
        out[s:s + chunk] = torch.einsum("tk,tkh->th", w, expert_outputs(moe, xs, src))
    return out


@dataclass
class Candidates:
    """Per fit token, the kept experts it may select (`ids` [T, C], kept ids) and the moments
    of their outputs F [T, C, hidden] against the target t [T, hidden] that the error needs:
    gram = F F^T [T, C, C], cross = F t [T, C], and sum |t|^2. The error of gate weights g
    [T, C] is (sum_t g^T gram g - 2 g . cross + |t|^2) / (T hidden), so F is never kept."""

    ids: torch.Tensor
    gram: torch.Tensor
    cross: torch.Tensor
    target_sq: float
    elems: int

    @classmethod
    def measure(cls, moe: MoEBlock, x: torch.Tensor, target: torch.Tensor, ids: torch.Tensor,
                kept: torch.Tensor, chunk: int = 4096) -> Candidates:
        t, c = ids.shape
        gram = torch.empty(t, c, c, dtype=torch.float32, device=x.device)
        cross = torch.empty(t, c, dtype=torch.float32, device=x.device)
        for s in range(0, t, chunk):
            outs = expert_outputs(moe, x[s:s + chunk], kept[ids[s:s + chunk]])
            gram[s:s + chunk] = outs @ outs.transpose(1, 2)
            cross[s:s + chunk] = torch.einsum("tch,th->tc", outs, target[s:s + chunk])
        return cls(ids, gram, cross, float(target.double().square().sum()), target.numel())

    def error(self, gates: torch.Tensor) -> torch.Tensor:
        quad = torch.einsum("tc,tcd,td->", gates, self.gram, gates)
        return (quad - 2 * (gates * self.cross).sum() + self.target_sq) / self.elems


def fit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cand: Candidates, cfg,
        settings: RepairSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Router rows (weight [K, hidden] fp32, bias [K] fp32) that lower the mean squared error
    between the target and the routed sum, each token choosing among its candidate experts
    (`cand`). Starts from the given rows; returns the step with the lowest (hard-selection)
    error seen."""
    k, scale, norm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob
    tune_gate = settings.method == "router"
    xf, ids = x.float(), cand.ids
    d_bias = torch.zeros_like(bias, requires_grad=True)
    groups = [{"params": [d_bias], "lr": settings.lr_bias}]
    rms = weight.square().mean(1, keepdim=True).sqrt().clamp(min=1e-12)
    d_gate = torch.zeros_like(weight, requires_grad=tune_gate)
    if tune_gate:
        groups.append({"params": [d_gate], "lr": settings.lr_gate})
    opt = torch.optim.Adam(groups)
    best = (float("inf"), weight, bias)
    soft_threshold = ids.shape[1] > k
    for _ in range(settings.steps + 1):
        w_rows = weight + d_gate * rms
        scores = (xf @ w_rows.T).gather(1, ids).sigmoid()
        choice = scores + (bias + d_bias)[ids]
        top = choice.topk(min(k + 1, ids.shape[1]), dim=-1).values
        hard = (choice >= top[:, k - 1:k]).float()
        if soft_threshold:
            cut = (top[:, k - 1:k] + top[:, k:k + 1]).detach() / 2
            soft = torch.sigmoid((choice - cut) / settings.temperature)
            hard = hard + soft - soft.detach()
        gates = scores * hard
        if norm:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        loss = cand.error(gates * scale)
        if float(loss.detach()) < best[0]:
            best = (float(loss.detach()), w_rows.detach().clone(),
                    (bias + d_bias).detach().clone())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return best[1], best[2]


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
    # per layer, seconds per phase of its repair (kconvert.devices.Stopwatch; -v logs them)
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)
    # Where each layer's re-fitted matrices go (one file per layer, memory-mapped back), so
    # host memory does not grow with the layers; None: held in memory.
    spill: Path | None = None

    def __post_init__(self):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3RotaryEmbedding,
        )

        s = self.settings
        if s.method not in REPAIRS or s.compensate not in COMPENSATIONS:
            raise KconvertError(f"unknown repair {s.method!r} / compensation {s.compensate!r}; "
                                f"choose from {list(REPAIRS)} / {list(COMPENSATIONS)}")
        if s.method == "none" and s.compensate == "none":
            raise KconvertError("neither router repair nor compensation asked")
        n_seq, seq_len = self.input_ids.shape
        n = min(n_seq, max(2, self.settings.max_tokens // seq_len))
        if n < 2:
            asked = [what for what, on in (("router repair", s.method != "none"), (
                f"{s.compensate} compensation", s.compensate != "none")) if on]
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
        self.kind = COMPENSATION_KINDS.get(s.compensate)  # None: no compensation
        projs = self.kind.projs if self.kind is not None else ()
        self.linears = {proj: recode.expert_linears(self.ckpt, proj) for proj in projs}
        self.block_scale = recode.block_scale_rule(self.ckpt) if any(
            lin.codec.quantized for by_layer in self.linears.values()
            for layer in by_layer.values() for lin in layer.values()) else None

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
        keep = self.kept[layer] = keep_ids(scores[CRITERIA[s.criterion]], s.keep)
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
        if s.method != "none":
            w_out, b_out = self._fit_router(layer, moe, x, target, n_fit, kept, w_src, b_src,
                                            watch)
            self.rows[layer] = (w_out.cpu(), b_out.float().cpu())
        written = pruned_router(self.cfg, w_out.float(), b_out)
        if s.compensate != "none":
            with watch.phase("compensation setup"):
                shared = moe.shared_experts(x).float()
            self._compensate(layer, moe, x, target + shared, n_fit, written, watch)
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
            w_new = w_fit.to(w_src.dtype) if s.method == "router" else w_src
            after = pruned_router(self.cfg, w_new.float(), b_fit)
            repaired = routed_output(moe, after, x, kept)
            fit_after, held_after = (mse(repaired[:n_fit], target[:n_fit]),
                                     mse(repaired[n_fit:], target[n_fit:]))
        applied = held_after < held_before
        w_out, b_out = (w_new, b_fit) if applied else (w_src, b_src)
        self.records[layer] = LayerRepair(
            method=s.method, applied=applied, fit_tokens=n_fit, heldout_tokens=x.shape[0] - n_fit,
            fit_mse_before=fit_before, fit_mse_after=fit_after, heldout_mse_before=held_before,
            heldout_mse_after=held_after, gate_rows_xxh3=row_hashes(w_out.cpu()),
            bias=b_out.float().cpu().tolist())
        return w_out, b_out

    def _compensate(self, layer: int, moe: MoEBlock, x: torch.Tensor, target: torch.Tensor,
                    n_fit: int, router: nn.Module, watch: Stopwatch) -> None:
        """Re-fit the layer's down_proj matrices (kconvert.pruning.compensate) on the fit
        tokens at each ridge, take the ridge with the lowest held-out error (Refit.best), and
        encode its matrices in the source's format; when the guard passes them (Judged.applied:
        their held-out error as written, decoded again, below the source matrices'), write
        them into `moe` (the stream moves on with what is written) and keep their encoded
        parameters for the output; a kind that `trains` then trains from there (`_learn`)."""
        s, keep = self.settings, self.kept[layer]
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
        ridge, offsets = refit.best(s.ridges, s.sweeps, held_target)
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
                learned = self._learn(layer, moe, x, target, n_fit, (w, ids))
            kept.update(learned.tensors)
        self.matrices.update(recode.spilled(self.spill, layer, kept) if kept else {})
        ruled = any(lin.codec.uses_scale_rule for lin in sources[:count])
        self.compensations[layer] = LayerCompensation(
            method=s.compensate, applied=judged.applied, fit_tokens=n_fit,
            heldout_tokens=n_held, ridge=ridge,
            matrices_xxh3={name: tensor_hash(t) for name, t in sorted(kept.items())},
            block_scale=self.block_scale if ruled else None,
            learned=None if learned is None else LearnedCompensation(
                applied=learned.applied, steps=s.learned.steps, lr=s.learned.lr,
                batch=s.learned.batch, fit_mse_before=learned.fit_mse_before,
                fit_mse_after=learned.fit_mse_after,
                heldout_mse_before=learned.heldout_mse_before,
                heldout_mse_after=learned.heldout_mse_after),
            **dataclasses.asdict(judged))

    def _learn(self, layer: int, moe: MoEBlock, x: torch.Tensor, target: torch.Tensor,
               n_fit: int, routing: tuple[torch.Tensor, torch.Tensor]) -> Outcome:
        """Train the kept experts' gate, up and down against the unpruned block from what the
        closed form left in `moe` (kconvert.pruning.compensate_learned)."""
        keep = self.kept[layer]
        linears = {proj: self.sources(layer, keep, proj)[1:] for proj in self.kind.projs}
        experts = KeptExperts(self.ckpt, moe, keep, linears, self.block_scale, x.device)
        goal = target - moe.shared_experts(x).float()  # the shared expert as written, fixed
        return learn(experts, *routing, x, goal, n_fit, self.settings.learned)

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


def with_repair(plan: PrunePlan, repair: RouterRepair) -> PrunePlan:
    """The plan with each layer's repair and compensation records; refuses a plan whose kept
    experts differ from those the repair chose."""
    layers = {}
    s = repair.settings
    for key, entry in plan.layers.items():
        if int(key) not in repair.kept:
            raise KconvertError(f"layer {key} of the plan was not repaired")
        if entry.keep != repair.kept[int(key)]:
            raise KconvertError(f"layer {key}: the plan keeps other experts than the repair")
        layers[key] = entry.model_copy(update={"repair": repair.records.get(int(key)),
                                               "compensation": repair.compensations.get(int(key))})
    update = {"layers": layers}
    if s.method != "none":
        update["repair"] = s.method
    if s.compensate != "none":
        update["compensation"] = s.compensate
    return plan.model_copy(update=update)
