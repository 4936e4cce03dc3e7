"""What `reap --data --compensate` leaves on disk and says, as a new user meets it: the spill of
re-fitted matrices lives in DST's state folder (DST/.kconvert/refit) and is gone when the run
ends, however it ends (an error, SIGTERM: exit 143 with the --resume hint); what a killed run
left there is removed by --resume or --overwrite; a DST inside SRC is refused before any work
(nothing is written into SRC); a full disk while spilling is one line, exit 1; a dry run
calibrates nothing, creates nothing and lists the re-fitted tensors as `refit`; the summary
and --json say whether the guard applied or refused the repair and the compensation."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers import (
    assert_audit_passes,
    assert_user_error,
    cli_inproc,
    snapshot,
    write_input_ids,
)
from kconvert.io.lock import STATE_DIR
from kconvert.io.output_dir import REFIT_DIR
from kconvert.pruning.plan import PLAN_FILE, load_plan
from kconvert.testing.tiny_moe import corpus_ids, windows
from tmpfs import small_fs

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
REAP = ["--keep", "12", "--samples", "12", "--seq-len", "64", "--device", "cpu"]

# Runs the command line as `kconvert` runs it, with `signal` sent to itself (SIGTERM: as
# `timeout` or Slurm would; SIGKILL: as the OOM killer would) once layer `layer`'s re-fitted
# matrices are spilled.
SIGNALLED = """
import os, signal, sys
from kconvert.cli import run
from kconvert.pruning import recode
layer, number = int(sys.argv[1]), int(sys.argv[2])
spilled = recode.spilled
def spill_then_signal(spill, at, tensors):
    out = spilled(spill, at, tensors)
    if at == layer:
        os.kill(os.getpid(), number)
    return out
recode.spilled = spill_then_signal
sys.argv = ["kconvert", *sys.argv[3:]]
run()
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    ids = windows(corpus_ids("train"), 12, 64, torch.Generator().manual_seed(3))
    return write_input_ids(tmp_path_factory.mktemp("spill") / "calib.jsonl", ids)


def _spilled_layer(data: Path, tmp: Path) -> int:
    """The first layer whose compensation the guard applies here (so it spills): layer 1, by a
    wide margin (held-out MSE 0.353 -> 0.257, 27%; layers 2-3: 30%, 20%)."""
    res = cli_inproc("reap", SRC, tmp / "probe", "--data", data, *REAP, "--compensate", "down",
                     "--quiet")
    assert res.exit_code == 0, res.output
    plan = load_plan(tmp / "probe" / PLAN_FILE)
    return min(int(k) for k, v in plan.layers.items() if v.compensation.applied)


def _signalled(number: int, layer: int, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGNALLED, str(layer), str(number),
                           *map(str, args)], capture_output=True, text=True, timeout=600)


def test_sigterm_ends_the_run_as_ctrl_c_does_and_leaves_no_spill(data, tmp_path):
    layer = _spilled_layer(data, tmp_path)
    dst = tmp_path / "out"
    args = ["reap", SRC, dst, "--data", data, *REAP, "--compensate", "down", "--quiet"]
    done = _signalled(signal.SIGTERM, layer, *args)
    assert done.returncode == 143, done.stderr[-2000:]
    assert "kconvert: terminated (SIGTERM)" in done.stderr and "--resume" in done.stderr
    assert "Traceback" not in done.stderr
    assert not dst.exists() or not any(dst.rglob("layer-*.pt"))  # the spill is gone
    res = cli_inproc(*args[:3], *args[3:], "--resume")
    assert res.exit_code == 0, res.output
    assert not (dst / STATE_DIR).exists()
    assert_audit_passes(dst, "--source", SRC)


@pytest.mark.parametrize("again", ["--resume", "--overwrite"])
def test_a_killed_runs_spill_is_removed_by_resume_and_overwrite(data, tmp_path, again):
    layer = _spilled_layer(data, tmp_path)
    dst = tmp_path / "out"
    args = ["reap", SRC, dst, "--data", data, *REAP, "--compensate", "down", "--quiet"]
    done = _signalled(signal.SIGKILL, layer, *args)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    spill = dst / STATE_DIR / REFIT_DIR
    assert (spill / f"layer-{layer}.pt").is_file()  # what SIGKILL leaves behind
    assert not any(p.name.startswith(".kconvert-refit") for p in tmp_path.iterdir())
    assert_user_error(cli_inproc(*args), "DST is not empty", "--resume")
    res = cli_inproc(*args, again)
    assert res.exit_code == 0, res.output
    assert f"removing the re-fitted matrices an interrupted run left in {spill}" in res.output
    assert not spill.exists() and not (dst / STATE_DIR).exists()
    assert_audit_passes(dst, "--source", SRC)


def test_dst_inside_src_is_refused_before_any_work(data, tmp_path, monkeypatch):
    """The run was refused only after its calibration, which spilled beside DST: into SRC."""
    from kconvert.calibrate import run

    def watched(*_args, **_kwargs):
        raise AssertionError(f"the calibration ran; SRC then held {sorted(snapshot(src))}")

    monkeypatch.setattr(run, "measure_stats", watched)
    src = Path(shutil.copytree(SRC, tmp_path / "src"))
    before = snapshot(src)
    res = cli_inproc("reap", src, src / "pruned", "--data", data, *REAP, "--compensate", "down")
    assert_user_error(res, "DST must not be SRC, inside it")
    assert snapshot(src) == before


def test_a_full_disk_while_spilling_is_one_line(data, tmp_path):
    """A tmpfs that holds one layer's re-fitted matrices (13 BF16 [128, 64] down_proj, 213 kB)
    but not two."""
    with small_fs(tmp_path / "small", "size=300k") as fs:
        dst = fs.path / "out"
        done = fs.kconvert("reap", SRC, dst, "--data", data, *REAP, "--compensate", "down",
                           "--quiet")
        assert_user_error(done, "the disk filled up while spilling", "free space")
        assert len([ln for ln in done.stderr.splitlines() if ln.strip()]) == 1, done.stderr
        assert not fs.exists(dst / STATE_DIR / REFIT_DIR)


@pytest.mark.parametrize(("compensate", "projs"), [("down", 1), ("learned", 3)])
def test_dry_run_calibrates_nothing_and_lists_the_refit_tensors(data, tmp_path, monkeypatch,
                                                                compensate, projs):
    from kconvert.calibrate import run

    def never(*_args, **_kwargs):
        raise AssertionError("a dry run calibrated")

    monkeypatch.setattr(run, "measure_stats", never)
    dst = tmp_path / "out"
    res = cli_inproc("reap", SRC, dst, "--data", data, *REAP, "--repair", "router",
                     "--compensate", compensate, "--dry-run")
    assert res.exit_code == 0, res.output
    assert not dst.exists()
    # the run re-fits 12 kept experts' down_proj (learned: and gate_proj, up_proj) and the
    # shared expert's down_proj in layers 1-3 (one BF16 weight each), and repairs every router
    # (gate rows and bias)
    refit = [ln.split() for ln in res.output.splitlines() if "refit" in ln.split()]
    assert {f[0]: int(f[-3]) for f in refit} == {"routed_expert": 3 * 12 * projs,
                                                 "shared_expert": 3}, res.output
    rows = {f[0] for f in (ln.split() for ln in res.output.splitlines()) if "repair-rows" in f}
    assert rows == {"router_weight", "router_bias"}, res.output
    assert "the plan below keeps the first 12" in res.output


def test_summary_and_json_say_what_the_guard_did(data, tmp_path):
    res = cli_inproc("reap", SRC, tmp_path / "a", "--data", data, *REAP, "--repair", "router",
                     "--compensate", "down", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    plan = load_plan(tmp_path / "a" / PLAN_FILE)
    for what, key in (("repair", "repair"), ("compensation", "compensation")):
        applied = sum(getattr(v, key).applied for v in plan.layers.values())
        assert summary["summary"][f"{what}_applied_layers"] == applied
        assert summary["summary"][f"{what}_refused_layers"] == len(plan.layers) - applied
    assert summary["timings"]["prepare"] > 0  # the calibration, before the conversion
    res = cli_inproc("reap", SRC, tmp_path / "b", "--data", data, *REAP, "--compensate", "down")
    assert res.exit_code == 0, res.output
    assert "compensation applied in " in res.output and " of 3 MoE layers" in res.output
    assert "learned compensation" not in res.output
    res = cli_inproc("reap", SRC, tmp_path / "c", "--data", data, *REAP, "--compensate",
                     "learned", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)["summary"]
    plan = load_plan(tmp_path / "c" / PLAN_FILE)
    applied = sum(v.compensation.learned.applied for v in plan.layers.values())
    assert (summary["learned_applied_layers"], summary["learned_refused_layers"]) == (
        applied, len(plan.layers) - applied)


def test_compensate_and_repair_without_data_say_they_need_it(tmp_path):
    """It used to say only "give --data FILE, --stats DIR or --plan FILE" (or that --keep
    needs one of them)."""
    for flags in (["--compensate", "down"], ["--repair", "bias"]):
        for source in ([], ["--stats", tmp_path]):
            res = cli_inproc("reap", SRC, tmp_path / "o", "--keep", "12", *source, *flags)
            assert_user_error(res, f"{flags[0]} applies only with --data", code=2)

