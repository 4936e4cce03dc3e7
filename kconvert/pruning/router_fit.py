"""Router repair's fit (reap.md, "Router repair"): Kimi's routing from a router's rows,
the routed experts' weighted output under it, and the fit of a pruned layer's kept rows to
the unpruned block's output (full-batch Adam, each token choosing among its candidate experts,
the selection hard forward and straight-through backward)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from kconvert.calibrate.moe import MoEBlock
from kconvert.plugins.pruning import COMPENSATIONS, NO_COMPENSATION, PRUNE, REPAIRS
from kconvert.pruning.compensate_learned import LearnedSettings
from kconvert.pruning.kinds import CompensationKind, RepairKind

# Calibration tokens the repair stream carries by default, as whole sequences (bounds its
# memory: hidden states, MoE inputs, targets and `candidates` expert outputs per token, fp32).
REPAIR_TOKENS = 32768


@dataclass(frozen=True)
class RepairSettings:
    method: str  # the repair kind, by name (kconvert.plugins.pruning.REPAIRS)
    keep: int  # experts kept per layer
    criterion: str  # how the plan ranks experts (kconvert.plugins.pruning.CRITERIA)
    max_tokens: int = REPAIR_TOKENS  # calibration tokens of the repair stream
    heldout: float = 0.25  # fraction of those sequences held out for the guard
    steps: int = 600
    lr_bias: float = 2e-3
    lr_gate: float = 3e-3  # relative to each gate row's RMS
    candidates: int = 2  # per token, candidates x top_k kept experts the fit may select
    temperature: float = 0.02  # width of the soft top-k threshold, in score units
    compensate: str = NO_COMPENSATION.name  # the compensation kind, by name (COMPENSATIONS)
    # compensation's ridges, relative to the mean Gram diagonal: each layer takes the one with
    # the lowest held-out error
    ridges: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)
    sweeps: int = 2  # compensation's block Gauss-Seidel sweeps
    learned: LearnedSettings = field(default_factory=LearnedSettings)  # --compensate learned

    @property
    def repair(self) -> type[RepairKind]:
        """What of the router it re-fits (its class, kconvert.pruning.kinds)."""
        return REPAIRS.named(PRUNE[0], self.method, "repair").load()

    @property
    def compensation(self) -> type[CompensationKind]:
        """Which matrices it re-fits (its class, kconvert.pruning.kinds)."""
        return COMPENSATIONS.named(PRUNE[0], self.compensate, "compensate").load()


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
    tune_gate = settings.repair.tunes_gate
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
