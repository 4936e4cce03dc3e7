"""A torchrun rank's `--device cuda` is its own GPU by index: CUDA's current device belongs to a
thread, and a thread other than the main one starts on GPU 0 (two ranks' reader and
calibration threads shared GPU 0 and ran out of memory there)."""

from __future__ import annotations

import pytest
import torch

from kconvert.common import distributed
from kconvert.gpu import devices


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine with two GPUs whose main thread's current device is GPU 1 (rank 1's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(distributed, "init", lambda: None)


@pytest.mark.parametrize("spec", ["cuda", "auto"])
def test_a_rank_names_its_gpu_by_index(two_gpus, monkeypatch, spec):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert devices.pick_device(spec) == torch.device("cuda", 1)


def test_an_explicit_index_and_a_plain_process_are_left_as_given(two_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert devices.pick_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.delenv("WORLD_SIZE")
    assert devices.pick_device("cuda") == torch.device("cuda")
