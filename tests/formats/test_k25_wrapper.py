"""The Kimi K2.5 wrapper (kimi.md): experts quantized under language_model., everything else
byte for byte, the INT4 block replaced wherever config.json holds it.

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criterion covered: G (K2.5 wrapper).
"""

from __future__ import annotations

import json
import shutil

import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
)

from helpers import checkpoint_tensors, run_inproc
from oracles import (
    CT_PARAMS,
    EXPERT_RE,
    by_module,
    ct_scheme_for,
    dicts,
    expert_modules,
    kconvert_nvfp4,
    raw_tensors,
)

# ------------------------------------------------------------------------------ G: K2.5 wrapper


def test_k25_experts_quantized_under_language_model_prefix(converted):
    _, dst = converted("k25-int4")
    mods = by_module(checkpoint_tensors(dst))
    experts = expert_modules(mods)
    assert len(experts) == 2 * 16 * 3
    assert {k[0] for k in experts} == {"language_model.model."}
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config  # where the source had it: text_config only
    qc = QuantizationConfig.model_validate(config["text_config"]["quantization_config"])
    for module in experts.values():
        sd = mods[module]
        assert set(sd) == CT_PARAMS, module
        scheme = ct_scheme_for(module, qc)
        assert scheme is not None, f"{module} is not targeted by the config"
        ref = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
        assert torch.equal(ref, kconvert_nvfp4(sd).to(torch.bfloat16)), module
    # The K2.5 language model is the k2-int4-kimi model (same seed): same NVFP4 bytes.
    _, dst_k2 = converted("k2-int4-kimi")
    k2 = raw_tensors(dst_k2)
    k25 = raw_tensors(dst)
    for (_, layer, expert, proj), module in experts.items():
        for p in CT_PARAMS:
            k2_name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{p}"
            assert k25[f"{module}.{p}"] == k2[k2_name], k2_name
    assert "language_model.lm_head.weight" in k25
    assert not any(n.startswith("lm_head") or n.startswith("model.") for n in k25)


def test_k25_passthrough_tensors_and_files_are_byte_identical(converted):
    src, dst = converted("k25-int4")
    before, after = raw_tensors(src), raw_tensors(dst)
    passthrough = [n for n in before if not EXPERT_RE.match(n.rpartition(".")[0])]
    vision = [n for n in passthrough if n.startswith(("vision_tower.", "mm_projector."))]
    assert any(n.startswith("vision_tower.") for n in vision)
    assert any(n.startswith("mm_projector.") for n in vision)
    for name in passthrough:
        assert after.get(name) == before[name], name
    generated = {"config.json", "model.safetensors.index.json"}
    files = [p for p in src.rglob("*") if p.is_file() and p.suffix != ".safetensors"
             and p.name not in generated]
    assert {p.name for p in files} >= {"tiktoken.model", "tokenization_kimi.py",
                                       "chat_template.jinja", "preprocessor_config.json",
                                       "modeling_kimi_k25.py", "configuration_kimi_k25.py",
                                       "generation_config.json", "tokenizer_config.json"}
    for p in files:
        rel = p.relative_to(src)
        assert (dst / rel).read_bytes() == p.read_bytes(), rel


def test_k25_config_blocks_replaced_everywhere(fixture_dir, tmp_path):
    """A wrapper whose INT4 block sits at the top level as well as in text_config (Moonshot
    ships it in text_config only): both copies become the NVFP4 block, nothing else changes."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("k25-int4"), src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = config["text_config"]["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    run_inproc("int4-to-nvfp4", src, dst)
    before = json.loads((src / "config.json").read_text())
    after = json.loads((dst / "config.json").read_text())
    for cfg in (after, after["text_config"]):
        qc = QuantizationConfig.model_validate(cfg["quantization_config"])
        assert qc.format == "nvfp4-pack-quantized"
        for scheme in qc.config_groups.values():
            assert scheme.weights.type == "float" and scheme.weights.group_size == 16
    for d in dicts(after):
        assert d.get("format") != "pack-quantized", "stale INT4 block left in config.json"
        assert d.get("type") != "int"
    # Everything but the two quantization blocks is unchanged.
    for cfg in (before, after):
        cfg.pop("quantization_config")
        cfg["text_config"].pop("quantization_config")
    assert after == before
