"""The learned p48 mask (docs/learned.md): per chunk of 8 weights one logit for each of the
6 allowed patterns (p48.md), a Gumbel-softmax sample of them as soft element masks in a
training step, its backward written out, and the hard mask export takes."""

from __future__ import annotations

import torch

from kconvert.formats import p48

# Logits start at the one-shot pattern's advantage: +PRIOR for it, 0 for the four patterns
# sharing one pair with it, -PRIOR for its complement (MaskLLM's and MoESQ's prior): at the
# first step's scale and temperature the one-shot pattern has about three quarters of the
# probability, so the others are explored from the start.
PRIOR = 0.05
BELOW_ONE = 1 - 2**-24  # the largest fp32 below 1


# splitmix64's constants as signed int64 (torch has no unsigned 64-bit arithmetic): the
# seed's stride, the golden-ratio increment and the finaliser's two multipliers and three shifts.
SEED_STRIDE = 0x3C6EF372FE94F82B
GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15
MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
SHIFTS = (30, 27, 31)
CODE_BITS = 24  # the draw's bits, the hash's highest


def logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits without the sign's extension (int64 shifts are arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(shape: torch.Size, seed: torch.Tensor) -> torch.Tensor:
    """Uniform draws in (0, 1) (24 bits) of a counter-based generator, shape [E, ...]: element
    i of batch entry e is a hash (splitmix64's finaliser) of i and seed[e] (int64 [E]).
    Elementwise integer arithmetic only, so the same bits on every device, and a compiler fuses
    it into its consumer instead of writing the draws out.

    The largest code's (2^24 - 0.5) / 2^24 rounds to 1.0 in fp32, whose Gumbel noise
    -log(-log(1)) is +inf and turns its chunk, and through the loss the whole expert, to NaN:
    one draw in 2^24, about two per step of a full-size Kimi expert. It is held at the largest
    fp32 below 1 (the next code's draw is 1 - 2^-23), and no other draw changes."""
    per = torch.arange(shape[1:].numel(), dtype=torch.int64, device=seed.device)
    x = (per.reshape(shape[1:]) + seed.reshape(-1, *[1] * (len(shape) - 1)) * SEED_STRIDE) * GOLDEN
    x = (x ^ logical_shift(x, SHIFTS[0])) * MIX1
    x = (x ^ logical_shift(x, SHIFTS[1])) * MIX2
    x = x ^ logical_shift(x, SHIFTS[2])
    code = logical_shift(x, 64 - CODE_BITS).float()
    return ((code + 0.5) / (1 << CODE_BITS)).clamp(max=BELOW_ONE)


def probs(logits: torch.Tensor, seed: torch.Tensor, scale: torch.Tensor,
          temperature: torch.Tensor) -> torch.Tensor:
    """A Gumbel-softmax sample of each chunk's pattern probabilities [..., K/8, 6], the noise
    -log(-log(u)) of `counter_uniform` draws keyed by `seed`."""
    noise = -torch.log(-torch.log(counter_uniform(logits.shape, seed)))
    return torch.softmax((logits * scale + noise) / temperature, dim=-1)


def element_masks(chunk_probs: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Pattern probabilities [..., 6] times the patterns' element masks [6, 8]: [..., 8]. A
    sum over the 6 patterns rather than a matrix product, so that a compiler fuses it into its
    neighbours."""
    return (chunk_probs.unsqueeze(-1) * masks).sum(-2)


def masked_weights(w: torch.Tensor, logits: torch.Tensor, seed: torch.Tensor,
                   scale: torch.Tensor, temperature: torch.Tensor, masks: torch.Tensor
                   ) -> torch.Tensor:
    """w times a Gumbel-softmax sample of its element masks."""
    return w * element_masks(probs(logits, seed, scale, temperature), masks).reshape(w.shape)


def mask_gradients(w: torch.Tensor, logits: torch.Tensor, grad: torch.Tensor,
                   seed: torch.Tensor, scale: torch.Tensor, temperature: torch.Tensor,
                   masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (of w [..., R, K], of its logits [..., R, K/8, 6]) of a loss whose
    gradient on the masked and rounded weights is `grad` (the rounding's straight-through
    backward is the identity): the backward of `masked_weights` by hand, its sample recomputed
    from the same seed, so that one fused pass gives both without autograd keeping it."""
    sample = probs(logits, seed, scale, temperature)
    chunks = (*logits.shape[:-1], masks.shape[1])
    g = grad.float().reshape(chunks)
    d_probs = (masks * (g * w.reshape(chunks)).unsqueeze(-2)).sum(-1)
    d_logits = sample * (d_probs - (sample * d_probs).sum(-1, keepdim=True)) * (scale / temperature)
    return (g * element_masks(sample, masks)).reshape(w.shape), d_logits


def initial_logits(keep: torch.Tensor) -> torch.Tensor:
    """Pattern logits [..., R, K/8, 6] (fp32) favouring the pattern of a p48 pair mask
    `keep` [..., R, K/2] by its overlap with each pattern (PRIOR per shared pair above the
    mean)."""
    masks = p48.patterns(keep.device)  # [6, 8]
    chosen = masks[p48.pattern_of(keep)]  # [..., K/8, 8]
    overlap = torch.einsum("...c,pc->...p", chosen, masks) / 2  # pairs shared: 0, 1 or 2
    return PRIOR * (overlap - 1.0)


def soft_mask(logits: torch.Tensor, scale: float, temperature: float) -> torch.Tensor:
    """The expected element masks [..., R, K] of logits [..., R, K/8, 6] at a scale and
    temperature (a step's sample adds Gumbel noise to the scaled logits: `masked_weights`)."""
    expected = torch.softmax(logits * scale / temperature, dim=-1)
    return (expected @ p48.patterns(logits.device)).reshape(*logits.shape[:-2], -1)


def hard_mask(logits: torch.Tensor) -> torch.Tensor:
    """Each chunk's most likely pattern (ties to the lower index) as element masks [..., R, K]."""
    return p48.patterns(logits.device)[logits.argmax(-1)].reshape(*logits.shape[:-2], -1)
