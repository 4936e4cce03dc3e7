"""Which rows of a run are held out of a fit: every `every`-th, counted from the run's first
row. The positions are made from the row count alone, where selecting by a boolean mask would
make the host wait for the device to count the mask (one sync per selection: per expert matrix
in GPTQ's Hessians)."""

from __future__ import annotations

import torch


def split_rows(n: int, every: int, device: torch.device, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Among n rows that are rows first..first + n - 1 of a run, the positions (int64,
    ascending, from 0) of those a fit keeps and of those held out: run rows r with
    r % every == every - 1."""
    if every < 2:
        raise ValueError(f"every {every}: a held-out row needs kept rows between")
    start = (every - 1 - first) % every
    held = torch.arange(start, max(n, start), every, device=device)
    kept = torch.arange(n - held.numel(), device=device)
    # the j-th kept row comes after the held-out rows before it: (j + every - 1 - start) //
    # (every - 1) of them
    return kept + (kept + every - 1 - start) // (every - 1), held
