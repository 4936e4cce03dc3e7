"""The spill of `reap --data --compensate` (re-fitted matrices under DST/.kconvert/refit) is
removed on every exit path: a finished run, an error while calibrating (bad data found after a
layer was spilled), an error in the conversion that follows, and Ctrl-C in either. Each case
first sees a layer's matrices spilled, so a test cannot pass on a run that never spilled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers import cli_inproc, write_input_ids
from kconvert.cli.base import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from kconvert.driver import run_plan
from kconvert.errors import KconvertError
from kconvert.io.lock import STATE_DIR
from kconvert.io.output_dir import REFIT_DIR
from kconvert.pruning import recode
from kconvert.testing.tiny_moe import corpus_ids, windows

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
REAP = ["--keep", "12", "--samples", "12", "--seq-len", "64", "--device", "cpu",
        "--compensate", "down", "--quiet"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    ids = windows(corpus_ids("train"), 12, 64, torch.Generator().manual_seed(3))
    return write_input_ids(tmp_path_factory.mktemp("spill") / "calib.jsonl", ids)


def _watch_spills(monkeypatch) -> list[Path]:
    """The spill files the run writes, as it writes them."""
    written: list[Path] = []
    spilled = recode.spilled

    def watched(spill, layer, tensors):
        out = spilled(spill, layer, tensors)
        if spill is not None:
            written.append(spill / f"layer-{layer}.pt")
            assert written[-1].is_file()
        return out

    monkeypatch.setattr(recode, "spilled", watched)
    return written


def _assert_no_spill(dst: Path, written: list[Path]) -> None:
    assert written, "the run spilled nothing: the case does not test the clean-up"
    assert not any(p.exists() for p in written)
    assert not (dst / STATE_DIR / REFIT_DIR).exists()


def test_a_finished_run_leaves_no_spill(data, tmp_path, monkeypatch):
    written = _watch_spills(monkeypatch)
    dst = tmp_path / "out"
    res = cli_inproc("reap", SRC, dst, "--data", data, *REAP)
    assert res.exit_code == 0, res.output
    _assert_no_spill(dst, written)
    assert not (dst / STATE_DIR).exists()


@pytest.mark.parametrize("raised, code", [(KconvertError, EXIT_BAD_INPUT),
                                          (KeyboardInterrupt, EXIT_INTERRUPTED)],
                         ids=["error", "interrupt"])
@pytest.mark.parametrize("where", ["calibration", "conversion"])
def test_a_run_that_stops_leaves_no_spill(data, tmp_path, monkeypatch, where, raised, code):
    """Stopped after the first spill (non-finite hidden states in a later layer's inputs, or
    Ctrl-C), or in the conversion after the calibration finished."""
    written = _watch_spills(monkeypatch)
    if where == "calibration":
        spill_then_stop = recode.spilled

        def stop_after_spilling(spill, layer, tensors):
            spilled = spill_then_stop(spill, layer, tensors)
            if written:
                raise raised("non-finite hidden states after decoder layer 2")
            return spilled

        monkeypatch.setattr(recode, "spilled", stop_after_spilling)
    else:
        def stop_planning(*_args, **_kwargs):
            assert written and all(p.exists() for p in written)  # the spill is still in use
            raise raised("the conversion stopped")

        monkeypatch.setattr(run_plan, "build_work_plan", stop_planning)
    dst = tmp_path / "out"
    res = cli_inproc("reap", SRC, dst, "--data", data, *REAP)
    assert res.exit_code == code, res.output
    _assert_no_spill(dst, written)
