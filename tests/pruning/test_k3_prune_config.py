"""Pruning Kimi-K3 (`reap --plan` on the K3-shaped fixture, given group-limited routing as
DeepSeek-V3 releases ship it: 4 expert groups, top-2 groups) rewrites K3's own routing keys:
`num_experts` to the kept count and `num_expert_group` / `topk_group` to one group; no
DeepSeek-V3 key (`n_routed_experts`, `n_group`, ...) appears, every other key but the
quantization_config is the source's, and the audit against the source passes."""

from __future__ import annotations

import json
import shutil

from helpers import assert_audit_passes, cli_inproc, edit_json

KEEP = [1, 2, 4, 7, 8, 11, 13, 14]  # of the fixture's 16 experts per MoE layer
DEEPSEEK_KEYS = {"n_routed_experts", "n_group", "num_experts_per_tok", "n_shared_experts"}


def test_pruning_rewrites_k3s_own_routing_keys(fixture_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("k3-mxfp4", moe_layers=3), src)
    edit_json(src / "config.json",
              lambda c: c["text_config"].update(num_expert_group=4, topk_group=2))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {str(layer): {"keep": KEEP} for layer in (1, 2, 3)}}))
    out = tmp_path / "out"
    res = cli_inproc("reap", src, out, "--plan", plan, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    before = json.loads((src / "config.json").read_text())["text_config"]
    after = json.loads((out / "config.json").read_text())["text_config"]
    assert (after["num_experts"], after["num_expert_group"], after["topk_group"]) == (8, 1, 1)
    assert not DEEPSEEK_KEYS & after.keys(), DEEPSEEK_KEYS & after.keys()
    assert after.keys() == before.keys()
    changed = {k for k in before if before[k] != after[k]} - {"quantization_config"}
    assert changed == {"num_experts", "num_expert_group", "topk_group"}, changed
    assert_audit_passes(out, "--source", src)
