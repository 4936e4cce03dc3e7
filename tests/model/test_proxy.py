"""The committed Kimi-routed proxy (tests/fixtures/kimi-proxy, scripts/train_proxy.py): Kimi's
config and routing, Kimi's INT4 release layout, a loadable tokenizer, and a training record
whose numbers the checkpoint reproduces on the CPU."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT
from kconvert.testing.fixture_config import kimi_quantization_config
from kconvert.testing.proxy import RECORD_FILE, load_proxy

PROXY = ROOT / "tests" / "fixtures" / "kimi-proxy"


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((PROXY / RECORD_FILE).read_text())


@pytest.fixture(scope="module")
def model():
    return load_proxy(PROXY)


def _train_proxy_script():
    path = ROOT / "scripts" / "train_proxy.py"
    spec = importlib.util.spec_from_file_location("train_proxy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_config_is_kimi_k2_routing():
    cfg = json.loads((PROXY / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2"
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    expected = {"n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
                "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
                "first_k_dense_replace": 1}
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["num_hidden_layers"] >= 6
    assert cfg["kv_lora_rank"] > 0 and cfg["q_lora_rank"] > 0  # MLA
    assert cfg["quantization_config"] == kimi_quantization_config()


def test_layout_is_kimis_int4_release():
    cfg = json.loads((PROXY / "config.json").read_text())
    index = json.loads((PROXY / "model.safetensors.index.json").read_text())["weight_map"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    for layer in range(1, cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp"
        with safe_open(str(PROXY / index[f"{p}.gate.weight"]), framework="pt") as f:
            bias = f.get_tensor(f"{p}.gate.e_score_correction_bias")
            assert bias.dtype == torch.float32 and bias.shape == (384,)
            assert bias.std() > 0  # trained by the balancing rule, not left at zero
            for e in (0, 383):
                for proj, (out, inp) in shapes.items():
                    base = f"{p}.experts.{e}.{proj}"
                    assert f"{base}.weight" not in index
                    assert f.get_tensor(f"{base}.weight_packed").shape == (out, inp // 8)
                    scale = f.get_tensor(f"{base}.weight_scale")
                    assert scale.dtype == torch.bfloat16 and scale.shape == (out, inp // 32)
                    assert f.get_tensor(f"{base}.weight_shape").tolist() == [out, inp]
    size = sum(f.stat().st_size for f in PROXY.iterdir())
    assert size <= 40e6


def test_tokenizer_loads_with_auto_tokenizer(record):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(PROXY), trust_remote_code=True)  # as --data does
    assert len(tok) == record["tokenizer"]["vocab"] == 4096
    assert tok.eos_token_id == 1 and tok.bos_token_id == 0
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_router_selects_with_bias_and_scales_weights(model, record):
    ids = torch.tensor(record["check_sequences"]["ids"][:1])
    mlp = model.model.layers[1].mlp
    seen = {}
    handle = mlp.gate.register_forward_hook(lambda m, a, out: seen.update(h=a[0], out=out))
    with torch.no_grad():
        model(ids)
    handle.remove()
    logits, weights, index = seen["out"]
    scores = logits.sigmoid()
    assert index.shape[-1] == 8
    chosen = (scores + mlp.gate.e_score_correction_bias).topk(8, dim=-1).indices
    assert torch.equal(chosen.sort(-1).values, index.sort(-1).values)
    unbiased = scores.topk(8, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, index.sort(-1).values)  # the bias changes selection
    torch.testing.assert_close(weights.sum(-1), torch.full((ids.numel(),), 2.827))


def test_record_is_reproduced_by_the_checkpoint(model, record):
    check = record["check_sequences"]
    ids = torch.tensor(check["ids"])
    with torch.no_grad():
        logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs(float(loss) - check["loss_int4"]) < 2e-3 * check["loss_int4"]


def test_record_meets_the_acceptance_lines(record):
    held = record["heldout"]
    assert held["loss_int4"] < held["bigram"]["loss"] - 0.5
    assert abs(held["loss_int4"] - held["loss_bf16"]) < 0.05 * held["loss_bf16"]
    for layer, load in held["expert_load_int4"].items():
        tokens = torch.tensor(load["tokens"])
        assert tokens.numel() == 384 and int(tokens.min()) > 0, layer
        assert int(tokens.sum()) == held["tokens"] * 8
        assert load["dead_experts"] == 0
    assert record["loop_probe"]["int4"]["rate"] <= 0.10


def test_loop_check_finds_planted_loops():
    loops = _train_proxy_script().loops
    prefix = list(range(100, 180))
    assert loops(prefix + [7] * 48)
    assert not loops(prefix + [7] * 47)  # one short of the 48-token span
    assert loops(prefix + [1, 2, 3, 4, 5] * 10)
    assert loops(prefix + list(range(20)) * 3)  # period 20, three copies, span 60
    assert not loops(prefix + list(range(30)) * 2)  # two copies only
    assert not loops(prefix)
