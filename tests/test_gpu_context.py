"""One GPU memory budget (docs/gpu-memory.md), the card's side: a run reads what the card has
free once and every step of it (REAP's calibration and the conversion after it) takes that one
GpuContext; without a GPU, plans are made for a reference card; the per-process cap names the
card by index. No GPU here: torch.cuda's calls are patched."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import BUNDLED
from helpers import write_input_ids
from kconvert import api
from kconvert.gpu import budget as gpu_budget
from kconvert.gpu.budget import GpuContext, GpuRequest
from kconvert.gpu.plan import GpuMemoryError

GIB = 1 << 30


def test_a_run_reads_the_card_once_and_plans_without_one_for_the_reference_card(monkeypatch):
    """GpuRequest.context reads what the card has free once: every later step of the run gets
    the same GpuContext. Without a GPU, plans are made for --gpu-memory, else for an 80 GB
    H100's default budget (a dry run, inspect)."""
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: reads.append(device) or (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _device: 0)
    request = GpuRequest(torch.device("cuda", 0))
    first = request.context
    assert request.context is first and len(reads) == 1
    assert first.budget == first.plan_budget == 60 * GIB - gpu_budget.margin(80 * GIB)
    with pytest.raises(GpuMemoryError, match="more than cuda:0 has free"):
        _ = GpuRequest(torch.device("cuda", 0), 70 * GIB).context
    cpu = GpuRequest(torch.device("cpu")).context
    assert cpu.budget is None and cpu.plan_budget == (
        gpu_budget.REFERENCE_FREE - gpu_budget.margin(gpu_budget.REFERENCE_CARD))
    assert GpuRequest(torch.device("cpu"), 40 * GIB).context.plan_budget == 40 * GIB


def test_reap_data_and_its_conversion_share_one_gpu_context(tmp_path, monkeypatch):
    """reap --data: REAP's calibration (the stage's preparation) resolves the run's budget and
    the conversion after it takes the same GpuContext; it is not resolved again."""
    made = []

    @dataclass(frozen=True)
    class Counted(GpuContext):
        def __post_init__(self):
            made.append(self)

    monkeypatch.setattr(gpu_budget, "GpuContext", Counted)
    data = write_input_ids(tmp_path / "d.jsonl", (range(i, i + 16) for i in range(4)))
    api.reap(str(BUNDLED), str(tmp_path / "out"), data=str(data), keep=8, samples=4, seq_len=16,
             device="cpu")
    assert len(made) == 1


def test_the_cap_names_the_card_by_index_for_a_bare_cuda_device(monkeypatch):
    """`--device cuda` (no index) is the usual device: torch's per-process cap refuses it, so
    the cap, its release and the card's size must get the current card's index (a GPU-only
    path, checked here with torch.cuda's calls recorded instead of made)."""
    calls = []

    def needs_index(name):
        def call(*args):
            device = args[-1]
            assert isinstance(device, int), f"{name} got {device!r}"
            calls.append((name, *args))
            return type("P", (), {"total_memory": 80 << 30})()
        return call

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name in ("set_per_process_memory_fraction", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, needs_index(name))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *_: 1 << 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with GpuContext(torch.device("cuda"), 40 << 30, 40 << 30).enforced("calibrate"):
        pass
    assert [c[0] for c in calls] == ["get_device_properties", "set_per_process_memory_fraction",
                                     "set_per_process_memory_fraction"]
    assert calls[1][1] == 0.5 and calls[2][1] == 1.0
