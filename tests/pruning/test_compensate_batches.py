"""`reap --compensate learned` with more kept experts than one batch (docs/reap.md, "Learned
compensation": block coordinate descent): each batch trains on the residual the batches
before it left as written. A later batch's result is a function of what the earlier batches
wrote: given the same written values it is the same (up to the order of float sums: 1e-7
measured, against changes of 0.07 where the earlier batches' values differ)."""

from __future__ import annotations

import torch

from kconvert.pruning.compensate_learned import LearnedSettings, train

H, INTER, K, E, T = 16, 8, 3, 7, 40  # hidden, inter, top-k, kept experts, tokens
SETTINGS = LearnedSettings(steps=12, lr=2e-2, batch=3)  # batches 0-2, 3-5, 6
FIRST = range(0, 3)


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, INTER, generator=g) / INTER ** 0.5
    goal = torch.randn(T, H, generator=g) * 0.3
    return x, weights, ids, goal, gate_up, down


def _train(first: tuple[torch.Tensor, torch.Tensor] | None = None, keep_first: bool = False
           ) -> dict[str, torch.Tensor]:
    """The stored experts after training, starting the first batch from `first` where given;
    with `keep_first` the first batch's own write is dropped (it stays as it started)."""
    x, weights, ids, goal, gate_up, down = _problem()
    store = {"gate_up": gate_up.clone(), "down": down.clone()}
    if first is not None:
        store["gate_up"][:3], store["down"][:3] = first

    def read(p: range):
        return store["gate_up"][p.start:p.stop], store["down"][p.start:p.stop]

    def write(p: range, gu: torch.Tensor, dn: torch.Tensor):
        if not (keep_first and p == FIRST):
            store["gate_up"][p.start:p.stop], store["down"][p.start:p.stop] = gu, dn

    train(x, weights, ids, goal, E, read, write, SETTINGS)
    return store


def test_each_batch_trains_on_the_residual_the_batches_before_it_left():
    trained = _train()
    start = _problem()[4:]
    assert not torch.equal(trained["gate_up"][:3], start[0][:3])  # the first batch trained
    # the first batch already at its trained values, and left there: the later batches see
    # the same residual as in the full run, and train to the same values
    same = _train((trained["gate_up"][:3], trained["down"][:3]), keep_first=True)
    for name, t in trained.items():
        torch.testing.assert_close(same[name][3:], t[3:], rtol=0, atol=1e-5)
    # the first batch left at its starting values instead: the later batches see another
    # residual and train to other values
    other = _train((start[0][:3], start[1][:3]), keep_first=True)
    for name, t in trained.items():
        for part in (slice(3, 6), slice(6, None)):
            assert float((other[name][part] - t[part]).abs().max()) > 1e-2, (name, part)
