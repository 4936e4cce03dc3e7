"""Layer-streamed calibration: exact forward, REAP statistics, activation stats, data.

References are independent of kconvert/calibrate.py: hidden states come from a whole-model
transformers DeepseekV3ForCausalLM forward; router decisions from that model's own
DeepseekV3TopkRouter (captured by a forward hook); expert outputs and activation statistics
from a per-token, per-expert loop over weights read straight from the safetensors files.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.utils import logging as hf_logging

from conftest import BUNDLED
from helpers import (
    checkpoint_tensors,
    cli_inproc,
    edit_tensor,
    set_at,
    source_copy,
    write_jsonl,
)
from kconvert.calibrate.data import PAD_ID, load_calibration_data
from kconvert.calibrate.run import measure_stats as calibrate
from kconvert.calibrate.stats import CalibrationStats, load_stats, save_stats
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import open_checkpoint
from kconvert.pruning.reap import scores_from_stats
from kconvert.testing.fixture_weights import ct_int4_scheme

hf_logging.set_verbosity_error()

N_SEQ, SEQ_LEN, BATCH = 3, 20, 2  # 3 sequences in batches of 2: a ragged last batch
MOE_LAYERS = (1, 2)
PROJS = ("gate_proj", "up_proj", "down_proj")


def _ids(pad: bool) -> torch.Tensor:
    ids = torch.randint(0, 500, (N_SEQ, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    if pad:
        ids[1, 13:] = PAD_ID  # right padding, as load_calibration_data writes it
    return ids


def _load_reference(d: Path, dense: dict[str, torch.Tensor]) -> DeepseekV3ForCausalLM:
    """transformers' model of a dense checkpoint dir, checked to hold exactly `dense`."""
    cfg = DeepseekV3Config.from_pretrained(d)
    cfg.model_type = "deepseek_v3"  # transformers fuses per-expert tensors only for this type
    model, info = DeepseekV3ForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state, n = model.state_dict(), cfg.moe_intermediate_size
    for name, t in dense.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
            ex = model.model.layers[layer].mlp.experts
            held = {"gate_proj": ex.gate_up_proj[e, :n], "up_proj": ex.gate_up_proj[e, n:],
                    "down_proj": ex.down_proj[e]}[proj]
        else:
            held = state[name]
        assert torch.equal(held, t.float()), f"{name} not loaded into the reference model"
    return model.eval()


def _reference_run(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """Hidden states after each layer (pre-final-norm) and, per MoE layer, the router's input
    and outputs (topk_weights, topk_indices) exactly as transformers computed them."""
    routers = {}
    hooks = [model.model.layers[L].mlp.gate.register_forward_hook(
        lambda _m, args, out, L=L: routers.__setitem__(L, (args[0].reshape(-1, args[0].shape[-1]),
                                                           out[1], out[2])))
        for L in MOE_LAYERS]
    captured = []
    hooks += [layer.register_forward_hook(lambda _m, _a, out: captured.append(out))
              for layer in model.model.layers]
    mask = (ids != PAD_ID).long()
    with torch.no_grad():
        model(ids.clamp(min=0), attention_mask=mask)
    for h in hooks:
        h.remove()
    return captured, routers


def _streamed(ckpt_dir: Path, ids: torch.Tensor) -> tuple[CalibrationStats, list[torch.Tensor]]:
    outs: list[torch.Tensor] = []
    ckpt = open_checkpoint(str(ckpt_dir))
    try:
        stats = calibrate(ckpt, ids, "cpu", BATCH, dtype=torch.float32,
                          on_layer=lambda _L, h: outs.append(h.clone()))
    finally:
        ckpt.close()
    return stats, outs


@pytest.fixture(scope="module")
def bf16(fixture_dir):
    d = fixture_dir("bf16")
    return d, _load_reference(d, checkpoint_tensors(d))


@pytest.fixture(scope="module")
def padded_run(bf16):
    d, model = bf16
    ids = _ids(pad=True)
    stats, outs = _streamed(d, ids)
    ref_hidden, routers = _reference_run(model, ids)
    return ids, stats, outs, ref_hidden, routers


# ------------------------------------------------------------------- 1. exact forward

def test_streamed_hidden_states_match_whole_model_forward(bf16, padded_run):
    d, model = bf16
    # No padding: SDPA's causal path, every position compared.
    ids = _ids(pad=False)
    _, outs = _streamed(d, ids)
    ref, _ = _reference_run(model, ids)
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


# ------------------------------------------------------------------- 4. quantized inputs

def _int4_dense_dir(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A dense fp32 copy of an INT4 fixture, decoded by compressed-tensors (exact q*scale)."""
    scheme, dense, packed = ct_int4_scheme(), {}, {}
    for name, t in checkpoint_tensors(src).items():
        module, _, param = name.rpartition(".")
        if param in ("weight_packed", "weight_scale", "weight_shape"):
            packed.setdefault(module, {})[param] = t
        else:
            dense[name] = t.float() if t.is_floating_point() else t
    for module, sd in packed.items():
        sd = {**sd, "weight_scale": sd["weight_scale"].float()}
        dense[f"{module}.weight"] = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    dst.mkdir()
    save_file(dense, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dense


def test_int4_and_k25_fixtures(fixture_dir, tmp_path):
    ids = _ids(pad=False)
    k2 = fixture_dir("k2-int4-kimi")
    stats, outs = _streamed(k2, ids)
    model = _load_reference(tmp_path / "dense", _int4_dense_dir(k2, tmp_path / "dense"))
    ref, _ = _reference_run(model, ids)
    for layer, (got, want) in enumerate(zip(outs, ref, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"layer {layer}")

    # K2.5: the same language model under language_model.model.*, next to a vision tower.
    k25_stats, k25_outs = _streamed(fixture_dir("k25-int4"), ids)
    for got, want in zip(k25_outs, outs, strict=True):
        assert torch.equal(got, want)
    assert set(k25_stats.tensors) == set(stats.tensors)
    assert all(torch.equal(k25_stats.tensors[k], v) for k, v in stats.tensors.items())
    assert k25_stats.modules == {k: "language_model." + v for k, v in stats.modules.items()}
    assert all(m.startswith("language_model.model.layers.")
               for m in k25_stats.act_stats()["input_amax"])


def test_act_stats_feed_w4a4_quantize(tmp_path):
    """calibrate's act_stats.json is what `int4-to-nvfp4 --act-stats` consumes."""
    ckpt = open_checkpoint(str(BUNDLED))
    try:
        stats = calibrate(ckpt, _ids(pad=True), "cpu", BATCH, dtype=torch.float32)
    finally:
        ckpt.close()
    save_stats(stats, tmp_path / "stats")
    convert(str(BUNDLED), str(tmp_path / "out"), load_recipe("int4-to-nvfp4"),
            {"act_stats": str(tmp_path / "stats" / "act_stats.json"), "block_scale": "amax",
             "input_scale": "expert"}, RunControl(quiet=True))
    out = checkpoint_tensors(tmp_path / "out")
    amax = stats.act_stats()["input_amax"]
    base = "model.layers.2.mlp.experts.5"
    want = max(amax[f"{base}.gate_proj"], amax[f"{base}.up_proj"])
    assert float(out[f"{base}.up_proj.input_global_scale"]) == pytest.approx(2688.0 / want)


# ------------------------------------------------------------------- 5. data

def test_input_ids_used_exactly_and_packed(tmp_path):
    exact = list(range(100, 108))  # exactly seq_len: one sequence by itself
    docs = [[1, 2, 3], list(range(4, 15)), [20]]  # 15 tokens: packed into 8 + 7 (+1 pad)
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": r} for r in [exact, *docs]])
    ids = load_calibration_data(data, None, samples=10, seq_len=8, seed=0)
    assert ids.dtype == torch.long and ids.shape == (3, 8)
    rows = ids.tolist()
    assert exact in rows
    packed = [r for r in rows if r != exact]
    assert packed[-1][-1] == PAD_ID and PAD_ID not in packed[0] + packed[-1][:-1]
    stream = [t for r in packed for t in r if t != PAD_ID]  # nothing added, nothing lost
    assert stream in [list(itertools.chain(*p)) for p in itertools.permutations(docs)]
    # Deterministic in the seed; the seed changes the order; samples caps the count.
    again = load_calibration_data(data, None, samples=10, seq_len=8, seed=0)
    assert torch.equal(ids, again)
    orders = {tuple(map(tuple, load_calibration_data(data, None, 10, 8, s).tolist()))
              for s in range(6)}
    assert len(orders) > 1
    two = load_calibration_data(data, None, samples=2, seq_len=8, seed=0)
    assert two.shape == (2, 8) and PAD_ID not in two.tolist()[0] + two.tolist()[1]


def _tokenizer_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[BOS]", "hello", "world", "the", "cat", "sat", "user", "assistant"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A",
                                                       special_tokens=[("[BOS]", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", unk_token="[UNK]")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    d = tmp_path / "tok"
    fast.save_pretrained(str(d))
    return d


def test_text_and_messages_lines(tmp_path):
    tok_dir = _tokenizer_dir(tmp_path)
    rows = [{"text": "hello world the cat"}, {"messages": [
        {"role": "user", "content": "hello cat"}, {"role": "assistant", "content": "sat"}]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    ids = load_calibration_data(data, tok_dir, samples=4, seq_len=4, seed=0)
    stream = [t for t in ids.reshape(-1).tolist() if t != PAD_ID]
    text = [1, 2, 3, 4, 5]  # the tokenizer's own [BOS] is kept for text
    chat = [7, 2, 5, 8, 6]  # "user hello cat assistant sat", the template's tokens only
    assert stream in (text + chat, chat + text)
    with pytest.raises(KconvertError, match="no tokenizer"):
        load_calibration_data(data, None, samples=4, seq_len=4, seed=0)


def test_bad_data_lines(tmp_path):
    for body, match in (("{\"input_ids\": [1, 2]}\nnot json\n", "line 2 is not JSON"),
                        ("{\"ids\": [1]}\n", "none of input_ids"),
                        ("{\"input_ids\": [1, -2]}\n", "non-negative"),
                        ("\n\n", "empty")):
        (tmp_path / "d.jsonl").write_text(body)
        with pytest.raises(KconvertError, match=match):
            load_calibration_data(tmp_path / "d.jsonl", None, samples=1, seq_len=4, seed=0)


def test_a_bad_line_is_named_in_file_order_whatever_the_shuffle(tmp_path):
    """Lines are shuffled before use, but the error names the first bad line of the file, and
    a bad line beyond what --samples takes is an error too (the file is bad, whichever lines a
    seed would take)."""
    good = [json.dumps({"input_ids": [1, 2, 3, 4]})] * 9
    body = [*good[:4], "not json", *good[4:7], '{"input_ids": [1, -2]}', *good[7:]]
    (tmp_path / "d.jsonl").write_text("\n".join(body) + "\n")
    for seed in range(6):  # seeds that put either bad line first in the shuffled order
        with pytest.raises(KconvertError, match="line 5 is not JSON"):
            load_calibration_data(tmp_path / "d.jsonl", None, samples=1, seq_len=4, seed=seed)


def test_a_token_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """ids run 0..vocab-1: vocab itself is one past the embedding's last row."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [0, 511, 3, 4]},
                                              {"input_ids": [1, 2, 512, 4]}])
    with pytest.raises(KconvertError, match=r"line 2: token id 512 is beyond the model's "
                                            r"vocabulary \(vocab_size 512"):
        load_calibration_data(data, None, samples=1, seq_len=4, seed=0, vocab=512)
    ids = load_calibration_data(data, None, samples=2, seq_len=4, seed=0, vocab=513)
    assert int(ids.max()) == 512


# ------------------------------------------------------------------- CLI

def test_cli(fixture_dir, tmp_path):
    src = fixture_dir("bf16")
    rows = [{"input_ids": [(7 * i + j) % 500 for j in range(16)]} for i in range(5)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "stats"
    args = [str(src), "--data", str(data), "-o", str(out), "--samples", "3", "--seq-len", "16",
            "--batch-size", "2", "--seed", "1", "--device", "cpu", "--dtype", "float32"]
    res = cli_inproc("calibrate", *args)
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "stats.json").read_text())
    assert (meta["samples"], meta["seq_len"], meta["tokens"], meta["seed"]) == (3, 16, 48, 1)
    assert meta["routing"] == ("sigmoid+bias selection, renormalised sigmoid weights x "
                               "routed_scaling_factor")
    assert (out / "act_stats.json").is_file() and (out / "stats.safetensors").is_file()
    res = cli_inproc("calibrate", *args)
    assert res.exit_code == 1 and "--overwrite" in res.output
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [600] * 16}])  # vocab is 512
    res = cli_inproc("calibrate", args[0], "--data", bad, "-o", tmp_path / "s2", "--seq-len", 16)
    assert res.exit_code == 1 and "line 1: token id 600 is beyond the model's vocabulary" \
        in res.output


@pytest.mark.parametrize(("index", "value", "said"), [
    ((0, 0), float("nan"), "the source weights hold NaN or Inf"),
    # a row of the largest finite BF16 values: the sum over the row overflows
    ((0, slice(None)), 3e38, "the activations overflowed; its largest value, "
                             f"{torch.tensor(3e38, dtype=torch.bfloat16).item():.4g}, is in the "
                             "tensor named here"),
])
def test_non_finite_hidden_states_name_the_file_and_tensor(tmp_path, index, value, said):
    """A NaN in a layer's weights, or a finite value so large that the layer's output
    overflows: the error names the shard and the tensor to look at, not only the layer."""
    src = source_copy(tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    edit_tensor(src / "model-00002-of-000004.safetensors", name, set_at(index, value))
    data = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [7 * j % 500 for j in range(16)]}])
    res = cli_inproc("calibrate", src, "--data", data, "-o", tmp_path / "stats", "--samples", 1,
                     "--seq-len", 16, "--device", "cpu", "--quiet")
    assert res.exit_code == 1, res.output
    assert "non-finite hidden states after decoder layer 1" in res.output
    assert said in res.output
    assert f"(file model-00002-of-000004.safetensors, tensor {name})" in res.output


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
