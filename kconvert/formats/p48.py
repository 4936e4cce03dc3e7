"""Paired-4:8 ("p48") sparsity (docs/p48.md): masks and checks.

Along each row, every 8 consecutive input elements form a chunk of 4 pairs (0,1)(2,3)(4,5)(6,7);
exactly 2 pairs per chunk are kept. One pair is one byte of packed NVFP4, so a chunk is 4
bytes. Everything here works on batches [B, M, K] (weights) or [..., M, K/2] (packed bytes).
The on-disk pair-bitmask layout is a format: kconvert/formats/nvfp4_pair_bitmask.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

CHUNK = 8  # elements per chunk


PAIRS = 4  # pairs per chunk


KEEP = 2  # pairs kept per chunk


# The 6 ways a chunk keeps 2 of its 4 pairs, in the order of the kept pair indices
# ({0,1} {0,2} {0,3} {1,2} {1,3} {2,3}): PATTERNS[i, j] says whether pattern i keeps element j.
PATTERN_PAIRS = tuple(itertools.combinations(range(PAIRS), KEEP))


def patterns(device: torch.device | str = "cpu") -> torch.Tensor:
    """The p48 patterns as element masks [6, 8] (float: 1 kept, 0 pruned)."""
    out = torch.zeros(len(PATTERN_PAIRS), CHUNK, device=device)
    for i, kept in enumerate(PATTERN_PAIRS):
        for pair in kept:
            out[i, 2 * pair:2 * pair + 2] = 1.0
    return out


def pattern_of(keep: torch.Tensor) -> torch.Tensor:
    """The pattern index [..., K/8] (int64) of a valid p48 pair mask `keep` [..., K/2] (bool:
    exactly 2 pairs kept per chunk); ValueError where a chunk keeps another number."""
    chunks = keep.reshape(*keep.shape[:-1], -1, PAIRS)
    if bool((chunks.sum(-1) != KEEP).any()):
        raise ValueError("a chunk does not keep exactly 2 of its 4 pairs")
    bits = (chunks.long() << torch.arange(PAIRS, device=keep.device)).sum(-1)
    codes = torch.tensor([sum(1 << p for p in kept) for kept in PATTERN_PAIRS],
                         device=keep.device)
    return (bits.unsqueeze(-1) == codes).long().argmax(-1)


def pair_scores(w: torch.Tensor, col_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Score of every pair [B, M, K/2]: |w| (magnitude) or |w| * col_weight (Wanda's
    |W_ij| * ||X_j||, col_weight [B, K]), summed over the pair's two elements."""
    s = w.abs()
    if col_weight is not None:
        s = s * col_weight.unsqueeze(-2)
    return s[..., 0::2] + s[..., 1::2]


def top2_pairs(scores: torch.Tensor) -> torch.Tensor:
    """Keep mask [..., K/2] (bool) of the 2 highest-scoring pairs of every chunk.

    Ties go to the lower pair index, decided by comparisons alone (no sort, no topk), so the
    mask is the same on every device.
    """
    s = scores.reshape(*scores.shape[:-1], -1, PAIRS)
    a, b = s.unsqueeze(-1), s.unsqueeze(-2)  # a: pair i, b: pair j
    idx = torch.arange(PAIRS, device=s.device)
    before = (idx.unsqueeze(0) < idx.unsqueeze(1))  # [i, j]: j < i
    # rank_i = pairs that beat pair i: a higher score, or an equal score at a lower index.
    rank = ((b > a) | ((b == a) & before)).sum(-1)
    return (rank < KEEP).reshape(scores.shape)


def apply_pair_mask(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """w with pruned pairs set to +0.0 (never -0.0: NVFP4 then writes the byte 0x00)."""
    return torch.where(keep.repeat_interleave(2, dim=-1), w, 0.0)


@dataclass
class P48Result:
    """What a check of packed bytes found; `first` locates the first bad chunk in row order."""

    chunks: int = 0
    over_two: int = 0  # chunks with 3 or 4 nonzero pairs
    neg_zero: int = 0  # chunks whose pruned pairs are not all stored as 0x00
    first: tuple[int, int, list[int]] | None = None  # (row, chunk, its 4 bytes)
    first_kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.over_two and not self.neg_zero


# Packed bytes checked per step (whole rows): the step's temporaries stay in the cache.
CHECK_BYTES = 4 << 20


def check_packed(packed: torch.Tensor) -> P48Result:
    """Paired-4:8 over packed NVFP4 bytes [M, K/2].

    A byte is a nonzero pair iff (byte & 0x77) != 0 (0x8 is -0). At most 2 pairs per chunk may
    be nonzero, and a pruned pair must be stored as 0x00: so at most 2 bytes per chunk may
    differ from 0x00 (a kept pair may still quantize to zero or -0).

    At read speed: a step of whole rows at a time, each chunk's count of bytes other than 0x00
    made by reading its 4 flags as one int32 word (a few operations on the words, no
    reduction); only a step with a chunk over the count is looked at again, to tell a third
    nonzero pair from a -0.
    """
    packed = packed.reshape(packed.shape[0] if packed.dim() > 1 else 1, -1)
    rows, half = packed.shape
    if half % PAIRS:
        raise ValueError(f"packed rows of {half} bytes are not whole 8-element chunks")
    res = P48Result(chunks=rows * (half // PAIRS))
    step = max(1, CHECK_BYTES // max(half, 1))
    for r0 in range(0, rows, step):
        part = packed[r0:r0 + step]
        bad = _over_keep(part != 0)
        if not bool(bad.any()):
            continue
        over = _over_keep((part & 0x77) != 0) != 0
        bad = bad != 0
        res.over_two += int(over.sum())
        res.neg_zero += int((bad & ~over).sum())
        if res.first is None:
            r, c = (int(v) for v in bad.nonzero()[0])
            res.first = (r0 + r, c, [int(b) for b in part[r, PAIRS * c:PAIRS * (c + 1)]])
            res.first_kind = "nonzero" if bool(over[r, c]) else "neg_zero"
    return res


def _over_keep(flags: torch.Tensor) -> torch.Tensor:
    """Per chunk of byte flags [..., K/2] (bool, a tensor of the caller's own), nonzero where
    more than KEEP of its 4 are set [..., K/8] (int32): the chunk's flags read as one
    little-endian word, added by two shifts into its low byte (at most 4), and KEEP + 1 or
    more carried into bit 3."""
    words = flags.view(torch.uint8).view(torch.int32)
    words += words >> 16  # bytes 0 and 1: flags 0+2 and 1+3
    words += words >> 8  # byte 0: the count (bytes above it are not looked at)
    words += 7 - KEEP
    return words.bitwise_and_(8)
