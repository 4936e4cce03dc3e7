"""The pruning rewrite: a pruned checkpoint is exactly the source with pruned experts unroutable.

Oracle: transformers' DeepSeek-V3 model. The source, with the pruned experts' routing masked
out (their e_score_correction_bias set to -inf, so selection never picks them; the weights of
the chosen experts are unchanged), must give the same logits as the pruned checkpoint loaded
with its new config. Quantized checkpoints are made dense by compressed-tensors' own code.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from helpers import checkpoint_tensors
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError
from kconvert.pruning.plan import parse_plan
from kconvert.stages.prune import prune_stage
from oracles import dense_copy

QUIET = RunControl(quiet=True)
KEEP = {1: [0, 2, 3, 5, 8, 9, 12, 15], 2: [1, 2, 4, 6, 7, 10, 11, 14]}
PLAN = {"criterion": "manual", "layers": {str(k): {"keep": v} for k, v in KEEP.items()}}


def _model(d, tmp_path, tag: str, mask: dict[int, list[int]] | None = None):
    """transformers model of checkpoint d (dense fp32), optionally with experts unroutable."""
    dense_dir = tmp_path / f"dense-{tag}"
    state = dense_copy(d, dense_dir)
    cfg = DeepseekV3Config.from_pretrained(dense_dir)
    cfg.model_type = "deepseek_v3"  # transformers fuses per-expert tensors only for this type
    model = DeepseekV3ForCausalLM.from_pretrained(dense_dir, config=cfg, dtype=torch.float32)
    loaded = model.model.layers[1].mlp.experts.down_proj[0]
    assert torch.equal(loaded, state["model.layers.1.mlp.experts.0.down_proj.weight"]), (
        "transformers did not load the experts")
    for layer, keep in (mask or {}).items():
        bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
        pruned = [e for e in range(bias.numel()) if e not in keep]
        bias[pruned] = float("-inf")
    return model.eval()


def _sources(fixture_dir, tmp_path):
    """The four input formats: BF16, INT4 and NVFP4 in both on-disk flavours."""
    int4 = fixture_dir("k2-int4-ct")
    out = {"bf16": fixture_dir("bf16"), "int4": int4}
    for fmt in ("compressed-tensors", "modelopt"):
        dst = tmp_path / f"nvfp4-{fmt}"
        convert(str(int4), str(dst), load_recipe("int4-to-nvfp4"), {"format": fmt}, QUIET)
        out[f"nvfp4-{fmt}"] = dst
    return out


def test_pruned_model_equals_source_with_pruned_experts_masked(fixture_dir, tmp_path):
    tokens = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(0))
    for fmt, src in _sources(fixture_dir, tmp_path).items():
        dst = tmp_path / f"pruned-{fmt}"
        convert(str(src), str(dst), load_recipe("reap"), {}, QUIET,
                prepare=lambda ckpt: {"prune": prune_stage(parse_plan(PLAN), ckpt)})
        config = json.loads((dst / "config.json").read_text())
        assert config["n_routed_experts"] == 8
        with torch.no_grad():
            pruned = _model(dst, tmp_path, f"p-{fmt}")(tokens).logits
            masked = _model(src, tmp_path, f"m-{fmt}", mask=KEEP)(tokens).logits
            full = _model(src, tmp_path, f"f-{fmt}")(tokens).logits
        torch.testing.assert_close(pruned, masked, rtol=1e-5, atol=1e-5, msg=fmt)
        # Pruning changes the function: a rewrite that kept every expert would not pass above.
        assert (full - masked).abs().max() > 1e-3, fmt


def test_router_rows_bias_and_kept_experts_are_the_planned_source_bytes(fixture_dir, tmp_path):
    src = fixture_dir("k25-int4")  # K2.5 layout: language_model.model. prefix, vision tensors
    dst = tmp_path / "pruned"
    convert(str(src), str(dst), load_recipe("reap"), {}, QUIET,
            prepare=lambda ckpt: {"prune": prune_stage(parse_plan(PLAN), ckpt)})
    s, d = checkpoint_tensors(src), checkpoint_tensors(dst)
    p = "language_model.model.layers"
    for layer, keep in KEEP.items():
        rows = torch.tensor(keep)
        assert torch.equal(d[f"{p}.{layer}.mlp.gate.weight"],
                           s[f"{p}.{layer}.mlp.gate.weight"][rows])
        bias = d[f"{p}.{layer}.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias, s[f"{p}.{layer}.mlp.gate.e_score_correction_bias"][rows])
        for new, old in enumerate(keep):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for param in ("weight_packed", "weight_scale", "weight_shape"):
                    a = d[f"{p}.{layer}.mlp.experts.{new}.{proj}.{param}"]
                    b = s[f"{p}.{layer}.mlp.experts.{old}.{proj}.{param}"]
                    assert a.dtype == b.dtype and torch.equal(a, b)
        assert f"{p}.{layer}.mlp.experts.8.gate_proj.weight_packed" not in d
    for name in s:
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(s[name], d[name])
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(d)
    config = json.loads((dst / "config.json").read_text())
    assert config["text_config"]["n_routed_experts"] == 8
    plan = json.loads((dst / "reap-plan.json").read_text())
    assert plan["layers"]["1"]["keep"] == KEEP[1]
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    assert len(manifest["dropped"]) == 2 * 8 * 3 * 3  # layers x pruned experts x projs x params


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ({"1": {"keep": [0, 1, 2, 3, 4, 5, 6, 7]}}, "layer 2 is not in the plan"),
        ({"1": {"keep": [0, 1, 2]}, "2": {"keep": [0, 1, 2]}}, "fewer than num_experts_per_tok"),
        ({"1": {"keep": list(range(8))}, "2": {"keep": list(range(9))}}, "different numbers"),
        ({"1": {"keep": list(range(8))}, "2": {"keep": [*range(7), 16]}}, "keeps expert 16"),
        ({"1": {"keep": list(range(8))}, "2": {"keep": list(range(8))},
          "0": {"keep": list(range(8))}}, "no routed experts"),
    ],
)
def test_bad_plans_are_refused(fixture_dir, tmp_path, layers, message):
    src = fixture_dir("k2-int4-kimi")
    with pytest.raises(KconvertError, match=message):
        convert(str(src), str(tmp_path / "o"), load_recipe("reap"), {}, QUIET,
                prepare=lambda ckpt: {"prune": prune_stage(parse_plan({"layers": layers}),
                                                           ckpt)})
    assert not (tmp_path / "o").exists()
