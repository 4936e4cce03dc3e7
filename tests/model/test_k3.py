"""Kimi-K3 (docs/kimi.md "Kimi-K3") on the K3-shaped fixture (`make_fixture.py --variant
k3-mxfp4`): every tensor name has its role (experts w1/w2/w3, latent projections, AttnRes, KDA,
router, shared experts, dense layer 0, vision), KDA and MLA layers come from the config's
1-based lists, the data-free commands work on it (inspect, audit, the exact cast to NVFP4 with
K3's names in both formats, dequant) and every data-driven command stops with one line."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (
    assert_audit_passes,
    assert_user_error,
    audit_json,
    checkpoint_tensors,
    cli_inproc,
    edit_json,
    snapshot,
    write_input_ids,
)
from kconvert.formats import mxfp4, nvfp4
from kconvert.model.arch import KIMI_K3, arch_of
from kconvert.model.names import Role, parse_name
from kconvert.sizing.predict import COMPONENT_OF

K3_MOE = "language_model.model.layers.2.block_sparse_moe"


@pytest.fixture(scope="module")
def k3(fixture_dir):
    return fixture_dir("k3-mxfp4", moe_layers=3)


@pytest.mark.parametrize(("name", "role", "proj", "part", "fused"), [
    (f"{K3_MOE}.experts.5.w1.weight_packed", Role.ROUTED_EXPERT, "w1", "gate",
     f"{K3_MOE}.experts.5.w13"),
    (f"{K3_MOE}.experts.5.w3.weight_scale", Role.ROUTED_EXPERT, "w3", "up",
     f"{K3_MOE}.experts.5.w13"),
    (f"{K3_MOE}.experts.5.w2.weight_packed", Role.ROUTED_EXPERT, "w2", "down",
     f"{K3_MOE}.experts.5.w2"),
    (f"{K3_MOE}.gate.weight", Role.ROUTER_WEIGHT, None, None, f"{K3_MOE}.gate"),
    (f"{K3_MOE}.gate.e_score_correction_bias", Role.ROUTER_BIAS, None, None, f"{K3_MOE}.gate"),
    (f"{K3_MOE}.shared_experts.up_proj.weight", Role.SHARED_EXPERT, "up_proj", "up",
     f"{K3_MOE}.shared_experts.gate_up_proj"),
    (f"{K3_MOE}.routed_expert_down_proj.weight", Role.LATENT, "down_proj", None, None),
    (f"{K3_MOE}.routed_expert_norm.weight", Role.LATENT, "norm", None, None),
    ("language_model.model.layers.2.self_attention_res_proj.weight", Role.ATTN_RES,
     "self_attention_res_proj", None, None),
    ("language_model.model.layers.2.mlp_res_norm.weight", Role.ATTN_RES, "mlp_res_norm", None,
     None),
    ("language_model.model.output_attn_res_proj.weight", Role.ATTN_RES, None, None, None),
    ("language_model.model.layers.1.self_attn.q_conv1d.weight", Role.ATTENTION, "q_conv1d",
     None, None),
    ("language_model.model.layers.1.self_attn.A_log", Role.ATTENTION, "A_log", None, None),
    ("language_model.model.layers.1.self_attn.o_norm.weight", Role.ATTENTION, "o_norm", None,
     None),
    ("language_model.model.layers.0.mlp.down_proj.weight", Role.DENSE_MLP, "down_proj", "down",
     "language_model.model.layers.0.mlp.down_proj"),
])
def test_k3_names(name, role, proj, part, fused):
    tn = parse_name(name)
    assert (tn.role, tn.proj, tn.part) == (role, proj, part)
    if fused is not None:
        assert tn.fused_set == fused


def test_renumbered_expert_keeps_its_block():
    tn = parse_name(f"{K3_MOE}.experts.5.w1.weight_packed").with_expert(2)
    assert tn.name == f"{K3_MOE}.experts.2.w1.weight_packed"


def test_the_fixture_holds_every_tensor_k3_has_and_no_unknown_one(k3):
    tensors = checkpoint_tensors(k3)
    roles = {name: parse_name(name).role for name in tensors}
    assert Role.OTHER not in roles.values(), [n for n, r in roles.items() if r is Role.OTHER]
    assert {COMPONENT_OF[r] for r in roles.values()} >= {
        "routed_experts", "shared_experts", "dense_mlp", "attention", "router",
        "latent_projection", "attn_res", "embeddings_lm_head", "vision_projector"}
    # 16 experts x 3 projections x (weight_packed, weight_scale) per MoE layer, all uint8
    experts = [n for n, r in roles.items() if r is Role.ROUTED_EXPERT]
    assert len(experts) == 3 * 16 * 3 * 2
    assert {tensors[n].dtype for n in experts} == {torch.uint8}
    assert tensors[f"{K3_MOE}.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["language_model.model.layers.1.self_attn.A_log"].dtype == torch.float32


def test_kda_and_mla_layers_come_from_the_one_based_lists(k3):
    config = json.loads((k3 / "config.json").read_text())
    arch = arch_of(config["text_config"])
    assert arch.family == KIMI_K3
    assert config["text_config"]["linear_attn_config"]["full_attn_layers"] == [4]
    assert [arch.attention(layer) for layer in range(4)] == ["kda", "kda", "kda", "mla"]
    names = set(checkpoint_tensors(k3))
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "language_model.model.layers.0.self_attn.q_conv1d.weight" in names
    # both kinds hold a g_proj of the same name
    assert {f"language_model.model.layers.{i}.self_attn.g_proj.weight" for i in (0, 3)} <= names


def test_inspect_classifies_every_tensor(k3):
    res = cli_inproc("inspect", k3, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    components = report["checkpoint"]["components"]
    for name in ("routed_experts", "latent_projection", "attn_res", "attention"):
        assert components[name] > 0, components
    # norms alone are "other": layer norms, the final norm
    tensors = checkpoint_tensors(k3)
    others = sum(t.numel() * t.element_size() for n, t in tensors.items()
                 if parse_name(n).role is Role.NORM)
    assert components["other"] == others
    # the KV cache per token is MLA's, in the one MLA layer only
    text = json.loads((k3 / "config.json").read_text())["text_config"]
    assert report["kv_bytes_per_token"] == (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * 2
    calibrate = report["gpu_memory"]["commands"]["calibrate"]
    assert "not supported for this architecture yet" in calibrate["error"]


def test_the_source_audit_follows_its_tensors(k3):
    """K3's ignore list misses the BF16 latent and AttnRes linears: the audit says so (a
    stock compressed-tensors loader would take them for MXFP4), and the structure passes."""
    code, report = audit_json(k3)
    assert code == 1
    failing = {(f["group"], f["check"]) for f in report["failures"]}
    assert failing == {("quant-config", "format")}
    assert {parse_name(f["tensor"]).role for f in report["failures"]} == {Role.LATENT,
                                                                          Role.ATTN_RES}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_the_exact_cast_writes_k3_names(k3, tmp_path, fmt):
    dst = tmp_path / "nv"
    res = cli_inproc("mxfp4-to-nvfp4", k3, dst, "--format", fmt, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    report = assert_audit_passes(dst, "--source", k3)
    out, src = checkpoint_tensors(dst), checkpoint_tensors(k3)
    blocks = sum(t.numel() for n, t in src.items()
                 if parse_name(n).role is Role.ROUTED_EXPERT and n.endswith(".weight_scale"))
    assert f"exact MXFP4 cast: {blocks} of {blocks} blocks" in " ".join(report["notes"])
    packed = "weight_packed" if fmt == "compressed-tensors" else "weight"
    scale_2 = "weight_global_scale" if fmt == "compressed-tensors" else "weight_scale_2"
    for proj in ("w1", "w2", "w3"):
        e = f"{K3_MOE}.experts.7.{proj}"
        assert out[f"{e}.weight_scale"].dtype == torch.float8_e4m3fn
        got = nvfp4.dequantize(out[f"{e}.{packed}"][None], out[f"{e}.weight_scale"][None],
                               out[f"{e}.{scale_2}"].reshape(1), fmt)
        want = mxfp4.dequantize(src[f"{e}.weight_packed"][None], src[f"{e}.weight_scale"][None])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(out[f"{K3_MOE}.experts.7.w1.{scale_2}"],
                       out[f"{K3_MOE}.experts.7.w3.{scale_2}"])
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config  # K3's sits in text_config, and stays there
    block = config["text_config"]["quantization_config"]
    if fmt == "compressed-tensors":
        targets = block["config_groups"]["group_0"]["targets"]
        assert targets == [r"re:.*block_sparse_moe\.experts\.\d+\.(w1|w2|w3)$"]
    else:
        ignore = set(block["ignore"])
        # named as text_config names them, without the wrapper's prefix
        assert {"model.layers.*.block_sparse_moe.routed_expert_up_proj",
                "model.layers.*.mlp_res_proj", "model.output_attn_res_proj",
                "model.layers.*.block_sparse_moe.gate"} <= ignore


def test_dequant_round_trips(k3, tmp_path):
    """dequant of K3 and of its exact NVFP4 cast write the same F32 bytes; audit passes."""
    outs = []
    for src, name in ((k3, "dq"), (None, "dq-cast")):
        if src is None:
            cast = tmp_path / "nv"
            assert cli_inproc("mxfp4-to-nvfp4", k3, cast, "--device", "cpu",
                              "--quiet").exit_code == 0
            src = cast
        dst = tmp_path / name
        res = cli_inproc("dequant", src, dst, "--dtype", "F32", "--device", "cpu", "--quiet")
        assert res.exit_code == 0, res.output
        assert_audit_passes(dst, "--source", src)
        outs.append(checkpoint_tensors(dst))
    assert outs[0].keys() == outs[1].keys()
    for name, t in outs[0].items():
        assert torch.equal(t.view(torch.uint8), outs[1][name].view(torch.uint8)), name
    text = json.loads((tmp_path / "dq" / "config.json").read_text())["text_config"]
    assert "quantization_config" not in text


DATA_DRIVEN = [
    ["calibrate", "-o", "DST"],
    ["eval", "SRC", "-o", "DST"],
    ["reap", "DST", "--keep", "8"],
    ["quantize", "DST", "--method", "gptq"],
    ["quantize", "DST", "--method", "learned"],
    ["sparsify", "DST", "--method", "sparsegpt"],
    ["sparsify", "DST", "--method", "learned"],
]


@pytest.mark.parametrize("command", DATA_DRIVEN)
def test_data_driven_commands_stop_with_one_line_before_dst(k3, tmp_path, command):
    """The refusal comes before the output is touched: no DST, no shard, no .kconvert/."""
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(1, 17))])
    args = [str(k3) if a == "SRC" else str(tmp_path / a) if a.isupper() else a
            for a in command[1:]]
    res = cli_inproc(command[0], k3, *args, "--data", data, "--seq-len", "16", "--samples", "1",
                     "--device", "cpu")
    assert_user_error(res, "not supported for this architecture yet", "Kimi-K3")
    assert sum("kconvert: error:" in line for line in res.output.splitlines()) == 1
    assert not (tmp_path / "DST").exists(), sorted(p.name for p in (tmp_path / "DST").rglob("*"))


@pytest.mark.parametrize("command", DATA_DRIVEN)
def test_an_earlier_output_is_left_as_it_was(k3, tmp_path, command):
    """With --overwrite too, the refusal leaves an existing DST exactly as it was."""
    (tmp_path / "DST").mkdir()
    (tmp_path / "DST" / "earlier.txt").write_text("an earlier output")
    before = snapshot(tmp_path / "DST")
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(1, 17))])
    args = [str(k3) if a == "SRC" else str(tmp_path / a) if a.isupper() else a
            for a in command[1:]]
    res = cli_inproc(command[0], k3, *args, "--data", data, "--seq-len", "16", "--samples", "1",
                     "--device", "cpu", "--overwrite")
    assert_user_error(res, "not supported for this architecture yet", "Kimi-K3")
    assert snapshot(tmp_path / "DST") == before


def test_audit_catches_a_layer_of_the_wrong_attention_kind(k3, tmp_path):
    import shutil

    bad = tmp_path / "k3"
    shutil.copytree(k3, bad)
    edit_json(bad / "config.json", lambda c: c["text_config"]["linear_attn_config"].update(
        kda_layers=[1, 2, 4], full_attn_layers=[3]))
    _, report = audit_json(bad)
    kinds = [f for f in report["failures"] if f["check"] == "attention"]
    assert {f["layer"] for f in kinds} == {2, 3}, kinds
    assert "makes layer 2 MLA (1-based 3) but it holds KDA tensors" in " ".join(
        f["message"] for f in kinds)
