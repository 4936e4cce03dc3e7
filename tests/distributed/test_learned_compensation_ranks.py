"""Learned compensation's training shared among ranks (kconvert.pruning.learned_team), in
process with gloo: rank 0 leads `train` while the others `follow`, each training its share of
every batch, and what rank 0 writes is, bit for bit, what one process writes. 7 kept experts
in batches of 5 give shares of 3/2 and 1/1 on 2 ranks, 2/2/1 and 1/1/0 on 3 (a rank with no
expert in a batch still takes part)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from kconvert.common import distributed
from kconvert.pruning.compensate_learned import LearnedSettings, follow, train
from kconvert.pruning.learned_team import Team

H, INTER, K, E, T = 16, 8, 3, 7, 60
SETTINGS = LearnedSettings(steps=12, lr=2e-2, batch=5)


def problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)  # the repair stream's dtype
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    store = {"gate_up": torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5,
             "down": torch.randn(E, H, INTER, generator=g) / INTER ** 0.5}
    goal = torch.randn(T, H, generator=g) * 0.3
    return x, weights, ids, store, goal


def trained(team: Team | None) -> dict[str, torch.Tensor]:
    x, weights, ids, store, goal = problem()

    def read(p: range):
        return store["gate_up"][p.start:p.stop], store["down"][p.start:p.stop]

    def write(p: range, gu: torch.Tensor, dn: torch.Tensor):
        store["gate_up"][p.start:p.stop], store["down"][p.start:p.stop] = gu, dn

    train(x.float(), weights, ids, goal, E, read, write, SETTINGS, team=team)
    return store


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    team = Team.here()
    assert (team.world, team.rank) == (world, rank)
    if team.leads:
        store = trained(team)
        distributed.broadcast_object(None)  # the layer ends: the followers return
        torch.save(store, out)
    else:
        follow(team, torch.device("cpu"))
    distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_write_what_one_process_writes(tmp_path, world):
    torch.set_num_threads(1)  # as each rank runs: a CPU's sums depend on its thread count
    one = trained(None)
    start = problem()[3]
    assert all(not torch.equal(one[n], start[n]) for n in one)  # training changed them
    out = tmp_path / "rank0.pt"
    mp.spawn(rank_main, args=(world, free_port(), str(out)), nprocs=world, join=True)
    many = torch.load(out)
    for name in one:
        assert torch.equal(one[name], many[name]), name


def test_shares_cover_a_batch_once():
    for world in (1, 2, 3, 5):
        for n in (0, 1, 4, 7, 16):
            shares = [Team(world, r).share(n) for r in range(world)]
            assert [e for s in shares for e in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
