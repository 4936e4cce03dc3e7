"""Layer-streamed calibration: exact forward, REAP statistics, activation statistics and
the statistics files.

References are independent of kconvert/calibrate.py: hidden states come from a whole-model
transformers DeepseekV3ForCausalLM forward; router decisions from that model's own
DeepseekV3TopkRouter (captured by a forward hook); expert outputs and activation statistics
from a per-token, per-expert loop over weights read straight from the safetensors files.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from calibrate_support import MOE_LAYERS, PROJS, load_reference, reference_run, streamed, token_ids
from safetensors import safe_open

from helpers import checkpoint_tensors
from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.stats import CalibrationStats, load_stats, save_stats
from kconvert.pruning.reap import scores_from_stats


@pytest.fixture(scope="module")
def bf16(fixture_dir):
    d = fixture_dir("bf16")
    return d, load_reference(d, checkpoint_tensors(d))


@pytest.fixture(scope="module")
def padded_run(bf16):
    d, model = bf16
    ids = token_ids(pad=True)
    stats, outs = streamed(d, ids)
    ref_hidden, routers = reference_run(model, ids)
    return ids, stats, outs, ref_hidden, routers


# ------------------------------------------------------------------- 1. exact forward

def test_streamed_hidden_states_match_whole_model_forward(bf16, padded_run):
    d, model = bf16
    # No padding: SDPA's causal path, every position compared.
    ids = token_ids(pad=False)
    _, outs = streamed(d, ids)
    ref, _ = reference_run(model, ids)
    assert len(outs) == len(ref) == 3
    for layer, (got, want) in enumerate(zip(outs, ref, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"layer {layer}")
    # Right padding: every real position matches (padding positions are never used).
    ids, _, outs, ref, _ = padded_run
    real = ids != PAD_ID
    for layer, (got, want) in enumerate(zip(outs, ref, strict=True)):
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5,
                                   msg=f"padded, layer {layer}")


# ------------------------------------------------------------------- 2./3. statistics

def _independent_stats(files: dict[str, torch.Tensor], routers: dict, real: torch.Tensor,
                       n_experts: int) -> dict:
    """REAP and activation statistics from transformers' router outputs, one token and one
    expert at a time, in float64."""
    out = {}
    real = real.reshape(-1)
    for layer in MOE_LAYERS:
        x_all, weights, indices = routers[layer]
        w_of = {p: {e: files[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"].double()
                    for e in range(n_experts)} for p in PROJS}
        hidden, inter = w_of["down_proj"][0].shape
        s = {"count": torch.zeros(n_experts, dtype=torch.int64),
             **{k: torch.zeros(n_experts, dtype=torch.float64)
                for k in ("reap_sum", "ean_sum", "gate_sum", "amax_in", "amax_down")},
             "sq_in": torch.zeros(n_experts, hidden, dtype=torch.float64),
             "sq_down": torch.zeros(n_experts, inter, dtype=torch.float64),
             "hist_in": torch.zeros(n_experts, 512, dtype=torch.int64),
             "hist_down": torch.zeros(n_experts, 512, dtype=torch.int64)}
        for t in range(x_all.shape[0]):
            if not real[t]:
                continue
            x = x_all[t].double()
            for slot in range(indices.shape[1]):
                e, g = int(indices[t, slot]), float(weights[t, slot])
                a = torch.nn.functional.silu(w_of["gate_proj"][e] @ x) * (w_of["up_proj"][e] @ x)
                f = w_of["down_proj"][e] @ a
                norm = float(f.norm())
                s["count"][e] += 1
                s["reap_sum"][e] += g * norm
                s["ean_sum"][e] += norm
                s["gate_sum"][e] += g
                s["amax_in"][e] = max(float(s["amax_in"][e]), float(x.abs().max()))
                s["amax_down"][e] = max(float(s["amax_down"][e]), float(a.abs().max()))
                s["sq_in"][e] += x * x
                s["sq_down"][e] += a * a
                s["hist_in"][e] += _block_hist(x)
                s["hist_down"][e] += _block_hist(a)
        s["saliency"] = torch.where(s["count"] > 0, s["reap_sum"] / s["count"].clamp(min=1), 0.0)
        out[layer] = s
    return out


def _block_hist(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's histogram of one input row's blocks of 16 (nvfp4_act_headroom.py): 512 bins
    of log2(block amax) over [-40, 40), zero blocks not counted; one block at a time."""
    hist = torch.zeros(512, dtype=torch.int64)
    for block in x.reshape(-1, 16):
        amax = float(block.abs().max())
        if amax > 0:
            hist[min(max(int((math.log2(amax) + 40) / 80 * 512), 0), 511)] += 1
    return hist


def test_reap_saliency_counts_ean_match_direct_computation(bf16, fixture_dir, padded_run):
    d, model = bf16
    ids, stats, _, _, routers = padded_run
    n_experts, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    ref = _independent_stats(checkpoint_tensors(d), routers, ids != PAD_ID, n_experts)
    real_tokens = int((ids != PAD_ID).sum())
    assert stats.meta["tokens"] == real_tokens and stats.meta["padding_tokens"] == 7
    assert stats.moe_layers == list(MOE_LAYERS)
    for layer in MOE_LAYERS:
        s = ref[layer]
        assert int(s["count"].sum()) == real_tokens * k  # padding never counted
        assert torch.equal(stats.layer(layer, "count"), s["count"])
        for name in ("saliency", "reap_sum", "ean_sum", "gate_sum"):
            torch.testing.assert_close(stats.layer(layer, name).double(), s[name],
                                       rtol=1e-5, atol=1e-6, msg=f"layer {layer} {name}")
    # The gate weight is the one the model applies: renormalised top-k sigmoid x scaling.
    g_sum = sum(float(stats.layer(L, "gate_sum").sum()) for L in MOE_LAYERS)
    scale = model.config.routed_scaling_factor
    assert g_sum == pytest.approx(len(MOE_LAYERS) * real_tokens * scale, rel=1e-5)
    assert "routed_scaling_factor" in stats.meta["routing"]


def test_activation_stats_match_direct_computation(bf16, padded_run, tmp_path):
    d, model = bf16
    ids, stats, _, _, routers = padded_run
    n_experts = model.config.n_routed_experts
    ref = _independent_stats(checkpoint_tensors(d), routers, ids != PAD_ID, n_experts)
    for layer in MOE_LAYERS:
        for e in range(n_experts):
            for proj in PROJS:
                key = f"layers.{layer}.experts.{e}.{proj}"
                amax, sq, hist = (("amax_down", "sq_down", "hist_down") if proj == "down_proj"
                                  else ("amax_in", "sq_in", "hist_in"))
                torch.testing.assert_close(stats.tensors[f"{key}.input_amax"].double(),
                                           ref[layer][amax][e], rtol=1e-6, atol=0, msg=key)
                assert torch.equal(stats.tensors[f"{key}.block_amax_hist"], ref[layer][hist][e])
                torch.testing.assert_close(stats.tensors[f"{key}.input_sq_sum"].double(),
                                           ref[layer][sq][e], rtol=1e-5, atol=1e-6, msg=key)
    # Non-expert linears: amax over the real positions of the input they actually see.
    seen = {}
    hooks = [model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda _m, a: seen.__setitem__("down", a[0])),
        model.model.layers[2].self_attn.o_proj.register_forward_pre_hook(
        lambda _m, a: seen.__setitem__("o", a[0]))]
    with torch.no_grad():
        model(ids.clamp(min=0), attention_mask=(ids != PAD_ID).long())
    for h in hooks:
        h.remove()
    real = ids != PAD_ID
    for key, name in (("layers.0.mlp.down_proj", "down"), ("layers.2.self_attn.o_proj", "o")):
        torch.testing.assert_close(stats.tensors[f"{key}.input_amax"],
                                   seen[name][real].abs().max(), rtol=1e-6, atol=0, msg=key)
        assert torch.equal(stats.tensors[f"{key}.block_amax_hist"],
                           sum(_block_hist(row.double()) for row in seen[name][real]))

    # act_stats.json: exactly the checkpoint's linear module names, routed experts included.
    save_stats(stats, tmp_path)
    act = json.loads((tmp_path / "act_stats.json").read_text())
    assert set(act) == {"input_amax", "block_amax_p1", "block_amax_p99.99"}
    files = checkpoint_tensors(d)
    linears = {n.removesuffix(".weight") for n in files if n.startswith("model.layers.")
               and "layernorm" not in n and ".mlp.gate." not in n}
    experts = {n for n in linears if ".mlp.experts." in n}
    assert len(experts) == len(MOE_LAYERS) * n_experts * 3
    assert set(act["input_amax"]) == linears
    for module in experts:
        layer, e, proj = module.split(".")[2], module.split(".")[5], module.split(".")[6]
        assert act["input_amax"][module] == float(
            stats.tensors[f"layers.{layer}.experts.{e}.{proj}.input_amax"])
    # every routed expert with a token has its percentiles, within its calibrated range
    routed = {f"model.layers.{L}.mlp.experts.{e}.{p}" for L in MOE_LAYERS
              for e in range(n_experts) if stats.layer(L, "count")[e] > 0 for p in PROJS}
    assert set(act["block_amax_p1"]) == set(act["block_amax_p99.99"]) == linears - (
        experts - routed)
    for module in act["block_amax_p1"]:
        # a bin centre: at most half a bin (2^(80/1024)) above the largest block
        assert act["block_amax_p1"][module] <= act["block_amax_p99.99"][module] <= (
            act["input_amax"][module] * 2 ** (80 / 1024))
    # stats round-trip; scores where reap.py looks for them.
    back = load_stats(tmp_path)
    assert back.modules == stats.modules and set(back.tensors) == set(stats.tensors)
    assert all(torch.equal(back.tensors[k], v) for k, v in stats.tensors.items())
    assert back.meta["routing"] == stats.meta["routing"]
    with safe_open(str(tmp_path / "stats.safetensors"), "pt") as h:
        names = set(h.keys())
    score_names = ("saliency", "count", "ean_sum", "ean_sq_sum")
    assert {f"layers.{L}.{s}" for L in MOE_LAYERS for s in score_names} <= names
    assert not any(n.startswith("layers.0.") and n.count(".") == 2 and "tokens" not in n
                   for n in names)  # a dense layer has no expert scores
    scores = scores_from_stats(tmp_path)  # what `kconvert reap --stats` reads
    assert list(scores) == list(MOE_LAYERS)
    for layer, s in scores.items():
        assert set(s) == set(score_names)
        for name, t in s.items():
            assert torch.equal(t, stats.layer(layer, name).double())


def test_unrouted_expert_gets_layer_max_in_act_stats():
    t = {"layers.1.saliency": torch.zeros(2)}
    modules = {}
    for e, amax in ((0, 3.0), (1, 0.0)):
        for proj in PROJS:
            key = f"layers.1.experts.{e}.{proj}"
            modules[key] = f"model.layers.1.mlp.experts.{e}.{proj}"
            t[f"{key}.input_amax"] = torch.tensor(amax + (proj == "down_proj"))
    t["layers.1.experts.1.down_proj.input_amax"] = torch.tensor(0.0)
    act = CalibrationStats({}, t, modules).act_stats()["input_amax"]
    assert act["model.layers.1.mlp.experts.1.gate_proj"] == 3.0
    assert act["model.layers.1.mlp.experts.1.down_proj"] == 4.0



def test_same_statistics_give_the_same_bytes(tmp_path):
    """The stats file's hash is recorded by the runs that read it (wanda, W4A4) and compared on
    resume: the same statistics must give the same bytes every time they are written."""
    stats = CalibrationStats(
        meta={"producer": "test", "moe_layers": [1]},
        tensors={"layers.1.experts.0.gate_proj.input_amax": torch.tensor(3.0),
                 "layers.1.saliency": torch.ones(4)},
        modules={"layers.1.experts.0.gate_proj": "model.layers.1.mlp.experts.0.gate_proj"})
    written = set()
    for i in range(8):
        save_stats(stats, tmp_path / str(i))
        written.add((tmp_path / str(i) / "stats.safetensors").read_bytes())
    assert len(written) == 1
