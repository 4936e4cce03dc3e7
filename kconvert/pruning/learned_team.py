"""The processes that train one layer's kept experts together in learned compensation
(kconvert.pruning.compensate_learned): one process trains every expert of a batch; under
torchrun the repair stream runs on rank 0 (kconvert.pruning.repair) and each rank trains a
contiguous share of every batch's experts (docs/reap.md, "Learned compensation").

Each step, every rank computes its own experts' outputs on their rows, the rows are gathered
on every rank in expert order, and every rank sums them per token in the same fixed order:
the loss's gradient on each row is then the one process's, bit for bit, and each rank takes
its own experts' backward and Adam steps from it. So the bytes written do not depend on the
number of ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kconvert.common import distributed


@dataclass(frozen=True)
class Team:
    """This process's place among the ranks training together: `world` ranks, this one
    `rank` (one process: 1 and 0)."""

    world: int = 1
    rank: int = 0

    @classmethod
    def here(cls) -> Team:
        """The ranks of this run (torchrun's, or this process alone)."""
        return cls(distributed.world(), distributed.rank())

    @property
    def leads(self) -> bool:
        """Whether this rank holds the repair stream and writes what is trained."""
        return self.rank == 0

    def share(self, n: int, rank: int | None = None) -> range:
        """The experts (positions 0..n-1 in a batch) `rank` (default: this one) trains: a
        contiguous share, the first n % world ranks one more."""
        r = self.rank if rank is None else rank
        base, extra = divmod(n, self.world)
        start = r * base + min(r, extra)
        return range(start, start + base + (r < extra))

    def rows(self, mine: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts' rows `mine` -> every expert's rows, in expert order, on every
        rank; counts: rows per expert of the batch."""
        if self.world == 1:
            return mine
        per_rank = [sum(counts[e] for e in self.share(len(counts), r))
                    for r in range(self.world)]
        return distributed.all_gather_rows(mine, per_rank)

    def experts(self, mine: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's share of a batch's n experts' matrices [share, ...] -> all n on every
        rank."""
        if self.world == 1:
            return mine
        return distributed.all_gather_rows(mine, [len(self.share(n, r))
                                                  for r in range(self.world)])

    def own(self, t: torch.Tensor, mine: range) -> torch.Tensor:
        """This rank's share `mine` of a batch's tensor `t` (every rank holds all of it): in
        one process `t` itself (trained in place, no second copy), elsewhere a copy of the
        share, so that the rest can be freed."""
        if self.world == 1:
            return t
        return t[mine.start:mine.stop].clone()

    def send(self, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """The lead's tensor `t` on every rank (others pass None, with its shape and dtype)."""
        if self.world == 1:
            assert t is not None
            return t
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=device)
        return distributed.broadcast_(t.contiguous())
