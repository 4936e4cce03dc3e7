"""Checks that come before any work, and what a run says about itself, as a new user meets
them: a locked DST is refused before REAP's calibration; `calibrate -o` and `eval -o` inside
SRC or on a read-only file system are refused up front; a --format of the other grid names the
command that writes it; a dry run on the CPU with a small --gpu-memory plans but does not
refuse; a --resume of a different run says what differs; a failed --json reports the bytes on
disk; `audit --source` with another checkpoint than the one the output was made from fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import Result

from conftest import BUNDLED, ROOT
from helpers import (
    assert_audit_passes,
    assert_user_error,
    audit_json,
    cli_inproc,
    edit_tensor,
    write_input_ids,
)
from kconvert.common import events
from kconvert.errors import KconvertError
from kconvert.io import lock
from tmpfs import small_fs

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


@pytest.fixture
def no_calibration(monkeypatch):
    """Fails the test if a calibration pass starts."""
    from kconvert.calibrate import run

    def never(*_args, **_kwargs):
        raise AssertionError("the calibration ran")

    monkeypatch.setattr(run, "measure_stats", never)


def _data(tmp_path: Path) -> Path:
    return write_input_ids(tmp_path / "d.jsonl", [[(7 * i + j) % 250 for j in range(16)]
                                                  for i in range(4)])


def test_a_locked_dst_is_refused_before_reaps_calibration(tmp_path, no_calibration):
    dst = tmp_path / "out"
    with lock.locked(dst, print):
        res = cli_inproc("reap", TINY_MOE, dst, "--data", _data(tmp_path), "--keep", 12,
                         "--samples", 4, "--seq-len", 16, "--compensate", "down", "--device",
                         "cpu")
    assert_user_error(res, "another kconvert run is writing into DST")


@pytest.mark.parametrize("command", ["calibrate", "eval"])
def test_an_output_directory_inside_src_is_refused_up_front(tmp_path, no_calibration,
                                                            command):
    src = Path(shutil.copytree(TINY_MOE, tmp_path / "src"))
    data = _data(tmp_path)
    args = {"calibrate": ["calibrate", src], "eval": ["eval", src, src]}[command]
    res = cli_inproc(*args, "--data", data, "-o", src / "out", "--samples", 4, "--seq-len", 16,
                     "--device", "cpu")
    assert_user_error(res, f"must not be {src}, inside it")
    assert not (src / "out").exists()


@pytest.mark.parametrize("command", ["calibrate", "eval"])
def test_a_read_only_output_directory_is_refused_up_front(tmp_path, command):
    data = _data(tmp_path)
    args = {"calibrate": ["calibrate", TINY_MOE], "eval": ["eval", TINY_MOE, TINY_MOE]}[command]
    with small_fs(tmp_path / "ro", "ro,size=1m") as fs:
        done = fs.kconvert(*args, "--data", data, "-o", fs.path / "out", "--samples", 4,
                           "--seq-len", 16, "--device", "cpu", "-v")
    assert_user_error(done, "is on a read-only file system")
    assert "phase model code" not in done.stderr  # refused before the model code loads


@pytest.mark.parametrize("command,fmt,right", [
    ("int4-to-mxfp4", "compressed-tensors", "int4-to-nvfp4"),
    ("int4-to-mxfp4", "modelopt", "int4-to-nvfp4"),
    ("int4-to-nvfp4", "quark-mxfp4", "int4-to-mxfp4"),
    ("int4-to-nvfp4", "mxfp4-pack-quantized", "int4-to-mxfp4"),
])
def test_a_format_of_the_other_grid_names_the_command_that_writes_it(tmp_path, command, fmt,
                                                                     right):
    res = cli_inproc(command, BUNDLED, tmp_path / "out", "--format", fmt)
    assert_user_error(res, f"--format {fmt} writes", f"run `kconvert {right} --format {fmt}`",
                      code=2)
    assert not (tmp_path / "out").exists()


def test_a_dry_run_on_the_cpu_plans_a_small_gpu_budget_without_refusing(tmp_path):
    data = _data(tmp_path)
    res = cli_inproc("sparsify", BUNDLED, tmp_path / "out", "--method", "sparsegpt", "--data",
                     data, "--samples", 4, "--seq-len", 16, "--gpu-memory", "0.5GiB",
                     "--device", "cpu", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "note: on a GPU with a 512.0 MiB budget this run would not fit" in res.output
    assert "sparsify needs at least" in res.output


def stopped_after_first_shard(*args) -> Result:
    """`kconvert ARGS` in this process, failed by an error raised once its first shard is done."""
    def stop(event, _info):
        if event == "shard-done":
            raise KconvertError("stopped after the first shard")

    unsubscribe = events.subscribe(stop)
    try:
        return cli_inproc(*args)
    finally:
        unsubscribe()


def test_a_resume_of_another_run_says_what_differs(tmp_path):
    dst = tmp_path / "out"
    res = stopped_after_first_shard("int4-to-nvfp4", BUNDLED, dst, "--device", "cpu", "--quiet")
    assert_user_error(res, "stopped after the first shard")
    res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--block-scale", "amax", "--resume",
                     "--device", "cpu", "--quiet")
    assert_user_error(res, "--resume: DST was started by a different command",
                      "options.quantize.block_scale: mse then, amax now")


def test_a_failed_json_run_reports_the_bytes_on_disk(tmp_path):
    dst = tmp_path / "out"
    res = stopped_after_first_shard("int4-to-nvfp4", BUNDLED, dst, "--device", "cpu", "--json")
    assert res.exit_code == 1
    summary = json.loads(res.stdout)
    assert summary["ok"] is False and "stopped after the first shard" in summary["error"]
    finished = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    partial = sum(p.stat().st_size for p in (dst / ".kconvert" / "partial").glob("*"))
    assert finished > 0 and finished <= summary["bytes_written"] <= finished + partial


def test_audit_source_refuses_another_checkpoint_and_notes_a_moved_copy(tmp_path):
    out = tmp_path / "out"
    assert cli_inproc("int4-to-nvfp4", BUNDLED, out, "--device", "cpu", "--quiet"
                      ).exit_code == 0
    copy = Path(shutil.copytree(BUNDLED, tmp_path / "copy"))
    report = assert_audit_passes(out, "--source", copy)
    assert any("has the same content" in n for n in report["notes"]), report["notes"]
    # another checkpoint: one INT4 scale of a routed expert a step higher in BF16, a change
    # the output's decode bounds alone would let through
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale"
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    edit_tensor(copy / index[name], name, lambda t: t * 1.0078125)  # one BF16 step up
    code, report = audit_json(out, "--source", copy)
    assert code == 1
    found = [f for f in report["failures"] if f["check"] == "source"]
    assert found and "is not the checkpoint this output was made from" in found[0]["message"]
