"""`--input-scale expert|layer-max|one` (docs/input-scales.md; headroom: test_headroom.py):
scales per policy in both NVFP4 formats, against the policies' definitions (ModelOpt 0.45's
layer sync, vLLM's FlashInfer reduction, K3's 1.0) computed here from the statistics; the
manifest and config say which; eval runs the declared policy as served; the audit fails on a
zero, NaN, Inf or missing per-expert input scale and on scales that do not follow the policy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import BUNDLED
from helpers import (
    INDEX,
    assert_audit_passes,
    assert_user_error,
    audit_json,
    checkpoint_tensors,
    cli_inproc,
    edit_json,
    edit_tensor,
    eval_logits,
    file_tensors,
)
from kconvert.calibrate.input_scales import LayerMax, served_policy
from kconvert.calibrate.stats import ActStats
from kconvert.formats import nvfp4

SCALE = {"compressed-tensors": "input_global_scale", "modelopt": "input_scale"}


def stored(fmt: str, amax: float) -> torch.Tensor:
    """The input scale each format stores for an input amax (formats.md §2)."""
    if fmt == "compressed-tensors":
        return nvfp4.global_scale(torch.tensor([amax]))
    return torch.tensor(amax, dtype=torch.float32) / 2688.0


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    """Input amax of every routed expert linear of the bundled fixture; expert 5 of layer 2
    never routed (amax 0)."""
    g = torch.Generator().manual_seed(3)
    amax = {f"model.layers.{layer}.mlp.experts.{e}.{proj}": float(torch.rand((), generator=g)
                                                                   * 10 + 0.5)
            for layer in (1, 2) for e in range(16) for proj in ("gate_proj", "up_proj",
                                                                 "down_proj")}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        amax[f"model.layers.2.mlp.experts.5.{proj}"] = 0.0
    path = tmp_path_factory.mktemp("stats") / "act.json"
    path.write_text(json.dumps({"input_amax": amax}))
    return path, amax


def convert(dst, fmt: str, policy: str, act_stats=None) -> dict[str, torch.Tensor]:
    args = ["--act-stats", act_stats] if act_stats is not None else []
    res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--format", fmt, "--input-scale", policy,
                     "--device", "cpu", "--quiet", *args)
    assert res.exit_code == 0, res.output
    return checkpoint_tensors(dst)


def policy_of(dst) -> tuple[str | None, str | None]:
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    return manifest["options"]["quantize"].get("input_scale"), config.get("input_scale_policy")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_layer_max_is_each_layers_largest(stats, tmp_path, fmt):
    path, amax = stats
    dst = tmp_path / "out"
    t = convert(dst, fmt, "layer-max", path)
    for layer in (1, 2):
        experts = [f"model.layers.{layer}.mlp.experts.{e}" for e in range(16)]
        w13 = max(amax[f"{e}.{p}"] for e in experts for p in ("gate_proj", "up_proj"))
        down = max(amax[f"{e}.down_proj"] for e in experts)
        for e in experts:
            for proj, want in (("gate_proj", w13), ("up_proj", w13), ("down_proj", down)):
                assert torch.equal(t[f"{e}.{proj}.{SCALE[fmt]}"], stored(fmt, want))
    assert policy_of(dst) == ("layer-max", "layer-max")
    assert_audit_passes(dst, "--source", BUNDLED)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_one_is_one_without_statistics(tmp_path, fmt):
    dst = tmp_path / "out"
    t = convert(dst, fmt, "one")
    scales = [v for k, v in t.items() if k.endswith("." + SCALE[fmt])]
    assert len(scales) == 2 * 16 * 3 and all(float(v.reshape(())) == 1.0 for v in scales)
    assert policy_of(dst) == ("one", "one")
    assert_audit_passes(dst, "--source", BUNDLED)


def test_expert_fills_an_unrouted_expert_with_its_layers_largest(stats, tmp_path):
    path, amax = stats
    dst = tmp_path / "out"
    t = convert(dst, "modelopt", "expert", path)
    layer2 = [f"model.layers.2.mlp.experts.{e}" for e in range(16)]
    w13 = max(amax[f"{e}.{p}"] for e in layer2 for p in ("gate_proj", "up_proj"))
    assert torch.equal(t["model.layers.2.mlp.experts.5.up_proj.input_scale"],
                       stored("modelopt", w13))
    own = max(amax["model.layers.2.mlp.experts.4.gate_proj"],
              amax["model.layers.2.mlp.experts.4.up_proj"])
    assert torch.equal(t["model.layers.2.mlp.experts.4.up_proj.input_scale"],
                       stored("modelopt", own))
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    assert manifest["options"]["quantize"]["input_scale_filled"] == [
        f"model.layers.2.mlp.experts.5.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
    assert policy_of(dst) == ("expert", "expert")


def test_policy_amax_leaves_other_modules_alone():
    calibrated = {"model.layers.1.mlp.experts.0.gate_proj": 1.0,
                  "model.layers.1.mlp.experts.1.up_proj": 3.0,
                  "model.layers.1.mlp.experts.1.down_proj": 2.0,
                  "model.layers.1.self_attn.o_proj": 7.0}
    got, filled = LayerMax().amax(ActStats(calibrated, {}, {}))
    assert got == {"model.layers.1.mlp.experts.0.gate_proj": 3.0,
                   "model.layers.1.mlp.experts.1.up_proj": 3.0,
                   "model.layers.1.mlp.experts.1.down_proj": 2.0,
                   "model.layers.1.self_attn.o_proj": 7.0} and filled == []


def test_served_collapses_to_the_smallest_g_per_group():
    g = {"model.layers.1.mlp.experts.0.gate_proj": torch.tensor(4.0),
         "model.layers.1.mlp.experts.1.up_proj": torch.tensor(2.0),
         "model.layers.1.mlp.experts.1.down_proj": torch.tensor(8.0),
         "model.layers.1.mlp.experts.0.down_proj": torch.tensor(16.0)}
    layer_max = served_policy("layer-max").served(g)
    assert [float(layer_max[m]) for m in g] == [2.0, 2.0, 8.0, 8.0]
    assert all(float(v) == 1.0 for v in served_policy("one").served(g).values())
    assert served_policy("expert").served(g) is g


def test_eval_runs_the_declared_policy(stats, tmp_path):
    """An expert-policy checkpoint whose config declares layer-max evaluates as the
    layer-max checkpoint does: eval applies the policy an engine serves."""
    path, _ = stats
    expert, layer_max = tmp_path / "expert", tmp_path / "layer-max"
    convert(expert, "compressed-tensors", "expert", path)
    convert(layer_max, "compressed-tensors", "layer-max", path)
    ids = torch.arange(64).reshape(2, 32) * 7 % 250
    plain = eval_logits(BUNDLED, [expert, layer_max], ids)
    assert plain[0].kl_mean != plain[1].kl_mean
    edit_json(expert / "config.json",
              lambda c: c["quantization_config"].update(input_scale_policy="layer-max"))
    declared = eval_logits(BUNDLED, [expert], ids)
    assert declared[0].kl_mean == plain[1].kl_mean


def _shard_of(d, name: str):
    return d / json.loads((d / INDEX).read_text())["weight_map"][name]


@pytest.fixture(scope="module")
def layer_max_out(stats, tmp_path_factory):
    dst = tmp_path_factory.mktemp("lm") / "out"
    convert(dst, "modelopt", "layer-max", stats[0])
    return dst


@pytest.mark.parametrize(("value", "check"), [
    (0.0, "scale-values"), (float("nan"), "finite"), (float("inf"), "finite"),
    (0.5, "input-scale")])
def test_audit_fails_a_bad_input_scale(layer_max_out, tmp_path, value, check):
    bad = tmp_path / "bad"
    shutil.copytree(layer_max_out, bad)
    name = "model.layers.1.mlp.experts.3.down_proj.input_scale"
    edit_tensor(_shard_of(bad, name), name, lambda t: torch.tensor(value, dtype=t.dtype))
    _, report = audit_json(bad)
    found = [f for f in report["failures"] if f["check"] == check]
    assert found, report["failures"]
    if check == "input-scale":
        assert "layer-max" in found[0]["message"] and found[0]["layer"] == 1


def test_audit_fails_a_missing_input_scale(layer_max_out, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(layer_max_out, bad)
    name = "model.layers.2.mlp.experts.9.up_proj.input_scale"
    shard = _shard_of(bad, name)
    tensors = file_tensors(shard)
    del tensors[name]
    from safetensors.torch import save_file

    save_file(tensors, str(shard), metadata={"format": "pt"})
    edit_json(bad / INDEX, lambda i: i["weight_map"].pop(name))
    _, report = audit_json(bad)
    missing = [f for f in report["failures"] if f["check"] == "input-scale"]
    assert [f["tensor"] for f in missing] == ["model.layers.2.mlp.experts.9.up_proj.weight"]
    assert "vLLM #45212" in missing[0]["message"]


def test_what_the_policies_cannot_do_is_refused(stats, tmp_path):
    path, _ = stats
    assert_user_error(cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "a", "--input-scale",
                                 "layer-max"), "give --act-stats", code=2)
    assert_user_error(cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "b", "--input-scale",
                                 "one", "--act-stats", path), "give no --act-stats", code=2)
    assert_user_error(cli_inproc("int4-to-mxfp4", BUNDLED, tmp_path / "c", "--input-scale",
                                 "one"), "--input-scale is for NVFP4 W4A4", code=2)
