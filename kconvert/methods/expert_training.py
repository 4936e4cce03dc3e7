"""Learned compression of routed experts (docs/learned.md): each expert's gate, up and down
trained together so that the compressed expert's output matches the source expert's on its
routed tokens, weighted by the router weight squared.

Experts of a layer are independent: a batch of E experts trains as stacked tensors, one
batched matrix product per projection. Per expert and matrix the trainable state is an fp32
master weight and, for paired-4:8 (p48.md), one logit per 8-element chunk for each of the 6
allowed patterns (kconvert.methods.pattern_masks). A step:
  soft mask   m = softmax((logits * scale + gumbel) / temperature) @ patterns  (p48 only)
  weights     q = NVFP4(m * W) by a straight-through estimator: block scales chosen on the
              masked weights by the --block-scale rule each step (no gradient through them),
              the per-tensor scale the output is encoded with (fixed: the source's)
  loss        per expert sum_t g_t^2 |f_q(x_t) - f(x_t)|^2 / sum_t g_t^2 |f(x_t)|^2
  update      Adam on every tensor, each matrix's step scaled by its weights' RMS (logits: not),
              cosine from `lr` to a tenth; temperature and scale annealed linearly
Export takes each chunk's most likely pattern (ties to the lower pattern index), zeroes its
pruned pairs (+0) and quantizes by the rule: exactly what the codec writes. Every random draw
comes from the expert's own generator, seeded by (seed, layer, expert), all made before the
first step: the tokens of every step, then the seed of each step's and matrix's Gumbel noise,
whose draws a counter-based hash makes. So a run is reproducible, and an expert's draws do not
depend on which experts train beside it (the GPU budget's batch size); on a CPU neither does
its result (on a GPU the batched products may round by the batch's count, so
kconvert.methods.learned trains every GPU batch at one count: docs/learned.md).

A step is elementwise passes over every weight (the bulk of its memory traffic) around two
small batched products. The weights are masked and rounded without autograd, and the rounded
values (bf16 on a GPU: what the products read) are the leaves of the loss's graph; their
gradient then goes through the rounding (the identity) and the mask (its backward written out,
the Gumbel sample recomputed from its seed) straight into Adam, one fused pass per matrix. So
no fp32 copy of a matrix is kept for a backward pass, and the fp32 gradient of the masters is
never written. On a GPU the rounding and the update are compiled (torch.compile) into a few
fused kernels, and p48's mask and update are Triton kernels (`mask_passes`); the same torch
functions run eagerly on a CPU.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kconvert.formats import nvfp4, p48
from kconvert.methods import pattern_masks as pm

log = logging.getLogger(__name__)

ADAM_BETAS = (0.9, 0.99)
ADAM_EPS = 1e-12


@dataclass(frozen=True)
class TrainSettings:
    """How long and how hard to train (docs/learned.md says how the defaults were chosen)."""

    steps: int
    tokens: int  # routed tokens per expert per step, drawn with replacement from its fit set
    lr: float  # Adam step of the weights, as a fraction of each matrix's RMS
    mask_lr: float  # Adam step of the pattern logits
    seed: int
    temperature: tuple[float, float] = (2.0, 0.05)  # first step, last step
    logit_scale: tuple[float, float] = (100.0, 500.0)


@dataclass
class Experts:
    """E experts of one layer, stacked: what they train on and what they start from.

    `w` holds each expert's matrices (gate_up [E, 2I, H] and down [E, H, I], fp32) at the
    one-shot result's values, and where it pruned an entry the source's; `keep` the one-shot's
    p48 masks (None: dense NVFP4); `gs` each matrix's per-tensor scale per row, as encoded.
    """

    w: dict[str, torch.Tensor]
    keep: dict[str, torch.Tensor] | None
    gs: dict[str, torch.Tensor]
    x: list[torch.Tensor]  # per expert its fit tokens' inputs [T_e, H]
    y: list[torch.Tensor]  # the source expert's outputs on them [T_e, H], fp32
    g: list[torch.Tensor]  # their router weights [T_e], fp32


@dataclass(frozen=True)
class Encoding:
    """How the matrices are encoded: NVFP4 blocks of `group` by `rule` in `arithmetic`."""

    group: int
    rule: str
    arithmetic: str
    local_dtype: torch.dtype = torch.float32


def quantized(w: torch.Tensor, gs: torch.Tensor, enc: Encoding) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """(values [..., R, K] on the NVFP4 grid, block codes uint8 [..., R, K/group]) of w with
    per-row per-tensor scales gs [..., R], as the encoder writes them."""
    *lead, k = w.shape
    blocks = w.detach().reshape(-1, k // enc.group, enc.group).float()
    rows = gs.reshape(-1, 1).float()
    codes = nvfp4.choose_block_codes(blocks, rows, enc.rule, enc.local_dtype, enc.arithmetic)
    values = nvfp4.fake_quantize(blocks, codes, rows, enc.arithmetic)
    return values.reshape(w.shape), codes.reshape(*lead, k // enc.group)


def block_codes(w: torch.Tensor, gs: torch.Tensor, enc: Encoding) -> torch.Tensor:
    """The block-scale codes [..., R, K/group] the encoder picks for w [..., R, K] by
    `enc.rule` (its Triton kernel on a GPU)."""
    *lead, k = w.shape
    codes = nvfp4.choose_block_codes(w.detach().reshape(-1, k // enc.group, enc.group).float(),
                                     gs.reshape(-1, 1).float(), enc.rule, enc.local_dtype,
                                     enc.arithmetic)
    return codes.reshape(*lead, k // enc.group)


def grid_values(w: torch.Tensor, codes: torch.Tensor, gs: torch.Tensor, group: int,
                arithmetic: str, dtype: torch.dtype) -> torch.Tensor:
    """w [..., R, K] rounded to NVFP4's grid on block-scale codes [..., R, K/group] and per-row
    per-tensor scales gs [..., R] (the encoder's values), in `dtype`: the forward of the
    straight-through estimator, whose backward is the identity (no gradient through the
    scales)."""
    step = nvfp4.block_step(codes, gs.unsqueeze(-1), arithmetic)
    blocks = w.reshape(*w.shape[:-1], -1, group)
    return (nvfp4.round_e2m1(blocks / step) * step).reshape(w.shape).to(dtype)


def _adam(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
          step: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> None:
    """One Adam update in place: p -= step * m_hat / (sqrt(v_hat) + eps)."""
    b1, b2 = ADAM_BETAS
    m.mul_(b1).add_(grad, alpha=1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    p.sub_((m / c1) / ((v / c2).sqrt() + ADAM_EPS) * step)


def update_values(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                   step: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> None:
    """Adam on a dense matrix from the gradient on its rounded values (bf16 on a GPU)."""
    _adam(w, grad.float(), m, v, step, c1, c2)


def update_masked(w: torch.Tensor, logits: torch.Tensor, grad: torch.Tensor,
                   seed: torch.Tensor, scale: torch.Tensor, temperature: torch.Tensor,
                   masks: torch.Tensor, state: tuple[torch.Tensor, ...], step: torch.Tensor,
                   mask_step: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> None:
    """Adam on a p48 matrix and its pattern logits from the gradient on its masked, rounded
    values; state: the moments (m, v of w, m, v of the logits)."""
    d_w, d_logits = pm.mask_gradients(w, logits, grad, seed, scale, temperature, masks)
    _adam(w, d_w, state[0], state[1], step, c1, c2)
    _adam(logits, d_logits, state[2], state[3], mask_step, c1, c2)


# Whether the weight path and the update are compiled on a GPU, and whether p48's mask passes
# are its Triton kernels there (the benchmark compares each with the other).
COMPILE = True
MASK_KERNEL = True


@functools.cache
def compiled(fn: Callable, device_type: str) -> Callable:
    """`fn` compiled into fused kernels on a GPU (torch.compile; shapes fixed per batch size),
    as it is on a CPU."""
    if device_type != "cuda" or not COMPILE:
        return fn
    return torch.compile(fn, dynamic=False)


def mask_passes(device_type: str) -> tuple[Callable, Callable]:
    """p48's two passes over every weight (the masked weights, the update): on a GPU the Triton
    kernels (kconvert.methods.pattern_masks_triton: inductor's reductions run on untuned tiles
    in deterministic mode), else the torch functions, compiled where `compiled` compiles."""
    if device_type == "cuda" and MASK_KERNEL:
        return kernel_passes()
    return compiled(pm.masked_weights, device_type), compiled(update_masked, device_type)


def kernel_passes() -> tuple[Callable, Callable]:
    """p48's two passes as the Triton kernels, with this trainer's Adam constants."""
    from kconvert.methods import pattern_masks_triton as kernels

    return kernels.masked_weights, functools.partial(kernels.update_masked, betas=ADAM_BETAS,
                                                     eps=ADAM_EPS)


class _Linear(torch.autograd.Function):
    """x [E, T, K] times w [E, N, K] transposed, whose weight gradient is made in w's layout:
    autograd's bmm gives it as a transposed view, which AccumulateGrad then copies into w's
    layout, a strided pass over every weight (a fifth of a learned NVFP4 step on an H200)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.bmm(x, w.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        return (torch.bmm(grad, w) if ctx.needs_input_grad[0] else None,
                torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None)


def expert_outputs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) of stacked experts: x [E, T, H], gate_up [E, 2I, H] (gate
    rows first), down [E, H, I] -> [E, T, H], in x's dtype with fp32 accumulation."""
    gate, up = _Linear.apply(x, gate_up.to(x.dtype)).chunk(2, dim=-1)
    return _Linear.apply(torch.nn.functional.silu(gate) * up, down.to(x.dtype))


def _schedule(step: int, steps: int, ends: tuple[float, float]) -> float:
    t = step / max(steps - 1, 1)
    return ends[0] + (ends[1] - ends[0]) * t


def lr_factor(step: int, steps: int) -> float:
    """Cosine from 1 to a tenth."""
    return 0.1 + 0.45 * (1 + math.cos(math.pi * step / max(steps - 1, 1)))


class Adam:
    """Adam over a list of tensors, each update scaled per row group (the trainer's own: its
    step is a fraction of each matrix's RMS, which torch's optimisers do not take)."""

    def __init__(self, params: list[torch.Tensor], scales: list[torch.Tensor]):
        self.params, self.scales = params, scales
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0
        self.update = compiled(update_values, params[0].device.type)

    def corrections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's bias corrections (1 - beta1^t, 1 - beta2^t), on the device."""
        self.t += 1
        dev = self.params[0].device
        c1, c2 = (torch.tensor(1 - b ** self.t, device=dev) for b in ADAM_BETAS)
        return c1, c2

    @torch.no_grad()
    def apply(self, grads: tuple[torch.Tensor, ...], lr: float) -> None:
        """A step from gradients held apart from the parameters, in any dtype (bf16 from a
        GPU's products): each cast to fp32 inside its fused update, never written in fp32."""
        c1, c2 = self.corrections()
        for p, g, m, v, s in zip(self.params, grads, self.m, self.v, self.scales, strict=True):
            self.update(p, g, m, v, s * lr, c1, c2)


class _Draws:
    """Every random draw of a training run, made up front (one call per expert, not per step),
    each expert's from its own generator: per step the tokens each expert trains on (with
    replacement, from its fit tokens) and, for p48, each matrix's Gumbel noise seed."""

    def __init__(self, experts: Experts, settings: TrainSettings,
                 generators: list[torch.Generator], matrices: int):
        steps, tokens = settings.steps, settings.tokens
        picks, seeds = [], []
        for x, gen in zip(experts.x, generators, strict=True):
            picks.append(torch.randint(len(x), (steps, tokens), generator=gen, device=x.device))
            if experts.keep is not None:
                seeds.append(torch.randint(1 << 62, (steps, matrices), generator=gen,
                                           device=x.device))
        self.picks = torch.stack(picks, 1)  # [steps, E, tokens]
        self.seeds = torch.stack(seeds, -1) if seeds else None  # [steps, matrices, E]

    def batch(self, experts: Experts, step: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step `step`'s tokens: x [E, T, H], y [E, T, H], g [E, T]."""
        picks = self.picks[step]
        return (torch.stack([x[i] for x, i in zip(experts.x, picks, strict=True)]),
                torch.stack([y[i] for y, i in zip(experts.y, picks, strict=True)]),
                torch.stack([g[i] for g, i in zip(experts.g, picks, strict=True)]))


def relative_error(out: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per expert sum_t g^2 |out - y|^2 / sum_t g^2 |y|^2 ([E], fp32)."""
    w = g.square()
    err = ((out.float() - y).square().sum(-1) * w).sum(-1)
    return err / (y.square().sum(-1) * w).sum(-1).clamp(min=1e-30)


def train(experts: Experts, enc: Encoding, settings: TrainSettings,
          generators: list[torch.Generator],
          compute_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train `experts` (their `w` in place) and export them: (values per matrix on the NVFP4
    grid, pruned entries +0, block codes per matrix) as the encoder writes them.

    A step: each matrix's weights masked (p48) and rounded without autograd, the rounded values
    (in `compute_dtype`) the leaves of the loss's graph; their gradients then go through the
    rounding (identity) and the mask by hand into one fused update per matrix
    (`update_values`, `update_masked`): no fp32 copy of a matrix is kept for a backward pass."""
    names = list(experts.w)
    dev = experts.w[names[0]].device
    weights = {n: experts.w[n].detach() for n in names}
    logits = ({n: pm.initial_logits(experts.keep[n]) for n in names}
              if experts.keep is not None else {})
    rms = [w.square().mean((-1, -2), keepdim=True).sqrt_().clamp_(min=1e-12)
           for w in weights.values()]
    # the logits' step is mask_lr: the weights' base lr times this ratio
    ratio = torch.tensor(settings.mask_lr / settings.lr if settings.lr else 0.0, device=dev)
    opt = Adam([*weights.values(), *logits.values()], [*rms, *([ratio] * len(logits))])
    draws = _Draws(experts, settings, generators, len(names))
    masks = p48.patterns(dev)
    masked, update = (mask_passes(dev.type) if logits
                      else (None, compiled(update_values, dev.type)))
    rounded = compiled(grid_values, dev.type)
    for step in range(settings.steps):
        x, y, g = draws.batch(experts, step)
        scale = torch.tensor(_schedule(step, settings.steps, settings.logit_scale), device=dev)
        temperature = torch.tensor(_schedule(step, settings.steps, settings.temperature),
                                   device=dev)
        q = {}
        with torch.no_grad():
            for i, n in enumerate(names):
                w = weights[n]
                if logits:
                    w = masked(w, logits[n], draws.seeds[step, i], scale, temperature, masks)
                codes = block_codes(w, experts.gs[n], enc)
                q[n] = rounded(w, codes, experts.gs[n], enc.group, enc.arithmetic,
                               compute_dtype).requires_grad_(True)
        out = expert_outputs(x.to(compute_dtype), q["gate_up"], q["down"])
        relative_error(out, y, g).sum().backward()
        del out
        c1, c2 = opt.corrections()
        lr = settings.lr * lr_factor(step, settings.steps)
        with torch.no_grad():
            for i, n in enumerate(names):
                if logits:
                    j = len(names) + i
                    update(weights[n], logits[n], q[n].grad, draws.seeds[step, i], scale,
                           temperature, masks, (opt.m[i], opt.v[i], opt.m[j], opt.v[j]),
                           rms[i] * lr, ratio * lr, c1, c2)
                else:
                    update(weights[n], q[n].grad, opt.m[i], opt.v[i], rms[i] * lr, c1, c2)
        del q
    values, codes = {}, {}
    with torch.no_grad():
        for n in names:
            w = weights[n]
            if logits:
                w = torch.where(pm.hard_mask(logits[n]) > 0, w, 0.0)  # pruned pairs +0
            values[n], codes[n] = quantized(w, experts.gs[n], enc)
    return values, codes
