"""`--input-scale headroom` (docs/input-scales.md): ModelOpt's `nvfp4_act_headroom` rule,
max(16384 x p1, p99.99) of a module's per-block input amax, checked against a hand computation
of ModelOpt's histogram percentiles and of the rule on planted statistics, through quantize in
both NVFP4 formats, the audit's recomputation and eval's count of the activation blocks that
clamp."""

from __future__ import annotations

import json
import math
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
    edit_tensor,
)
from kconvert.calibrate import block_amax
from kconvert.calibrate.stats import CalibrationStats
from kconvert.evaluate.activations import BlockClamps, fake_quantize
from kconvert.evaluate.run import evaluate
from kconvert.formats import nvfp4
from kconvert.io.checkpoint import open_checkpoint

SCALE = {"compressed-tensors": "input_global_scale", "modelopt": "input_scale"}
WIDTH = 80 / 512  # log2 per bin


def centre(i: int) -> float:
    """ModelOpt's value of bin i: its centre, 2^(-40 + (i + 0.5) x 80 / 512)."""
    return 2.0 ** (-40 + (i + 0.5) * WIDTH)


def stored(fmt: str, amax: float) -> torch.Tensor:
    if fmt == "compressed-tensors":
        return nvfp4.global_scale(torch.tensor([amax]))
    return torch.tensor(amax, dtype=torch.float32) / 2688.0


def test_percentiles_are_modelopts():
    """p99.99: the first bin whose cumulative count reaches 99.99% of the total; p1 the same at
    1%, with the bins below the one holding p99.99 / 1e6 left out."""
    hist = torch.zeros(512, dtype=torch.int64)
    hist[150] = 5000  # 2^-16.5: below p99.99 / 1e6 (bin 172), left out of p1
    hist[180] = 1000
    hist[250] = 98_990
    hist[300] = 10
    # 105000 counted: 99.99% is 104989.5, reached at bin 250 (cumulative 104990)
    assert block_amax.percentile(hist, 99.99) == centre(250)
    hist[300] = 11  # 105001: 99.99% is 104990.4999, past bin 250's 104990
    assert block_amax.percentile(hist, 99.99) == centre(300)
    floor_bin = math.floor((math.log2(centre(300) / 1e6) + 40) / WIDTH)
    assert 150 < floor_bin <= 180
    # bin 150 left out: 100001 counted, 1% is 1000.01, past bin 180's 1000 -> bin 250
    assert block_amax.quantiles(hist) == (centre(250), centre(300))
    hist[180] = 1001  # 100002 counted: bin 180 reaches 1000.02
    assert block_amax.quantiles(hist) == (centre(180), centre(300))
    assert block_amax.percentile(hist, 1.0) == centre(150)  # the floor is what leaves it out
    assert block_amax.quantiles(torch.zeros(512, dtype=torch.int64)) is None


def test_block_histogram_counts_every_non_zero_block():
    rows = torch.zeros(3, 40)  # blocks 0..15, 16..31, and 32..39 padded
    rows[0, 3], rows[0, 20], rows[0, 39] = 2.0**-3, -(2.0**5), 1.0
    rows[1, 0] = 2.0**-60  # below the range: the first bin
    hist = block_amax.new_histogram()
    block_amax.add_rows(rows, hist)
    want = torch.zeros(512, dtype=torch.int64)
    for v in (2.0**-3, 2.0**5, 1.0):
        want[math.floor((math.log2(v) + 40) / WIDTH)] += 1
    want[0] += 1
    assert torch.equal(hist, want)  # the five zero blocks are not counted
    grouped = block_amax.new_histogram(2)
    block_amax.add_grouped_rows(rows, torch.tensor([1, 2]), grouped)
    first, rest = block_amax.new_histogram(), block_amax.new_histogram()
    block_amax.add_rows(rows[:1], first)
    block_amax.add_rows(rows[1:], rest)
    assert torch.equal(grouped, torch.stack([first, rest]))


def test_act_stats_carry_the_percentiles_and_older_statistics_none():
    hist = torch.zeros(512, dtype=torch.int64)
    hist[200], hist[260] = 30, 970  # 3% at bin 200
    key, module = "layers.1.experts.0.gate_proj", "model.layers.1.mlp.experts.0.gate_proj"
    tensors = {"layers.1.saliency": torch.zeros(1), f"{key}.input_amax": torch.tensor(2.0),
               f"{key}.block_amax_hist": hist}
    act = CalibrationStats({}, tensors, {key: module}).act_stats()
    assert act["block_amax_p1"] == {module: centre(200)}
    assert act["block_amax_p99.99"] == {module: centre(260)}
    del tensors[f"{key}.block_amax_hist"]  # written before the histograms were kept
    assert set(CalibrationStats({}, tensors, {key: module}).act_stats()) == {"input_amax"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """act_stats.json of every routed expert linear of the bundled fixture: input amax and
    percentiles; expert 5 of layer 2 never routed (no percentiles); layer 1's expert 0 with a
    range too wide for the headroom factor (16384 x p1 < p99.99)."""
    g = torch.Generator().manual_seed(5)
    modules = [f"model.layers.{layer}.mlp.experts.{e}.{proj}" for layer in (1, 2)
               for e in range(16) for proj in ("gate_proj", "up_proj", "down_proj")]
    p1 = {m: float(torch.rand((), generator=g)) * 1e-3 + 1e-4 for m in modules}
    p9999 = {m: float(torch.rand((), generator=g)) * 4 + 1 for m in modules}
    p1["model.layers.1.mlp.experts.0.up_proj"] = 1e-5  # 16384 x p1 = 0.16 < p99.99
    amax = {m: p9999[m] * 1.5 for m in modules}
    unrouted = [f"model.layers.2.mlp.experts.5.{p}" for p in ("gate_proj", "up_proj",
                                                              "down_proj")]
    for m in unrouted:
        del p1[m], p9999[m]
    path = tmp_path_factory.mktemp("act") / "act_stats.json"
    path.write_text(json.dumps({"input_amax": amax, "block_amax_p1": p1,
                                "block_amax_p99.99": p9999}))
    return path, amax, p1, p9999


def hand_headroom(p1: dict, p9999: dict, layer: int, expert: int, part: str) -> float:
    """The amax ModelOpt's rule gives an expert's gate/up (the larger of the two, one input)
    or down, by hand; an expert without percentiles its layer's largest of that part."""
    projs = ("down_proj",) if part == "down" else ("gate_proj", "up_proj")

    def rule(e: int) -> float | None:
        names = [f"model.layers.{layer}.mlp.experts.{e}.{p}" for p in projs]
        if names[0] not in p1:
            return None
        return max(max(16384 * p1[n], p9999[n]) for n in names)

    own = rule(expert)
    return own if own is not None else max(v for e in range(16) if (v := rule(e)) is not None)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_headroom_scales_are_modelopts_rule(planted, tmp_path, fmt):
    path, _, p1, p9999 = planted
    dst = tmp_path / "out"
    res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--format", fmt, "--input-scale",
                     "headroom", "--act-stats", path, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    t = checkpoint_tensors(dst)
    for layer in (1, 2):
        for e in range(16):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                want = hand_headroom(p1, p9999, layer, e, "down" if proj == "down_proj"
                                     else "w13")
                got = t[f"model.layers.{layer}.mlp.experts.{e}.{proj}.{SCALE[fmt]}"]
                assert torch.equal(got, stored(fmt, want)), (layer, e, proj)
    # the wide expert: its gate's rule wins over its up's p99.99
    w13 = hand_headroom(p1, p9999, 1, 0, "w13")
    assert w13 == max(16384 * p1["model.layers.1.mlp.experts.0.gate_proj"],
                      p9999["model.layers.1.mlp.experts.0.gate_proj"],
                      p9999["model.layers.1.mlp.experts.0.up_proj"])
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    assert manifest["options"]["quantize"]["input_scale"] == "headroom"
    assert manifest["options"]["quantize"]["input_scale_filled"] == [
        f"model.layers.2.mlp.experts.5.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config["input_scale_policy"] == "headroom"
    assert_audit_passes(dst, "--source", BUNDLED)


def test_the_audit_recomputes_the_headroom_scales(planted, tmp_path):
    path = planted[0]
    dst = tmp_path / "out"
    res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--format", "modelopt", "--input-scale",
                     "headroom", "--act-stats", path, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    name = "model.layers.2.mlp.experts.7.down_proj.input_scale"
    shard = bad / json.loads((bad / INDEX).read_text())["weight_map"][name]
    edit_tensor(shard, name, lambda t: t * 1.01)  # finite, non-zero: only the rule tells
    _, report = audit_json(bad)
    found = [f for f in report["failures"] if f["check"] == "input-scale"]
    assert len(found) == 1 and found[0]["layer"] == 2, report["failures"]
    assert "headroom" in found[0]["message"] and found[0]["tensor"] == name


def test_headroom_refuses_statistics_without_percentiles(planted, tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"input_amax": planted[1]}))
    assert_user_error(cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "a", "--input-scale",
                                 "headroom", "--act-stats", old), "calibrate again")
    assert not (tmp_path / "a" / "config.json").exists()


def test_clamped_blocks_are_those_above_what_g_represents():
    """A block clamps where its amax x g / 6 is above 448: amax above 2688 / g."""
    g = torch.tensor(2688.0 / 3.0)  # amax 3 is the most it represents
    x = torch.zeros(2, 3, 32)
    x[0, 0, 5], x[0, 1, 17], x[1, 2, 0], x[1, 2, 31] = 2.9, 3.5, -7.0, 3.0
    count = BlockClamps()
    fake_quantize(x, g, count)
    assert count.totals() == (12, 2)
    rows = torch.tensor([[True, False, True], [False, False, True]])
    only = BlockClamps()
    fake_quantize(x, g, only, rows)
    assert only.totals() == (6, 1)  # row (0, 1) is left out
    only.counting = False
    fake_quantize(x, g, only, rows)
    assert only.totals() == (6, 1)


def test_eval_counts_every_routed_block_and_its_clamps(planted, tmp_path):
    """Every real token reaches top-k experts of each MoE layer: hidden / 16 blocks into their
    gate/up and moe_intermediate / 16 into their down. A global scale too large for any of
    them clamps every non-zero block; the W4A16 twin counts none."""
    path = planted[0]
    w4a4, w4a16 = tmp_path / "w4a4", tmp_path / "w4a16"
    for dst, extra in ((w4a4, ["--act-stats", str(path), "--input-scale", "headroom"]),
                       (w4a16, [])):
        res = cli_inproc("int4-to-nvfp4", BUNDLED, dst, "--device", "cpu", "--quiet", *extra)
        assert res.exit_code == 0, res.output
    huge = tmp_path / "huge"
    shutil.copytree(w4a4, huge)
    weight_map = json.loads((huge / INDEX).read_text())["weight_map"]
    for name, shard in weight_map.items():
        if name.endswith(".input_global_scale"):
            edit_tensor(huge / shard, name, lambda t: torch.full_like(t, 1e30))
    cfg = json.loads((BUNDLED / "config.json").read_text())
    ids = torch.arange(64).reshape(2, 32) * 7 % 250
    opened = [open_checkpoint(str(p)) for p in (BUNDLED, w4a4, w4a16, huge)]
    try:
        report = evaluate(opened[0], opened[1:], ids, "cpu", 2, dtype=torch.float32)
    finally:
        for c in opened:
            c.close()
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_token = cfg["num_experts_per_tok"] * (cfg["hidden_size"]
                                              + cfg["moe_intermediate_size"]) // 16
    blocks = [c.activation_blocks for c in report.candidates]
    assert blocks[0].blocks == ids.numel() * moe_layers * per_token
    assert blocks[0].clamped < blocks[0].blocks and blocks[1] is None
    assert blocks[0].input_scale_policy == "headroom"
    assert blocks[2].blocks == blocks[0].blocks
    # g = 1e30 clamps every gate/up block; their outputs, 6 x 448 / 1e30 at most, make the
    # down's inputs underflow to 0 in fp32: blocks of zeros, which never clamp
    assert blocks[2].clamped == ids.numel() * moe_layers * cfg["num_experts_per_tok"] * (
        cfg["hidden_size"] // 16)
