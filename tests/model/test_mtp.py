"""Multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers; docs/mtp.md), on a
fixture with one MTP layer (layer 3 after the dense layer 0 and MoE layers 1-2): the calibration
forward runs it on vLLM's MTP input; every command converts it like a decoder layer and keeps its
own tensors byte for byte; `reap` prunes it to the same count by its own scores (by the
documented rule where statistics lack them, the plan saying so); each output passes the audit
against its source and is READY for its engines; an MTP layer left with the unpruned count is
NOT READY, naming its shard, tensor and the engine's rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import (
    INDEX,
    assert_audit_passes,
    assert_user_error,
    audit_json,
    built_layer,
    checkpoint_tensors,
    cli_inproc,
    edit_json,
    file_tensors,
    write_input_ids,
)
from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.forward import layer_forward, model_config, position_embeddings
from kconvert.calibrate.moe import ForwardContext
from kconvert.calibrate.run import measure_stats
from kconvert.io.checkpoint import open_checkpoint
from kconvert.model.names import Role, parse_name
from kconvert.pruning.plan import PLAN_FILE, load_plan
from kconvert.pruning.reap import MTP_RULE, keep_ids

MTP = 3  # num_hidden_layers of the fixture (dense 0, MoE 1-2): the MTP layer's index
OWN = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
       "shared_head.norm.weight", "shared_head.head.weight")
DATA = ["--samples", "8", "--seq-len", "32"]  # with --data
# output -> (command, fixture variant, options, whether its routed experts are re-encoded)
COMMANDS = {
    "int4-to-nvfp4": ("int4-to-nvfp4", "k2-int4-kimi", [], True),
    "int4-to-mxfp4": ("int4-to-mxfp4", "k2-int4-kimi", ["--format", "quark-mxfp4"], True),
    "quantize": ("quantize", "bf16", [], True),
    "gptq": ("quantize", "bf16", ["--method", "gptq", *DATA], True),
    "sparsify": ("sparsify", "k2-int4-kimi", ["--method", "magnitude"], True),
    "sparsegpt": ("sparsify", "bf16", ["--method", "sparsegpt", *DATA], True),
    "dequant": ("dequant", "k2-int4-kimi", [], True),
    "reap": ("reap", "k2-int4-kimi", ["--keep", "8", *DATA], False),
    "reap-repair": ("reap", "k2-int4-kimi", ["--keep", "8", *DATA, "--repair", "router",
                                             "--compensate", "down"], False),
}


@pytest.fixture(scope="module")
def sources(fixture_dir) -> dict[str, Path]:
    return {v: fixture_dir(v, mtp_layers=1) for v in ("k2-int4-kimi", "bf16")}


@pytest.fixture(scope="module")
def printed(sources, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each output: its directory and what its command printed."""
    root = tmp_path_factory.mktemp("mtp")
    data = write_input_ids(root / "data.jsonl", [[(7 * i + j) % 256 for j in range(32)]
                                                 for i in range(8)])
    made = {}
    for name, (command, variant, options, _) in COMMANDS.items():
        extra = ["--data", data] if "--samples" in options else []
        res = cli_inproc(command, sources[variant], root / name, *options, *extra,
                         "--device", "cpu")
        assert res.exit_code == 0, res.output
        made[name] = (root / name, res.output)
    return made


@pytest.fixture(scope="module")
def outputs(printed) -> dict[str, Path]:
    return {name: path for name, (path, _) in printed.items()}


def test_the_fixture_has_deepseek_v3s_mtp_layout(sources):
    src = sources["k2-int4-kimi"]
    config = json.loads((src / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == MTP
    names = set(checkpoint_tensors(src))
    assert {f"model.layers.{MTP}.{own}" for own in OWN} <= names
    roles = {parse_name(n).role for n in names if n.startswith(f"model.layers.{MTP}.")}
    assert {Role.MTP, Role.ROUTED_EXPERT, Role.ROUTER_BIAS, Role.SHARED_EXPERT,
            Role.ATTENTION} <= roles
    assert not any(parse_name(n).role is Role.MTP for n in names
                   if not n.startswith(f"model.layers.{MTP}."))
    # the rest of the model is the one without the MTP layer (it is drawn last)
    assert_audit_passes(src)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_converts_the_mtp_layer_and_the_audit_passes(name, sources, outputs):
    _, variant, _, reencoded = COMMANDS[name]
    src, out = checkpoint_tensors(sources[variant]), checkpoint_tensors(outputs[name])
    for own in OWN:  # never quantized, never pruned: the source's bytes
        tensor = f"model.layers.{MTP}.{own}"
        assert out[tensor].dtype == src[tensor].dtype and out[tensor].equal(src[tensor]), tensor
    mtp_experts = {n for n in out if parse_name(n).role is Role.ROUTED_EXPERT
                   and parse_name(n).layer == MTP}
    layer_1 = {n.replace("layers.1.", f"layers.{MTP}.", 1) for n in out
               if parse_name(n).role is Role.ROUTED_EXPERT and parse_name(n).layer == 1}
    assert mtp_experts == layer_1  # converted (and pruned) exactly like a decoder layer
    if reencoded:  # the MTP layer's experts are in the output's format, not the source's
        module = f"model.layers.{MTP}.mlp.experts.0.gate_proj."
        assert {n.removeprefix(module) for n in out if n.startswith(module)} != {
            n.removeprefix(module) for n in src if n.startswith(module)}
    report = assert_audit_passes(outputs[name], "--source", sources[variant],
                                 "--serve", "auto")
    assert report["serve"] and all(e["ready"] for e in report["serve"].values()), report["serve"]


def test_the_mtp_layer_runs_on_vllms_input(sources):
    """The calibration's MTP layer output against its input computed here by hand, as vLLM's
    DeepSeekMultiTokenPredictorLayer does (module docstring of kconvert.calibrate.mtp), then
    through the same decoder layer; in float32, with a padded sequence."""
    src = sources["bf16"]
    ids = torch.tensor([[(5 * i + 3 * j) % 256 for j in range(16)] for i in range(3)])
    ids[2, 12:] = PAD_ID
    seen: dict[int, torch.Tensor] = {}
    ckpt = open_checkpoint(str(src))
    try:
        measure_stats(ckpt, ids, "cpu", 2, dtype=torch.float32,
                      on_layer=lambda layer, hidden: seen.update({layer: hidden.clone()}))
    finally:
        ckpt.close()
    t = {n: v.float() for n, v in checkpoint_tensors(src).items()}
    eps = json.loads((src / "config.json").read_text())["rms_norm_eps"]

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    p = f"model.layers.{MTP}."
    ahead = torch.zeros_like(ids)
    ahead[:, :-1] = ids[:, 1:].clamp(min=0)
    e = t[p + "embed_tokens.weight"][ahead]
    e[:, 0] = 0  # vLLM zeroes the embedding at position 0
    h = rms(seen[MTP - 1], t["model.norm.weight"])  # the main model's output, final norm
    x = torch.cat([rms(e, t[p + "enorm.weight"]), rms(h, t[p + "hnorm.weight"])], -1)
    x = x @ t[p + "eh_proj.weight"].T
    real = torch.ones_like(ids, dtype=torch.bool)
    real[:, -1] = False  # no token i + 1
    real[2, 11:] = False  # token i + 1 is padding
    with built_layer(src, MTP, torch.float32) as layer:
        cfg = model_config(layer.ckpt)
        positions, pos_emb = position_embeddings(cfg, ids.shape[1], torch.device("cpu"),
                                                 torch.float32)
        with torch.no_grad():
            out = layer_forward(layer.loaded, ForwardContext(), x, real, positions, pos_emb)
    assert torch.allclose(out[real], seen[MTP][real], rtol=1e-4, atol=1e-4)


def test_reap_prunes_the_mtp_layer_by_its_own_scores(printed, outputs):
    for name in ("reap", "reap-repair"):
        out = outputs[name]
        config = json.loads((out / "config.json").read_text())
        assert config["n_routed_experts"] == 8 and config["num_nextn_predict_layers"] == 1
        plan = load_plan(out / PLAN_FILE)
        entry = plan.layers[str(MTP)]
        assert entry.rule is None and entry.saliency is not None
        assert entry.keep == keep_ids(torch.tensor(entry.saliency), 8)
        experts = {parse_name(n).expert for n in checkpoint_tensors(out)
                   if parse_name(n).layer == MTP and parse_name(n).role is Role.ROUTED_EXPERT}
        assert experts == set(range(8))
    plan = load_plan(outputs["reap-repair"] / PLAN_FILE)
    assert plan.layers[str(MTP)].repair is None and plan.layers["1"].repair is not None
    assert "layer(s) 3 are pruned without router repair or compensation" in " ".join(
        printed["reap-repair"][1].split())


def test_statistics_without_the_mtp_layer_keep_its_lowest_ids(sources, tmp_path):
    src = sources["k2-int4-kimi"]
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(32))] * 4)
    stats = tmp_path / "stats"
    res = cli_inproc("calibrate", src, "--data", data, "--samples", "4", "--seq-len", "32",
                     "-o", stats, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert json.loads((stats / "stats.json").read_text())["mtp_layers"] == [MTP]
    held = file_tensors(stats / "stats.safetensors")
    save_file({n: v for n, v in held.items() if not n.startswith(f"layers.{MTP}.")},
              str(stats / "stats.safetensors"))
    res = cli_inproc("reap", src, tmp_path / "out", "--keep", "8", "--stats", stats,
                     "--device", "cpu")
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "multi-token-prediction layer(s) 3 keep their 8 lowest expert ids" in said
    plan = load_plan(tmp_path / "out" / PLAN_FILE)
    assert plan.layers[str(MTP)].rule == MTP_RULE
    assert plan.layers[str(MTP)].keep == list(range(8))
    assert plan.layers["1"].rule is None
    assert_audit_passes(tmp_path / "out", "--source", src, "--serve", "auto")


def test_a_given_plan_without_the_mtp_layer_is_refused(sources, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {str(k): {"keep": list(range(8))} for k in (1, 2)}}))
    res = cli_inproc("reap", sources["k2-int4-kimi"], tmp_path / "out", "--plan", plan,
                     "--device", "cpu")
    assert_user_error(res, f"MTP/nextn layer {MTP} is not in the plan")
    assert not (tmp_path / "out" / INDEX).exists()


def test_an_mtp_layer_with_the_unpruned_count_is_not_ready(sources, outputs, tmp_path):
    """The pruned output's MTP layer given back the source's experts 8..15."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in outputs["reap"].iterdir():
        if f.is_file():
            (ckpt / f.name).write_bytes(f.read_bytes())
    source = checkpoint_tensors(sources["k2-int4-kimi"])
    prefix = f"model.layers.{MTP}.mlp.experts."
    extra = {n: t for n, t in source.items()
             if n.startswith(prefix) and int(n[len(prefix):].split(".")[0]) >= 8}
    shard = "model-mtp-extra.safetensors"
    save_file(extra, str(ckpt / shard), metadata={"format": "pt"})
    edit_json(ckpt / INDEX, lambda index: index["weight_map"].update(dict.fromkeys(extra, shard)))
    code, report = audit_json(ckpt, "--serve", "vllm,sglang")
    assert code == 1
    for engine in ("vllm", "sglang"):
        serve = report["serve"][engine]
        assert not serve["ready"]
        bad = [c for c in serve["checks"] if c["name"] == "expert-counts" and not c["ok"]]
        assert [c["message"].split(":")[0] for c in bad] == [
            f"MTP layer {MTP} holds 16 routed experts (ids 0..15), n_routed_experts is 8"]
        assert bad[0]["file"] == shard and bad[0]["tensor"].startswith(f"{prefix}8.")
        assert "MTP" in bad[0]["source"]


def test_a_missing_mtp_tensor_fails_the_audit(outputs, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in outputs["int4-to-nvfp4"].iterdir():
        if f.is_file():
            (ckpt / f.name).write_bytes(f.read_bytes())
    name = f"model.layers.{MTP}.eh_proj.weight"
    index = json.loads((ckpt / INDEX).read_text())
    shard = ckpt / index["weight_map"][name]
    kept = {n: t for n, t in file_tensors(shard).items() if n != name}
    save_file(kept, str(shard), metadata={"format": "pt"})
    edit_json(ckpt / INDEX, lambda i: i["weight_map"].pop(name))
    code, report = audit_json(ckpt)
    assert code == 1
    assert any(f["message"] == "MTP layer has no eh_proj.weight" and f["layer"] == MTP
               for f in report["failures"]), report["failures"]
