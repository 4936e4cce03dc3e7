"""split_rows (the held-out rows of a fit, made from the row count) against the boolean mask
it replaces: the same rows in the same order, for runs cut anywhere into chunks."""

from __future__ import annotations

import pytest
import torch

from kconvert.calibrate.held_out import split_rows


@pytest.mark.parametrize("every", [2, 3, 8])
def test_split_rows_are_the_masks_rows(every):
    for first in range(2 * every + 1):
        for n in range(4 * every + 3):
            held_mask = torch.tensor([(first + i) % every == every - 1 for i in range(n)],
                                     dtype=torch.bool)
            kept, held = split_rows(n, every, torch.device("cpu"), first)
            assert kept.dtype == held.dtype == torch.int64
            assert torch.equal(held, held_mask.nonzero().reshape(-1)), (every, first, n)
            assert torch.equal(kept, (~held_mask).nonzero().reshape(-1)), (every, first, n)


def test_every_row_held_out_is_refused():
    with pytest.raises(ValueError, match="every 1"):
        split_rows(10, 1, torch.device("cpu"))
