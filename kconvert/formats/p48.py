"""Paired-4:8 ("p48") sparsity (docs/p48.md): masks and checks.

Along each row, every 8 consecutive input elements form a chunk of 4 pairs (0,1)(2,3)(4,5)(6,7);
exactly 2 pairs per chunk are kept. One pair is one byte of packed NVFP4, so a chunk is 4
bytes. Everything here works on batches [B, M, K] (weights) or [..., M, K/2] (packed bytes).
The on-disk pair-bitmask layout is a format: kconvert/formats/nvfp4_pair_bitmask.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 8  # elements per chunk


PAIRS = 4  # pairs per chunk


KEEP = 2  # pairs kept per chunk


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


# Packed bytes checked per step (whole rows): the step's int64 temporaries stay in the cache.
CHECK_BYTES = 1 << 20


def check_packed(packed: torch.Tensor) -> P48Result:
    """Paired-4:8 over packed NVFP4 bytes [M, K/2].

    A byte is a nonzero pair iff (byte & 0x77) != 0 (0x8 is -0). At most 2 pairs per chunk may
    be nonzero, and a pruned pair must be stored as 0x00: so at most 2 bytes per chunk may
    differ from 0x00 (a kept pair may still quantize to zero or -0).

    At read speed: the bytes are read as int64 words of two chunks each, and each chunk's
    count of nonzero bytes is made by a few bitwise operations on the words (no per-byte
    tensors), a step of whole rows at a time.
    """
    packed = packed.reshape(packed.shape[0] if packed.dim() > 1 else 1, -1)
    rows, half = packed.shape
    if half % (2 * PAIRS):  # NVFP4 rows are whole 16-element blocks: two chunks a word
        raise ValueError(f"packed rows of {half} bytes are not whole 16-element blocks")
    words = _words(packed)  # [rows, half / 8]
    res = P48Result(chunks=rows * (half // PAIRS))
    step = max(1, CHECK_BYTES // half)
    for r0 in range(0, rows, step):
        w = words[r0:r0 + step]
        counts = (_nonzero_bytes(w & 0x7777777777777777), _nonzero_bytes(w))
        over = _more_than_keep(counts[0])
        negz = _more_than_keep(counts[1]) & ~over
        res.over_two += _chunks(over)
        res.neg_zero += _chunks(negz)
        if res.first is None and bool((over | negz).any()):
            r, word = (int(v) for v in (over | negz).nonzero()[0])
            low = int(over[r, word] | negz[r, word]) & 1  # the word's first chunk is bad
            c = 2 * word + (0 if low else 1)
            bit = 1 if low else 1 << 32
            res.first_kind = "nonzero" if int(over[r, word]) & bit else "neg_zero"
            res.first = (r0 + r, c, [int(b) for b in packed[r0 + r, PAIRS * c:PAIRS * (c + 1)]])
    return res


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [M, K/2] as int64 words [M, K/16] (a copy where the bytes are not
    aligned to them)."""
    try:
        return packed.view(torch.int64)
    except RuntimeError:
        return packed.contiguous().clone().view(torch.int64)


def _nonzero_bytes(x: torch.Tensor) -> torch.Tensor:
    """Per chunk of int64 words x (two chunks of 4 bytes each), its count of nonzero bytes:
    in bits 0-7 for the low chunk and 32-39 for the high one."""
    y = x | (x >> 4)  # each byte's high nibble onto its low one (bits 4-7 are dropped next)
    y &= 0x0F0F0F0F0F0F0F0F
    y |= y >> 2
    y |= y >> 1
    y &= 0x0101010101010101  # bit 0 of each byte: the byte is nonzero
    y += y >> 16  # bytes 0 and 4 gather the flags of their chunk's 4 bytes
    y += y >> 8
    return y & 0x000000FF000000FF


def _more_than_keep(counts: torch.Tensor) -> torch.Tensor:
    """The words' chunk counts above KEEP, as bits: 0x1 (low chunk), 0x100000000 (high)."""
    return ((counts + (0x80 - KEEP - 1) * 0x0000000100000001) >> 7) & 0x0000000100000001


def _chunks(flags: torch.Tensor) -> int:
    """How many chunks the words' flags (_more_than_keep) mark."""
    return int((flags & 1).sum()) + int((flags >> 32).sum())
