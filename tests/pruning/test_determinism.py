"""REAP's reproducibility: the same `reap --repair router --compensate down` twice writes the same
bytes with several torch threads (the suite otherwise runs on one, where thread-order effects
cannot show); the router fit runs on torch's deterministic kernels; and equal scores keep the
lower expert ids (kconvert.pruning.reap.keep_ids), never-routed experts included."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from helpers import cli_inproc, write_input_ids
from kconvert.calibrate.run import measure_stats
from kconvert.io.checkpoint import open_checkpoint
from kconvert.plugins.pruning import CRITERIA
from kconvert.pruning import repair
from kconvert.pruning.reap import keep_ids, plan_from_scores
from kconvert.testing.tiny_moe import corpus_ids, windows

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
THREADS = 4


@pytest.fixture
def several_threads():
    was = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def test_the_same_reap_twice_with_several_threads_writes_the_same_bytes(tmp_path,
                                                                        several_threads):
    assert torch.get_num_threads() == THREADS
    ids = windows(corpus_ids("train"), 12, 64, torch.Generator().manual_seed(3))
    data = write_input_ids(tmp_path / "calib.jsonl", ids)
    outs = [tmp_path / "a", tmp_path / "b"]
    for dst in outs:
        res = cli_inproc("reap", SRC, dst, "--data", data, "--keep", 12, "--samples", 12,
                         "--seq-len", 64, "--repair", "router", "--compensate", "down",
                         "--device", "cpu", "--quiet")
        assert res.exit_code == 0, res.output
    files = sorted(p.name for p in outs[0].iterdir() if p.suffix in (".safetensors", ".json")
                   and p.name != "kconvert-manifest.json")
    assert "reap-plan.json" in files and any(f.endswith(".safetensors") for f in files)
    for f in files:
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), f


def test_the_router_fit_runs_on_deterministic_kernels(monkeypatch):
    """A backward that accumulates through indexing is summed in a varying order by parallel
    kernels (atomics on a GPU) unless torch's deterministic algorithms are on."""
    modes: list[bool] = []
    fit = repair.fit

    def recorded(*args, **kwargs):
        modes.append(torch.are_deterministic_algorithms_enabled())
        return fit(*args, **kwargs)

    monkeypatch.setattr(repair, "fit", recorded)
    ids = windows(corpus_ids("train"), 4, 32, torch.Generator().manual_seed(3))
    ckpt = open_checkpoint(str(SRC))
    try:
        fixer = repair.RouterRepair(ckpt, ids, repair.RepairSettings("bias", 12, "reap",
                                                                     steps=2),
                                    torch.device("cpu"), dtype=torch.float32)
        measure_stats(ckpt, ids, "cpu", 4, dtype=torch.float32, on_weights=fixer)
    finally:
        ckpt.close()
    assert modes == [True, True, True]  # one fit per MoE layer
    assert not torch.are_deterministic_algorithms_enabled()  # restored after


def test_equal_scores_keep_the_lower_ids():
    assert keep_ids(torch.tensor([0.5, 0.9, 0.5, 0.5, 0.0], dtype=torch.float64), 3) == [0, 1, 2]
    assert keep_ids(torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), 2) == [0, 1]


@pytest.mark.parametrize("criterion", sorted(CRITERIA.names()))
def test_a_keep_beyond_the_routed_experts_takes_the_lowest_never_routed_ids(criterion):
    """Experts 1, 3 and 4 were never routed (every score 0): keeping 5 of 6 keeps the three
    routed ones and, of the never-routed, the two lowest ids."""
    count = torch.tensor([3.0, 0.0, 5.0, 0.0, 0.0, 2.0], dtype=torch.float64)
    norms = torch.tensor([2.0, 0.0, 1.0, 0.0, 0.0, 4.0], dtype=torch.float64)
    s = {"saliency": norms / 4, "count": count, "ean_sum": norms * count,
         "ean_sq_sum": norms.square() * count}
    assert plan_from_scores({1: s}, 5, criterion).layers["1"].keep == [0, 1, 2, 3, 5]
