"""`--json` on the conversion commands: one object on stdout that validates against the
committed schema (manifests/run-summary.schema.json), with the real output's numbers, and on
failure the error and a non-zero exit."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from helpers import MANIFEST, cli_subprocess
from kconvert.driver.run_summary import RunSummary
from kconvert.model.names import parse_name


def test_committed_run_summary_schema_is_current():
    committed = json.loads((ROOT / "manifests" / "run-summary.schema.json").read_text())
    assert committed == RunSummary.model_json_schema(), (
        "regenerate: python -m kconvert.driver.run_summary > manifests/run-summary.schema.json")


def test_json_summary_of_a_run(fixture_dir, tmp_path):
    src, dst = fixture_dir("k2-int4-kimi"), tmp_path / "out"
    done = cli_subprocess("dequant", src, dst, "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    summary = RunSummary.model_validate_json(done.stdout)  # the whole of stdout
    manifest = json.loads((dst / MANIFEST).read_text())
    assert summary.ok and summary.error is None and not summary.dry_run
    assert summary.output == str(dst)
    assert summary.bytes_written == sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    roles: dict[str, int] = {}
    for name in manifest["tensors"]:
        role = str(parse_name(name).role)
        roles[role] = roles.get(role, 0) + 1
    assert summary.tensors_by_role == roles
    assert summary.summary == manifest["summary"]
    assert {"total", "build_work_plan", "execute"} <= set(summary.timings)
    assert 0 < summary.timings["execute"] <= summary.timings["total"]


def test_json_summary_of_a_dry_run_and_of_a_failure(fixture_dir, tmp_path):
    src = fixture_dir("k2-int4-kimi")
    done = cli_subprocess("int4-to-nvfp4", src, tmp_path / "out", "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    summary = RunSummary.model_validate_json(done.stdout)
    assert summary.ok and summary.dry_run and summary.output is None
    assert "output format: compressed-tensors" in done.stderr  # the plan, off stdout
    assert not (tmp_path / "out").exists()

    done = cli_subprocess("dequant", tmp_path / "no-such-dir", tmp_path / "out2", "--json")
    assert done.returncode != 0
    summary = RunSummary.model_validate_json(done.stdout)
    assert not summary.ok and summary.output is None
    assert summary.error.startswith("source directory does not exist")
    assert "kconvert: error: source directory does not exist" in done.stderr


@pytest.mark.parametrize("bad, said", [
    (("--format", "nope"), "'nope' is not one of"),
    (("--gpu-memory", "lots"), "--gpu-memory"),
    (("--samples", "0"), "0 is not in the range x>=1"),
    (("--no-such-option",), "--no-such-option"),
])
def test_json_failure_of_a_usage_error(fixture_dir, tmp_path, bad, said):
    """click's usage errors (found while parsing, before the command runs) print the failure
    object too, with exit_code 2, and click's usage message on stderr."""
    done = cli_subprocess("quantize", fixture_dir("k2-int4-kimi"), tmp_path / "out", "--json",
                          *bad)
    assert done.returncode == 2, done.stderr
    summary = RunSummary.model_validate_json(done.stdout)
    assert not summary.ok and summary.exit_code == 2 and summary.command == "quantize"
    assert said in summary.error
    assert "Usage: " in done.stderr and said in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, said", [
    (("--chunk-mb", "0"), "0 is not in the range 1<=x<=1024"),
    (("--gpu-memory", "lots"), "--gpu-memory"),
    (("--no-such-option",), "--no-such-option"),
])
def test_json_failure_of_an_audit_usage_error(fixture_dir, bad, said):
    done = cli_subprocess("audit", fixture_dir("k2-int4-kimi"), "--json", *bad)
    assert done.returncode == 2, done.stderr
    failure = json.loads(done.stdout)
    assert failure["ok"] is False and failure["exit_code"] == 2 and said in failure["error"]
    assert "Usage: " in done.stderr


def test_json_failure_carries_the_exit_code(fixture_dir, tmp_path):
    """A failure during the run: its exit status in the object."""
    done = cli_subprocess("dequant", tmp_path / "no-such-dir", tmp_path / "out", "--json")
    assert done.returncode == 1
    assert RunSummary.model_validate_json(done.stdout).exit_code == 1
