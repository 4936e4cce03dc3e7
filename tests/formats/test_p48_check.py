"""The p48 check of packed NVFP4 bytes (kconvert.formats.p48.check_packed, the audit's) against
the rule written here chunk by chunk from docs/p48.md: per 4 bytes (8 elements), at most 2
bytes with a nonzero pair value (byte & 0x77) and at most 2 bytes other than 0x00 (a pruned
pair is +0, never -0: 0x08, 0x80, 0x88 are -0 pairs); the first bad chunk is located by row and
chunk, with its bytes."""

from __future__ import annotations

import pytest
import torch

from kconvert.formats import p48


def _reference(packed: torch.Tensor):
    over = negz = 0
    first = None
    for r, row in enumerate(packed.tolist()):
        for c in range(len(row) // 4):
            chunk = row[4 * c:4 * c + 4]
            nonzero = sum(b & 0x77 != 0 for b in chunk)
            stored = sum(b != 0 for b in chunk)
            bad = "nonzero" if nonzero > 2 else "neg_zero" if stored > 2 else None
            over += bad == "nonzero"
            negz += bad == "neg_zero"
            if bad is not None and first is None:
                first = (r, c, chunk, bad)
    return over, negz, first


def _chunks(rows: int, half: int, seed: int, bad_rate: float) -> torch.Tensor:
    """Valid p48 bytes (2 of every 4 kept, kept bytes any value, pruned 0x00), then a fraction
    of chunks made bad: a third nonzero pair, or a pruned pair stored as -0."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, half // 4, 4), dtype=torch.uint8, generator=g)
    keep = torch.rand(rows, half // 4, 4, generator=g).argsort(-1) < 2
    b = torch.where(keep, b, torch.zeros_like(b))
    bad = torch.rand(rows, half // 4, generator=g) < bad_rate
    which = torch.randint(0, 4, (rows, half // 4), generator=g)
    neg = torch.tensor([0x08, 0x80, 0x88, 0x11], dtype=torch.uint8)[
        torch.randint(0, 4, (rows, half // 4), generator=g)]
    slot = torch.nn.functional.one_hot(which, 4).bool() & bad.unsqueeze(-1) & ~keep
    b = torch.where(slot, neg.unsqueeze(-1).expand_as(b), b)
    return b.reshape(rows, half)


@pytest.mark.parametrize("rows,half,bad_rate,seed", [
    (3, 4, 0.5, 4), (37, 64, 0.05, 0), (5, 8, 0.5, 1), (300, 512, 0.001, 2), (64, 4096, 0.0, 3)])
def test_check_packed_is_the_rule_chunk_by_chunk(rows, half, bad_rate, seed, monkeypatch):
    monkeypatch.setattr(p48, "CHECK_BYTES", 4096)  # several steps of rows
    packed = _chunks(rows, half, seed, bad_rate)
    over, negz, first = _reference(packed)
    got = p48.check_packed(packed)
    assert (got.chunks, got.over_two, got.neg_zero) == (rows * half // 4, over, negz)
    assert got.ok == (first is None)
    if first is not None:
        assert (*got.first, got.first_kind) == first
    # an unaligned view of the same bytes is checked the same
    wide = torch.zeros(rows, half + 3, dtype=torch.uint8)
    wide[:, 3:] = packed
    again = p48.check_packed(wide[:, 3:])
    assert (again.over_two, again.neg_zero, again.first) == (got.over_two, got.neg_zero,
                                                              got.first)


def test_rows_of_part_of_a_chunk_are_refused():
    with pytest.raises(ValueError, match="not whole 8-element chunks"):
        p48.check_packed(torch.zeros(2, 6, dtype=torch.uint8))
