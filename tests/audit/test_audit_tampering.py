"""`kconvert audit`: every tampering with tensors, the index, the files or the scales of a
checkpoint is caught and named (layer, tensor, file).

Tampering is done with plain file I/O (headers parsed here with struct + json, bytes patched in
place) or safetensors, never with kconvert's own readers, and expectations come from the
tampering itself (which layer/tensor/row was touched), never from a previous audit run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from audit_support import (
    INDEX,
    assert_named,
    copy,
    failures,
    locate,
    read_raw,
    rewrite_shard,
    tensor,
    write_raw,
)
from safetensors.torch import save_file

from helpers import audit_json

# The fixtures `outputs` (every command and recipe on the fixtures) and `pruned` (a
# third-party pruned checkpoint and its plan), built once for all the audit test modules.
pytest_plugins = ["audit_fixtures"]


# ------------------------------------------------------------------ 2. tampering


def test_flipped_byte_in_kept_router_row(pruned, outputs, tmp_path):
    out, src, plan_path, plan = pruned
    bad = copy(out, tmp_path / "pruned")
    name = "model.layers.1.mlp.gate.weight"
    raw = bytearray(read_raw(bad, name))
    row_bytes = len(raw) // 8
    raw[3 * row_bytes + 17] ^= 0x01  # row 3, one byte
    write_raw(bad, name, bytes(raw))
    code, rep = audit_json(bad, "--source", str(src), "--plan", str(plan_path))
    assert code == 1
    f = assert_named(rep, "source", "router", layer=1, tensor=name,
                     text=f"row 3 differs from source row {plan['layers']['1']['keep'][3]}")
    assert len(failures(rep, "source", "router")) == 1, f
    # Without a plan the row can no longer be matched to any source row.
    _, rep = audit_json(bad, "--source", str(src))
    assert_named(rep, "source", "router", layer=1, tensor=name, text="row 3 equals no source")

    # In a kconvert output the manifest's hash catches it even without the source.
    out2 = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    raw = bytearray(read_raw(out2, name))
    raw[5 * (len(raw) // 16)] ^= 0x80
    write_raw(out2, name, bytes(raw))
    _, rep = audit_json(out2)
    assert_named(rep, "manifest", "hash", layer=1, tensor=name)


def test_one_bias_entry_changed(pruned, tmp_path):
    out, src, plan_path, plan = pruned
    bad = copy(out, tmp_path / "pruned")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    b = tensor(bad, name).clone()
    b[5] += 1e-3
    write_raw(bad, name, b.numpy().tobytes())
    code, rep = audit_json(bad, "--source", str(src), "--plan", str(plan_path))
    assert code == 1
    kept = plan["layers"]["2"]["keep"][5]
    assert_named(rep, "source", "bias", layer=2, tensor=name,
                 text=f"entry 5 = {float(b[5])!r} but source entry {kept}")
    assert len(rep["failures"]) == 1


def _swap_experts(ckpt: Path, layer: int, a: int, b: int) -> list[str]:
    names = [n for n in json.loads((ckpt / INDEX).read_text())["weight_map"]
             if f"layers.{layer}.mlp.experts.{a}." in n]
    for na in names:
        nb = na.replace(f".experts.{a}.", f".experts.{b}.")
        ra, rb = read_raw(ckpt, na), read_raw(ckpt, nb)
        write_raw(ckpt, na, rb)
        write_raw(ckpt, nb, ra)
    return names


def test_two_experts_swapped(outputs, pruned, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    src = outputs["int4-to-nvfp4-ct"][1]
    names = _swap_experts(out, 2, 3, 5)
    _, rep = audit_json(out)
    for n in names:  # every swapped tensor named, both ways
        assert_named(rep, "manifest", "hash", layer=2, tensor=n)
        assert_named(rep, "manifest", "hash", layer=2, tensor=n.replace(".3.", ".5."))
    # No manifest: against the source every decode of experts 3 and 5 is far off.
    (out / "kconvert-manifest.json").unlink()
    _, rep = audit_json(out, "--source", str(src))
    for e in (3, 5):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert_named(rep, "source", "decode", layer=2,
                         tensor=f"model.layers.2.mlp.experts.{e}.{proj}.weight_packed",
                         text=f"source decode of model.layers.2.mlp.experts.{e}.{proj}")
    assert len(failures(rep, "source", "decode")) == 6
    # Same format (pruned INT4): byte comparison names them.
    bad = copy(pruned[0], tmp_path / "pruned")
    _swap_experts(bad, 1, 0, 6)
    _, rep = audit_json(bad, "--source", str(pruned[1]), "--plan", str(pruned[2]))
    assert_named(rep, "source", "bytes", layer=1, tensor="model.layers.1.mlp.experts.0.",
                 text="must be byte-identical")
    assert_named(rep, "source", "bytes", layer=1, tensor="model.layers.1.mlp.experts.6.")


def test_expert_id_gap(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    shard = json.loads((out / INDEX).read_text())["weight_map"]["model.layers.1.mlp.gate.weight"]
    rewrite_shard(out, shard, lambda t: {k.replace("layers.1.mlp.experts.7.",
                                                   "layers.1.mlp.experts.16."): v
                                         for k, v in t.items()})
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "structure", "expert-ids", layer=1, text="missing 7; unexpected 16")
    assert rep["layers"]["1"]["ids"] == "gap: 7"


def test_stale_index_entry(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    index = json.loads((out / INDEX).read_text())
    wm = index["weight_map"]
    moved = "model.layers.1.self_attn.o_proj.weight"
    right = wm[moved]
    wrong = wm["model.layers.2.mlp.gate.weight"]
    wm[moved] = wrong
    wm["model.layers.1.mlp.experts.16.up_proj.weight_packed"] = right  # pruned long ago
    (out / INDEX).write_text(json.dumps(index))
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "structure", "index", layer=1, tensor=moved, file=wrong,
                 text=f"maps it to {wrong} but it is in {right}")
    assert_named(rep, "structure", "index", layer=1,
                 tensor="model.layers.1.mlp.experts.16.up_proj.weight_packed", file=right,
                 text="does not hold it")


def test_files_nothing_accounts_for(outputs, tmp_path):
    """With a manifest: an unknown file warns, an unknown *.safetensors fails (indexed or not,
    at the top or below); kconvert's temporary names fail with or without a manifest."""
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    (out / "notes.txt").write_text("mine")
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    assert any(w["check"] == "non-weight" and w["file"] == "notes.txt" for w in rep["warnings"])
    extra = {"extra.safetensors", "sub/more.safetensors"}
    for rel in extra:
        (out / rel).parent.mkdir(exist_ok=True)
        save_file({"w": torch.zeros(2)}, str(out / rel))
    temps = {"tokenizer_config.json.kconvert-tmp", "kconvert-manifest.json.tmp"}
    for rel in temps:
        (out / rel).write_text("{}")
    code, rep = audit_json(out)
    assert code == 1
    assert {f["file"] for f in failures(rep, "manifest", "files")} == extra
    assert {f["file"] for f in failures(rep, "structure", "incomplete")} == temps
    assert len(rep["failures"]) == len(extra) + len(temps), rep["failures"]
    # Without a manifest nothing says what belongs; the temporaries still fail.
    (out / "kconvert-manifest.json").unlink()
    code, rep = audit_json(out)
    assert code == 1
    assert {f["file"] for f in rep["failures"]} == temps, rep["failures"]


def test_tensor_missing_from_a_shard(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    name = "model.layers.2.mlp.experts.4.up_proj.weight_scale"
    shard = json.loads((out / INDEX).read_text())["weight_map"][name]
    rewrite_shard(out, shard, lambda t: {k: v for k, v in t.items() if k != name},
                  update_index=False)
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "structure", "index", layer=2, tensor=name, file=shard,
                 text="tensor missing from its shard")
    assert_named(rep, "structure", "experts", layer=2,
                 tensor="model.layers.2.mlp.experts.4.up_proj", text="missing ['weight_scale']")


def test_n_routed_experts_edited(outputs, tmp_path):
    out = copy(outputs["k25-int4-to-nvfp4-ct"][0], tmp_path / "k25")
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["n_routed_experts"] = 15
    (out / "config.json").write_text(json.dumps(cfg))
    code, rep = audit_json(out)
    assert code == 1
    for layer in (1, 2):
        assert_named(rep, "structure", "counts", layer=layer,
                     tensor=f"language_model.model.layers.{layer}.mlp.gate.weight",
                     text="n_routed_experts = 15, expert ids = 16, router rows = 16")
        assert_named(rep, "structure", "expert-ids", layer=layer, text="unexpected 15")
    # The manifest records config.json's hash: the edit is caught there too.
    assert_named(rep, "manifest", "generated", file="config.json")


@pytest.mark.parametrize("name,param", [("int4-to-nvfp4-ct", "weight_global_scale"),
                                        ("int4-to-nvfp4-modelopt", "weight_scale_2")])
def test_gate_up_global_scales_different(outputs, tmp_path, name, param):
    out = copy(outputs[name][0], tmp_path / "o")
    gate = f"model.layers.1.mlp.experts.2.gate_proj.{param}"
    up = f"model.layers.1.mlp.experts.2.up_proj.{param}"
    assert torch.equal(tensor(out, gate), tensor(out, up))  # shared before tampering
    t = tensor(out, up) * 1.5
    write_raw(out, up, t.numpy().tobytes())
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "scales", "fused-scale", layer=1,
                 tensor="model.layers.1.mlp.experts.2.up_proj",
                 text="fused set model.layers.1.mlp.experts.2.gate_up_proj must share one")
    assert len(failures(rep, "scales", "fused-scale")) == 1
    assert rep["layers"]["1"]["scales"] == "1 bad"


def test_negative_and_nan_scales(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "o")
    block = "model.layers.2.mlp.experts.9.down_proj.weight_scale"
    raw = bytearray(read_raw(out, block))
    raw[10] |= 0x80  # negative FP8 block scale at element 10
    raw[11] = 0x7F  # FP8 NaN at element 11
    write_raw(out, block, bytes(raw))
    _, rep = audit_json(out)
    cols = locate(out, block)[3]["shape"][1]
    assert_named(rep, "scales", "scale-values", layer=2, tensor=block,
                 text=f"negative FP8 block scale(s), first at element [{10 // cols}, {10 % cols}]")
    assert_named(rep, "scales", "finite", layer=2, tensor=block,
                 text=f"first at element [{11 // cols}, {11 % cols}]")


def test_changed_non_weight_file(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "o")
    path = out / "tokenizer_config.json"
    path.write_text(path.read_text().replace("262144", "131072"))
    _, rep = audit_json(out)
    assert_named(rep, "manifest", "non-weight", file="tokenizer_config.json",
                 text="content changed")
    (out / "kconvert-manifest.json").unlink()
    _, rep = audit_json(out, "--source", str(outputs["int4-to-nvfp4-ct"][1]))
    assert_named(rep, "source", "non-weight", file="tokenizer_config.json",
                 text="differs from the source")
    assert len(rep["failures"]) == 1
