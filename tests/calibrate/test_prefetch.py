"""The layer prefetcher (order, one layer ahead, errors where the layer would have loaded), the
grouped routed experts against transformers' own DeepseekV3MoE, and bf16 statistics, REAP plans
and eval numbers against the per-expert loop they replace."""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from conftest import ROOT
from helpers import edit_tensor
from kconvert.calibrate import run
from kconvert.calibrate.forward import model_config
from kconvert.calibrate.load import build_layer, read_layer, tensors_by_layer
from kconvert.calibrate.moe import ForwardContext, MoEBlock
from kconvert.calibrate.prefetch import FULL_MODEL_LAYERS, LayerPrefetcher, LayerTiming
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError
from kconvert.evaluate.run import evaluate
from kconvert.io.checkpoint import open_checkpoint
from kconvert.plugins.pruning import CRITERIA
from kconvert.pruning.reap import plan_from_scores, scores_of
from kconvert.testing.tiny_moe import heldout_ids
from oracles import per_expert_routed

TRAINED = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


def _ids(n: int = 3, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 250, (n, seq), generator=torch.Generator().manual_seed(0))


def _calibrate(src: Path, **kwargs):
    ckpt = open_checkpoint(str(src))
    try:
        return run.measure_stats(ckpt, _ids(), "cpu", 2, dtype=torch.float32, **kwargs)
    finally:
        ckpt.close()


def test_layers_in_order_one_ahead_and_same_statistics(monkeypatch):
    events: list[tuple] = []
    live: set[int] = set()  # layers built and not yet freed

    def read(ckpt, cfg, layer, *args):
        events.append(("read", layer, frozenset(live)))
        return read_layer(ckpt, cfg, layer, *args)

    def build(raw, *args, **kwargs):
        built = build_layer(raw, *args, **kwargs)
        live.add(raw.layer)
        weakref.finalize(built, live.discard, raw.layer)
        return built

    monkeypatch.setattr(run, "read_layer", read)
    monkeypatch.setattr(run, "build_layer", build)
    ahead = _calibrate(TRAINED, on_layer=lambda L, _h: events.append(("ran", L)))
    reads = [e for e in events if e[0] == "read"]
    assert [e[1] for e in reads] == [0, 1, 2, 3]
    assert [e[1] for e in events if e[0] == "ran"] == [0, 1, 2, 3]
    for _, layer, alive in reads:
        # reading layer L starts only once every layer before L-1 is freed
        assert alive <= {layer - 1}, (layer, alive)
    # ...and while layer L-1 runs: the read of L is under way before L-1 has finished
    assert any(e[0] == "read" and e[1] == L + 1 for L in range(3)
               for e in events[:events.index(("ran", L))])
    assert not live
    timing = ahead.meta["timing"]
    assert [t["layer"] for t in timing["layers"]] == [f"layer {L}" for L in range(4)]
    assert timing["projected_full_model_s"] > 0

    events.clear()
    serial = _calibrate(TRAINED, prefetch=False)
    assert set(serial.tensors) == set(ahead.tensors)
    for k, v in ahead.tensors.items():
        assert torch.equal(v, serial.tensors[k]), k


def test_error_in_prefetched_layer_names_file_and_tensor(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(TRAINED, src)
    ckpt = open_checkpoint(str(src))
    name = "model.layers.3.mlp.experts.5.up_proj.weight"
    shard = ckpt.tensors[name].file
    ckpt.close()
    edit_tensor(shard, name, lambda t: t[:-1])
    ran: list[int] = []
    with pytest.raises(KconvertError) as err:
        _calibrate(src, on_layer=lambda L, _h: ran.append(L))
    # the layers before it ran: raised where layer 3 would have been loaded
    assert ran == [0, 1, 2]
    assert err.value.file == shard.name
    assert err.value.tensor == name.removesuffix(".weight")
    assert "config says" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_transformers_moe(dtype):
    """Our MoE block (grouped matmuls) against transformers' DeepseekV3MoE (its own per-expert
    loop) with the same weights: equal in fp32; in bf16 no further from the fp32 result than
    transformers' own bf16 forward."""
    ckpt = open_checkpoint(str(TRAINED))
    cfg = model_config(ckpt)
    layer = 1
    tensors = tensors_by_layer(ckpt, cfg.num_hidden_layers)[layer]
    raw = read_layer(ckpt, cfg, layer, tensors, dtype, torch.device("cpu"))
    ckpt.close()
    ctx = ForwardContext()

    def pair(dt: torch.dtype):
        ours = build_layer(raw, cfg, ctx, torch.device("cpu"), dt, stats=False).moe
        ref = DeepseekV3MoE(cfg).to(dt).eval()
        state = {k: v for k, v in ours.state_dict().items() if not k.startswith("experts")}
        state.update({"experts.gate_up_proj": ours.experts.gate_up,
                      "experts.down_proj": ours.experts.down})
        ref.load_state_dict(state, strict=True)
        return ours, ref

    x = torch.randn(2, 33, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours32, ref32 = pair(torch.float32)
        want = ref32(x)
        torch.testing.assert_close(ours32(x), want, rtol=1e-5, atol=1e-6)
        if dtype is torch.bfloat16:
            ours, ref = pair(dtype)
            xb = x.to(dtype)
            ours_err = (ours(xb).float() - want).norm() / want.norm()
            ref_err = (ref(xb).float() - want).norm() / want.norm()
            assert ours_err <= 1.5 * ref_err + 1e-4, (float(ours_err), float(ref_err))


def test_bf16_statistics_plans_and_eval_as_before(monkeypatch, tmp_path):
    """On the trained tiny MoE in bf16 (the CLI's default dtype): the statistics within bf16
    tolerance of the per-expert loop's (tests/oracles.py), the same REAP plans, and eval's
    numbers for an NVFP4 candidate unchanged within tolerance."""
    ids = heldout_ids(4 * 64, seed=5, window=64).reshape(4, 64)
    cand = tmp_path / "nvfp4"
    convert(str(TRAINED), str(cand), load_recipe("quantize"), {}, RunControl(quiet=True))

    def run_both():
        src = open_checkpoint(str(TRAINED))
        other = open_checkpoint(str(cand))
        try:
            stats = run.measure_stats(src, ids, "cpu", 2, dtype=torch.bfloat16)
            report = evaluate(src, [other], ids, "cpu", 2, dtype=torch.bfloat16)
        finally:
            src.close()
            other.close()
        return stats, report

    stats, report = run_both()
    monkeypatch.setattr(MoEBlock, "_routed", per_expert_routed)
    before, report_before = run_both()
    assert set(stats.tensors) == set(before.tensors)
    for k, v in before.tensors.items():
        if k.endswith(".count") or k.endswith(".tokens"):
            assert torch.equal(stats.tensors[k], v), k
        elif k.endswith(".block_amax_hist"):
            # the per-expert reference path above gathers no block histograms (they are
            # checked block by block in test_streamed_calibration.py)
            continue
        else:
            # the same bf16 expert products; only fp32 summation orders differ
            torch.testing.assert_close(stats.tensors[k].double(), v.double(), rtol=1e-5,
                                       atol=1e-7, msg=k)
    for criterion in CRITERIA.names():
        for keep in (6, 12, 18):
            new = plan_from_scores(scores_of(stats), keep, criterion)
            old = plan_from_scores(scores_of(before), keep, criterion)
            assert {k: v.keep for k, v in new.layers.items()} == {
                k: v.keep for k, v in old.layers.items()}, (criterion, keep)
    got, want = report.candidates[0], report_before.candidates[0]
    for key in ("kl_mean", "top1_agreement", "top5_overlap", "nll_candidate"):
        assert getattr(got.logits, key) == pytest.approx(getattr(want.logits, key), rel=1e-4,
                                                         abs=1e-6), key
    for layer, err in want.layers.items():
        assert got.layers[layer].rel_err == pytest.approx(err.rel_err, rel=1e-4), layer


def test_projection_counts_the_first_moe_layers_extra_once():
    """The first MoE layer of a process also compiles kernels: the projection takes the steady
    layers' mean for every MoE layer, plus the first one's extra once."""
    walls = {"layer 0": (False, 2.0), "layer 1": (True, 80.0), "layer 2": (True, 58.0),
             "layer 3": (True, 62.0)}
    prefetcher = LayerPrefetcher(read=None, build=None, device=torch.device("cpu"))
    prefetcher.timings = [LayerTiming(label, moe, wait_s=0.0, compute_s=wall)
                          for label, (moe, wall) in walls.items()]
    summary = prefetcher.summary(first_k_dense=1)
    assert summary["steady_moe_layer_s"] == 60.0
    expected = 2.0 + (FULL_MODEL_LAYERS - 1) * 60.0 + 20.0  # the first layer 20 s over
    assert summary["projected_full_model_s"] == round(expected, 1)
    only = LayerPrefetcher(read=None, build=None, device=torch.device("cpu"))
    only.timings = [LayerTiming("layer 1", True, compute_s=80.0)]
    assert only.summary(first_k_dense=0)["projected_full_model_s"] == FULL_MODEL_LAYERS * 80.0
