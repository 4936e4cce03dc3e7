"""The audit of a pruned Kimi-K3 (`reap --plan` on the K3-shaped fixture): K3 counts its routed
experts in `text_config.num_experts` (kconvert.model.arch), and under --source a pruned
output's count is the kept count, not a mismatch with the source's."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import assert_audit_passes, audit_json, cli_inproc, edit_json

KEEP = [0, 2, 3, 5, 8, 9, 12, 15]  # of the fixture's 16 experts per MoE layer


@pytest.fixture(scope="module")
def pruned(fixture_dir, tmp_path_factory):
    src = fixture_dir("k3-mxfp4", moe_layers=3)
    root = tmp_path_factory.mktemp("k3-reap")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"layers": {str(layer): {"keep": KEEP} for layer in (1, 2, 3)}}))
    out = root / "out"
    res = cli_inproc("reap", src, out, "--plan", plan, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    return src, out


def test_a_pruned_k3_passes_its_audit_against_the_source(pruned):
    src, out = pruned
    assert json.loads((out / "config.json").read_text())["text_config"]["num_experts"] == 8
    assert_audit_passes(out)
    assert_audit_passes(out, "--source", src)


def test_a_pruned_k3_whose_config_keeps_the_source_count_fails(pruned, tmp_path):
    """The kept count is checked, not skipped: a config that still says 16 experts fails both
    against the manifest's record and against the source."""
    src, out = pruned
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    edit_json(bad / "config.json", lambda c: c["text_config"].update(num_experts=16))
    code, report = audit_json(bad, "--source", src)
    said = {(f["check"], f["message"]) for f in report["failures"]}
    assert code == 1
    assert ("keep", "manifest records keep=8 but num_experts is 16") in said, said
    assert ("config", "config text_config.num_experts = 16, but CKPT keeps 8 of the source's "
            "16 experts per layer") in said, said
