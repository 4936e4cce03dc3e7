"""Name parsing (every Kimi-family spelling) and the committed manifest schema."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from conftest import BUNDLED, ROOT
from kconvert.model.names import PARAM_SUFFIXES, Role, parse_name, split_param
from kconvert.records.manifest import Manifest


@pytest.mark.parametrize(
    ("name", "role", "layer", "expert", "proj", "param"),
    [
        ("model.layers.3.mlp.experts.17.gate_proj.weight_packed", Role.ROUTED_EXPERT, 3, 17,
         "gate_proj", "weight_packed"),
        ("language_model.model.layers.60.mlp.experts.383.down_proj.weight_scale_2",
         Role.ROUTED_EXPERT, 60, 383, "down_proj", "weight_scale_2"),
        ("language_model.layers.1.mlp.experts.0.up_proj.weight", Role.ROUTED_EXPERT, 1, 0,
         "up_proj", "weight"),
        ("model.layers.5.mlp.shared_experts.down_proj.weight", Role.SHARED_EXPERT, 5, None,
         "down_proj", "weight"),
        ("model.layers.0.mlp.gate_proj.weight", Role.DENSE_MLP, 0, None, "gate_proj", "weight"),
        ("model.layers.2.mlp.gate.weight", Role.ROUTER_WEIGHT, 2, None, None, "weight"),
        ("model.layers.2.mlp.gate.e_score_correction_bias", Role.ROUTER_BIAS, 2, None, None,
         "e_score_correction_bias"),
        ("model.layers.2.self_attn.kv_a_proj_with_mqa.weight", Role.ATTENTION, 2, None,
         "kv_a_proj_with_mqa", "weight"),
        ("model.layers.2.self_attn.q_a_layernorm.weight", Role.NORM, 2, None, None, "weight"),
        ("model.layers.2.input_layernorm.weight", Role.NORM, 2, None, None, "weight"),
        ("model.embed_tokens.weight", Role.EMBEDDING, None, None, None, "weight"),
        ("language_model.model.norm.weight", Role.NORM, None, None, None, "weight"),
        ("lm_head.weight", Role.LM_HEAD, None, None, None, "weight"),
        ("language_model.lm_head.weight", Role.LM_HEAD, None, None, None, "weight"),
        ("vision_tower.encoder.blocks.0.wqkv.weight", Role.VISION, None, None, None, "weight"),
        ("mm_projector.proj.0.bias", Role.PROJECTOR, None, None, None, "bias"),
        ("something.else", Role.OTHER, None, None, None, ""),
    ],
)
def test_parse_name(name, role, layer, expert, proj, param):
    tn = parse_name(name)
    assert (tn.role, tn.layer, tn.expert, tn.proj, tn.param) == (role, layer, expert, proj, param)
    if tn.param:
        assert f"{tn.module}.{tn.param}" == name


def test_fused_sets_pair_gate_and_up_only():
    gate = parse_name("model.layers.3.mlp.experts.7.gate_proj.weight_packed")
    up = parse_name("model.layers.3.mlp.experts.7.up_proj.weight_scale")
    down = parse_name("model.layers.3.mlp.experts.7.down_proj.weight_packed")
    other = parse_name("model.layers.3.mlp.experts.8.up_proj.weight_packed")
    assert gate.fused_set == up.fused_set
    assert len({gate.fused_set, down.fused_set, other.fused_set}) == 3
    qa = parse_name("model.layers.3.self_attn.q_a_proj.weight")
    kva = parse_name("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
    assert qa.fused_set == kva.fused_set


def test_with_expert_renames_every_parameter():
    tn = parse_name("language_model.model.layers.4.mlp.experts.300.down_proj.weight_scale_2")
    assert tn.with_expert(12).name == (
        "language_model.model.layers.4.mlp.experts.12.down_proj.weight_scale_2")


def test_committed_manifest_schema_is_current():
    committed = json.loads((ROOT / "manifests" / "manifest.schema.json").read_text())
    assert committed == Manifest.model_json_schema(), (
        "regenerate: python -m kconvert.records.manifest > manifests/manifest.schema.json")


def _split_by_trying_every_suffix(name: str) -> tuple[str, str]:
    """split_param's definition, spelled the slow way: the first (longest) suffix the name
    ends with after a dot."""
    for suffix in (*PARAM_SUFFIXES, "e_score_correction_bias"):
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], suffix
    return name, ""


def test_split_param_is_the_suffix_definition():
    names = []
    for shard in sorted(BUNDLED.glob("*.safetensors")):  # the spellings of a real checkpoint
        with safe_open(str(shard), "pt") as f:
            names += list(f.keys())
    names += [f"{stem}{sep}{suffix}{tail}" for stem in ("", "a", "a.b", "model.layers.1.mlp")
              for sep in (".", "_", "")
              for suffix in (*PARAM_SUFFIXES, "e_score_correction_bias", "scale_2", "weight.")
              for tail in ("", ".x", "_2")]
    assert len(names) > 900
    for name in names:
        assert split_param(name) == _split_by_trying_every_suffix(name), name
