"""`kconvert audit`: quantization blocks (config.json, hf_quant_config.json) that disagree
with the tensors on disk are named module by module.

Tampering is done with plain file I/O (headers parsed here with struct + json, bytes patched in
place) or safetensors, never with kconvert's own readers, and expectations come from the
tampering itself (which layer/tensor/row was touched), never from a previous audit run.
"""

from __future__ import annotations

import json

from audit_support import INDEX, assert_named, copy, failures, rehash_generated

from helpers import audit_json

# The fixture `outputs` (every command and recipe on the fixtures), built once for all
# the audit test modules.
pytest_plugins = ["audit_fixtures"]


# ------------------------------------------------------------- 2. tampering: quantization blocks


def test_stale_int4_block_in_text_config(outputs, tmp_path):
    out, src = outputs["k25-int4-to-nvfp4-ct"]
    out = copy(out, tmp_path / "k25")
    cfg = json.loads((out / "config.json").read_text())
    stale = json.loads((src / "config.json").read_text())["text_config"]["quantization_config"]
    assert stale["format"] == "pack-quantized"
    cfg["quantization_config"] = cfg["text_config"]["quantization_config"]  # the NVFP4 block
    cfg["text_config"]["quantization_config"] = stale
    (out / "config.json").write_text(json.dumps(cfg))
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "quant-config", "format", file="config.json",
                 text="top-level quantization_config and text_config.quantization_config differ")
    for layer in (1, 2):
        assert_named(rep, "quant-config", "format", layer=layer,
                     tensor=f"language_model.model.layers.{layer}.mlp.experts.0.gate_proj",
                     text="text_config.quantization_config gives this module INT4 pack-quantized "
                          "but its tensors are NVFP4 (compressed-tensors)")
    # The top-level block is right: no module is blamed on it.
    assert not [f for f in failures(rep, "quant-config", "format")
                if f["message"].startswith("quantization_config")]


def test_excluded_modules_carry_no_scales(outputs, tmp_path):
    """A ModelOpt-excluded linear that has scale tensors is named (vLLM #45102)."""
    out = copy(outputs["int4-to-nvfp4-modelopt"][0], tmp_path / "o")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    # hf_quant_config.json spells it exclude_modules; config.json's block (ModelOpt's export
    # shape) spells it ignore.
    hf["quantization"]["exclude_modules"].append("model.layers.2.mlp.experts.1.*")
    cfg["quantization_config"]["ignore"].append("model.layers.2.mlp.experts.1.*")
    (out / "hf_quant_config.json").write_text(json.dumps(hf))
    (out / "config.json").write_text(json.dumps(cfg))
    rehash_generated(out)
    _, rep = audit_json(out)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert_named(rep, "quant-config", "format", layer=2,
                     tensor=f"model.layers.2.mlp.experts.1.{proj}",
                     text="gives this module unquantized (no scale tensors)")
    assert not failures(rep, "quant-config", "hf_quant_config")


def test_modelopt_weight_only_spelling(outputs, tmp_path):
    """ModelOpt quant_algo NVFP4 is W4A4: modules without input_scale are warned about (not a
    failure); the weight-only spelling W4A16_NVFP4 is accepted without a warning."""
    out = copy(outputs["int4-to-nvfp4-modelopt"][0], tmp_path / "o")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    names = json.loads((out / INDEX).read_text())["weight_map"]
    has_input = any(n.endswith(".input_scale") for n in names)
    code, rep = audit_json(out)
    warned = [w for w in rep["warnings"] if w["check"] == "scheme"]
    assert code == 0
    assert bool(warned) == (hf["quantization"]["quant_algo"] == "NVFP4" and not has_input)
    cfg = json.loads((out / "config.json").read_text())
    for block in (hf["quantization"], cfg["quantization_config"]):
        block["quant_algo"] = "W4A16_NVFP4"
    (out / "hf_quant_config.json").write_text(json.dumps(hf))
    (out / "config.json").write_text(json.dumps(cfg))
    rehash_generated(out)
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    assert not [w for w in rep["warnings"] if w["check"] == "scheme"]
