"""The learned p48 mask's two passes over every weight of a training step as Triton kernels
(docs/learned.md): the masked weights, and the update (the mask's backward, written out in
kconvert.methods.pattern_masks, then Adam on the weights and on their pattern logits).

Hand-written because the method trains inside torch's deterministic mode, where inductor does
not time the candidate tiles of a reduction but takes a fixed one, and the mask's passes are
reductions (a softmax over 6 patterns, sums over 6 patterns and over 8 elements), which made
inductor's compiled step of full-size experts much slower inside the mode than outside it
(docs/learned.md, "Determinism"). Here the tile is fixed in the code, as the scale-block
kernel's is, so the bits are the same in any mode and on every run.

One program takes BLOCK chunks of 8 weights of one expert and the chunks' 6 pattern logits,
padded to 8 (the padding's probability is 0). The Gumbel draws are
`pattern_masks.counter_uniform`'s bit for bit: the same hash of the same counter (the logit's
index in its expert) and seed. The rest is the torch functions' arithmetic in another order:
they agree to fp32 rounding (tests/methods/test_pattern_masks_triton.py, through Triton's
interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kconvert.methods import pattern_masks as pm

BLOCK = 128  # chunks of 8 weights per program
NUM_WARPS = 4

SEED_STRIDE = tl.constexpr(pm.SEED_STRIDE)
GOLDEN = tl.constexpr(pm.GOLDEN)
MIX1 = tl.constexpr(pm.MIX1)
MIX2 = tl.constexpr(pm.MIX2)
SHIFT1 = tl.constexpr(pm.SHIFTS[0])
SHIFT2 = tl.constexpr(pm.SHIFTS[1])
SHIFT3 = tl.constexpr(pm.SHIFTS[2])
CODE_BITS = tl.constexpr(pm.CODE_BITS)
CODE_STEP = tl.constexpr(2.0 ** -pm.CODE_BITS)  # exact: the torch path's division by 2^24
BELOW_ONE = tl.constexpr(pm.BELOW_ONE)


@triton.jit
def logical_shift(x, bits: tl.constexpr):
    """pattern_masks.logical_shift: an unsigned shift of int64 x's bits."""
    return (x.to(tl.uint64, bitcast=True) >> bits).to(tl.int64, bitcast=True)


@triton.jit
def counter_uniform(counter, seed):
    """pattern_masks.counter_uniform's draw for int64 `counter` under int64 `seed`."""
    x = (counter + seed * SEED_STRIDE) * GOLDEN
    x = (x ^ logical_shift(x, SHIFT1)) * MIX1
    x = (x ^ logical_shift(x, SHIFT2)) * MIX2
    x = x ^ logical_shift(x, SHIFT3)
    code = logical_shift(x, 64 - CODE_BITS).to(tl.float32)
    return tl.minimum((code + 0.5) * CODE_STEP, BELOW_ONE)


@triton.jit
def gumbel_sample(logits, counter, pattern, seed, scale, temperature):
    """pattern_masks.probs of logits [BLOCK, 8] (columns 6 and 7 padding, `pattern` [1, 8]
    whether a column is one) whose draws' counters are `counter`: probability 0 in the
    padding, whose draws are made and not used."""
    noise = -tl.log(-tl.log(counter_uniform(counter, seed)))
    z = tl.where(pattern, (logits * scale + noise) / temperature, float("-inf"))
    ex = tl.exp(z - tl.max(z, 1)[:, None])
    return ex / tl.sum(ex, 1)[:, None]


@triton.jit
def element_masks(sample, masks_ptr):
    """pattern_masks.element_masks: sample [BLOCK, 8 patterns] times the patterns' masks [6, 8],
    a pattern at a time (a product of 3-d blocks would move them through shared memory)."""
    col = tl.arange(0, 8)
    out = tl.zeros_like(sample)
    for p in tl.static_range(6):
        chunk_p = tl.sum(tl.where(col[None, :] == p, sample, 0.0), 1)
        out += chunk_p[:, None] * tl.load(masks_ptr + p * 8 + col)[None, :]
    return out


@triton.jit
def pattern_sums(x, masks_ptr):
    """Per chunk of x [BLOCK, 8 elements] the sum over each pattern's kept elements: [BLOCK, 8
    patterns], 0 in the padding."""
    col = tl.arange(0, 8)
    out = tl.zeros_like(x)
    for p in tl.static_range(6):
        sum_p = tl.sum(x * tl.load(masks_ptr + p * 8 + col)[None, :], 1)
        out = tl.where(col[None, :] == p, sum_p[:, None], out)
    return out


@triton.jit
def adam(p, grad, m, v, step, c1, c2, B1: tl.constexpr, B2: tl.constexpr, EPS: tl.constexpr):
    """expert_training's Adam update: (p, m, v) after it."""
    m = m * B1 + grad * (1 - B1)
    v = v * B2 + grad * grad * (1 - B2)
    # IEEE division and square root, as torch's
    denominator = tl.sqrt_rn(tl.math.div_rn(v, c2)) + EPS
    return p - tl.math.div_rn(tl.math.div_rn(m, c1), denominator) * step, m, v


@triton.jit
def chunk_offsets(chunks, BLOCK: tl.constexpr):
    """This program's expert, its chunks' weight and logit offsets [BLOCK, 8], which of them
    lie inside, and which logit columns are patterns."""
    e = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    col = tl.arange(0, 8)
    # (col < 8) is always true: it broadcasts the chunks' mask to [BLOCK, 8]
    inside = (chunk < chunks)[:, None] & (col < 8)[None, :]
    pattern = (col < 6)[None, :]
    counter = chunk[:, None] * 6 + col[None, :]  # the logit's index in its expert
    return (e, e * chunks * 8 + chunk[:, None] * 8 + col[None, :], e * chunks * 6 + counter,
            counter, inside, pattern)


@triton.jit
def masked_kernel(w_ptr, logit_ptr, out_ptr, seed_ptr, masks_ptr, scale_ptr, temperature_ptr,
                  chunks, BLOCK: tl.constexpr):
    e, w_at, logit_at, counter, inside, pattern = chunk_offsets(chunks, BLOCK)
    logits = tl.load(logit_ptr + logit_at, mask=inside & pattern, other=0.0)
    sample = gumbel_sample(logits, counter, pattern, tl.load(seed_ptr + e),
                           tl.load(scale_ptr), tl.load(temperature_ptr))
    w = tl.load(w_ptr + w_at, mask=inside, other=0.0)
    tl.store(out_ptr + w_at, w * element_masks(sample, masks_ptr), mask=inside)


@triton.jit
def update_kernel(w_ptr, logit_ptr, grad_ptr, seed_ptr, masks_ptr, scale_ptr, temperature_ptr,
                  mw_ptr, vw_ptr, ml_ptr, vl_ptr, step_ptr, mask_step_ptr, c1_ptr, c2_ptr,
                  chunks, B1: tl.constexpr, B2: tl.constexpr, EPS: tl.constexpr,
                  BLOCK: tl.constexpr):
    e, w_at, logit_at, counter, inside, pattern = chunk_offsets(chunks, BLOCK)
    at_logit = inside & pattern
    logits = tl.load(logit_ptr + logit_at, mask=at_logit, other=0.0)
    scale, temperature = tl.load(scale_ptr), tl.load(temperature_ptr)
    sample = gumbel_sample(logits, counter, pattern, tl.load(seed_ptr + e), scale, temperature)
    w = tl.load(w_ptr + w_at, mask=inside, other=0.0)
    g = tl.load(grad_ptr + w_at, mask=inside, other=0.0).to(tl.float32)
    # pattern_masks.mask_gradients
    d_probs = pattern_sums(g * w, masks_ptr)
    d_logits = (sample * (d_probs - tl.sum(sample * d_probs, 1)[:, None])
                * (scale / temperature))
    d_w = g * element_masks(sample, masks_ptr)
    c1, c2 = tl.load(c1_ptr), tl.load(c2_ptr)
    w, m, v = adam(w, d_w, tl.load(mw_ptr + w_at, mask=inside),
                   tl.load(vw_ptr + w_at, mask=inside), tl.load(step_ptr + e), c1, c2,
                   B1, B2, EPS)
    tl.store(w_ptr + w_at, w, mask=inside)
    tl.store(mw_ptr + w_at, m, mask=inside)
    tl.store(vw_ptr + w_at, v, mask=inside)
    logits, m, v = adam(logits, d_logits, tl.load(ml_ptr + logit_at, mask=at_logit),
                        tl.load(vl_ptr + logit_at, mask=at_logit), tl.load(mask_step_ptr),
                        c1, c2, B1, B2, EPS)
    tl.store(logit_ptr + logit_at, logits, mask=at_logit)
    tl.store(ml_ptr + logit_at, m, mask=at_logit)
    tl.store(vl_ptr + logit_at, v, mask=at_logit)


def chunk_grid(w: torch.Tensor, logits: torch.Tensor, per_expert: tuple[torch.Tensor, ...],
               like_w: tuple[torch.Tensor, ...] = (), like_logits: tuple[torch.Tensor, ...] = ()
               ) -> tuple[int, tuple[int, int]]:
    """(chunks per expert, the launch grid) of stacked fp32 weights w [E, R, K] and their
    logits [E, R, K/8, 6], with one value per expert in each of `per_expert` and tensors shaped
    as w and as the logits: anything the kernels would index wrongly is refused."""
    shapes = (w.dim() == 3 and not w.shape[-1] % 8
              and logits.shape == (*w.shape[:-1], w.shape[-1] // 8, 6)
              and all(t.shape == w.shape for t in like_w)
              and all(t.shape == logits.shape for t in like_logits)
              and all(t.numel() == w.shape[0] for t in per_expert))
    fp32 = all(t.dtype == torch.float32 for t in (w, logits, *like_w[1:], *like_logits))
    if not (shapes and fp32 and all(t.is_contiguous() for t in (w, logits, *like_w,
                                                               *like_logits))):
        raise ValueError(f"the p48 mask kernels take contiguous fp32 w [E, R, K], logits "
                         f"[E, R, K/8, 6], state of their shapes and one seed and step per "
                         f"expert, not w {tuple(w.shape)} {w.dtype}, logits "
                         f"{tuple(logits.shape)}")
    chunks = w[0].numel() // 8
    return chunks, (triton.cdiv(chunks, BLOCK), w.shape[0])


def masked_weights(w: torch.Tensor, logits: torch.Tensor, seed: torch.Tensor,
                   scale: torch.Tensor, temperature: torch.Tensor, masks: torch.Tensor
                   ) -> torch.Tensor:
    """pattern_masks.masked_weights in one pass."""
    chunks, grid = chunk_grid(w, logits, (seed,))
    out = torch.empty_like(w)
    masked_kernel[grid](w, logits, out, seed.contiguous(), masks.contiguous(), scale,
                        temperature, chunks, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def update_masked(w: torch.Tensor, logits: torch.Tensor, grad: torch.Tensor,
                  seed: torch.Tensor, scale: torch.Tensor, temperature: torch.Tensor,
                  masks: torch.Tensor, state: tuple[torch.Tensor, ...], step: torch.Tensor,
                  mask_step: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, *,
                  betas: tuple[float, float], eps: float) -> None:
    """expert_training's update of a p48 matrix (the mask's backward, Adam on the weights
    and on the logits) in one pass, in place; `grad` as w (any float dtype), `state` the
    moments (m, v of w, m, v of the logits), `step` per expert ([E] or [E, 1, 1])."""
    chunks, grid = chunk_grid(w, logits, (seed, step), (grad, *state[:2]), state[2:])
    update_kernel[grid](w, logits, grad, seed.contiguous(), masks.contiguous(), scale,
                        temperature, *state, step.reshape(-1).contiguous(), mask_step, c1, c2,
                        chunks,
                        B1=betas[0], B2=betas[1], EPS=eps, BLOCK=BLOCK, num_warps=NUM_WARPS)
