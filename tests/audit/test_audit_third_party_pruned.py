"""`kconvert audit`: pruned checkpoints made by a third-party script are audited against
their source, with the plan or with the mapping inferred from router rows."""

from __future__ import annotations

import json

import torch
from audit_support import INDEX, assert_named, copy, rewrite_shard, run, tensor

from helpers import audit_json

# The fixture `pruned` (a third-party pruned checkpoint and its plan), built once for all
# the audit test modules.
pytest_plugins = ["audit_fixtures"]


# ------------------------------------------------------------------ 3. third-party pruning


def test_third_party_pruned_checkpoint_with_plan(pruned):
    out, src, plan_path, plan = pruned
    assert not (out / "kconvert-manifest.json").exists()
    code, rep = audit_json(out, "--source", str(src), "--plan", str(plan_path))
    assert code == 0, rep["failures"]
    for layer, entry in plan["layers"].items():
        assert rep["mapping"][layer] == {"mode": "plan", "source_ids": entry["keep"]}
        assert rep["layers"][layer]["experts"] == "8/16"
    assert any("taken from the plan" in n for n in rep["notes"])
    # Independently: the pruned router rows are the plan's source rows.
    for layer, entry in plan["layers"].items():
        name = f"model.layers.{layer}.mlp.gate.weight"
        assert torch.equal(tensor(out, name), tensor(src, name)[entry["keep"]])
    # Alone, the pruned checkpoint is structurally sound.
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]


def test_third_party_pruned_checkpoint_without_plan_infers_mapping(pruned):
    out, src, _, plan = pruned
    code, rep = audit_json(out, "--source", str(src))
    assert code == 0, rep["failures"]
    for layer, entry in plan["layers"].items():
        assert rep["mapping"][layer] == {"mode": "inferred", "source_ids": entry["keep"]}
    assert any("INFERRED by matching router rows" in n for n in rep["notes"])


def test_wrong_plan_is_caught(pruned, tmp_path):
    out, src, _, plan = pruned
    keep = plan["layers"]["2"]["keep"]
    dropped = next(e for e in range(16) if e not in keep)
    wrong_keep = sorted([*keep[:3], dropped, *keep[4:]])
    position = wrong_keep.index(dropped)
    wrong = {"criterion": "oops", "layers": {**plan["layers"], "2": {"keep": wrong_keep}}}
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(wrong))
    code, rep = audit_json(out, "--source", str(src), "--plan", str(path))
    assert code == 1
    assert_named(rep, "source", "router", layer=2, tensor="model.layers.2.mlp.gate.weight",
                 text=f"row {position} differs from source row {dropped} chosen by the plan")
    assert all(f["layer"] == 2 for f in rep["failures"])
    # A plan keeping the wrong number of experts is named too.
    short = {"layers": {**plan["layers"], "1": {"keep": plan["layers"]["1"]["keep"][:6]}}}
    path.write_text(json.dumps(short))
    _, rep = audit_json(out, "--source", str(src), "--plan", str(path))
    assert_named(rep, "source", "plan", layer=1, text="the plan keeps 6 experts")


def test_pruned_then_converted_against_original_source(pruned, tmp_path):
    """Prune (third party) -> int4-to-nvfp4 (kconvert): kept experts decode within the
    manifest's error of the ORIGINAL source's experts the plan chose."""
    out, src, plan_path, _ = pruned
    conv = run(out, tmp_path / "conv", "int4-to-nvfp4")
    code, rep = audit_json(conv, "--source", str(src), "--plan", str(plan_path))
    assert code == 0, rep["failures"]
    assert rep["layers"]["1"]["compared"] == 8 * 3
    # And against the wrong expert it would not be.
    wrong = json.loads(plan_path.read_text())
    keep = wrong["layers"]["1"]["keep"]
    other = next(e for e in range(16) if e not in keep)
    wrong["layers"]["1"]["keep"] = sorted([*keep[1:], other])
    pos = wrong["layers"]["1"]["keep"].index(other)
    (tmp_path / "w.json").write_text(json.dumps(wrong))
    _, rep = audit_json(conv, "--source", str(src), "--plan", str(tmp_path / "w.json"))
    assert_named(rep, "source", "decode", layer=1, tensor=f"model.layers.1.mlp.experts.{pos}.",
                 text=f"source decode of model.layers.1.mlp.experts.{other}.")


def test_unaccounted_source_tensor(pruned, tmp_path):
    out, src, plan_path, _ = pruned
    bad = copy(out, tmp_path / "pruned")
    name = "model.layers.1.self_attn.kv_a_layernorm.weight"
    shard = json.loads((bad / INDEX).read_text())["weight_map"][name]
    rewrite_shard(bad, shard, lambda t: {k: v for k, v in t.items() if k != name})
    _, rep = audit_json(bad, "--source", str(src), "--plan", str(plan_path))
    assert_named(rep, "source", "accounting", layer=1, tensor=name,
                 text="source tensor has no counterpart")
