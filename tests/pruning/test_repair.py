"""REAP router repair (`kconvert reap --repair bias|router`) on the trained tiny MoE.

Oracles: transformers' DeepSeek-V3 model loads the repaired output, and its MoE block computes
what a routing written here from the plan's description (sigmoid scores, bias for selection,
renormalised top-k weights times routed_scaling_factor) computes with the rows on disk; the
audit accepts the repaired rows the plan records and names the layer and row of an altered one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers import (
    add_at,
    assert_audit_passes,
    assert_moe_blocks_route_as_written,
    audit_json,
    checkpoint_tensors,
    cli_inproc,
    edit_tensor,
    write_input_ids,
)
from kconvert.cli import main
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import open_checkpoint
from kconvert.plugins.pruning import REPAIRS
from kconvert.pruning.plan import PLAN_FILE, load_plan, parse_plan
from kconvert.pruning.reap import row_hashes
from kconvert.stages.prune import prune_stage
from kconvert.testing.tiny_moe import corpus_ids, windows

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
KEEP = 12
SEQ = 64


def _reap(dst: Path, data: Path, *extra: str) -> None:
    res = cli_inproc("reap", SRC, dst, "--data", data, "--keep", KEEP, "--samples", "12",
                     "--seq-len", SEQ, "--quiet", *extra)
    assert res.exit_code == 0, res.output


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repair")
    # seed 2: each repair is applied by a wide margin in some layer (see
    # test_repaired_rows_are_recorded_and_differ_from_source)
    ids = windows(corpus_ids("train"), 12, SEQ, torch.Generator().manual_seed(2))
    data = write_input_ids(root / "calib.jsonl", ids)
    out = {"data": data}
    for method in ("none", "bias", "router"):
        out[method] = root / method
        _reap(out[method], data, "--repair", method)
    out["default"] = root / "default"
    _reap(out["default"], data)
    return out


def test_repair_choices_agree():
    """--repair offers every declared repair kind, each one's class declaring it."""
    option = next(p for p in main.commands["reap"].params if p.name == "repair")
    assert tuple(option.type.choices) == REPAIRS.names("prune")
    assert all(d.load().declaration is d for d in REPAIRS)


def test_repair_none_is_todays_output(made):
    """--repair none writes what a run without --repair writes: source rows, same plan."""
    a, b = made["none"], made["default"]
    for f in [*sorted(p.name for p in a.glob("*.safetensors")), PLAN_FILE]:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    plan = json.loads((a / PLAN_FILE).read_text())
    assert "repair" not in plan and all("repair" not in v for v in plan["layers"].values())
    manifest = json.loads((a / "kconvert-manifest.json").read_text())
    assert "repair" not in json.dumps(manifest["options"])


@pytest.mark.parametrize("method", ["bias", "router"])
def test_repaired_rows_are_recorded_and_differ_from_source(made, method):
    """Through the command line: the plan and manifest record the repair, and the rows on disk
    are the recorded ones; `bias` changes only e_score_correction_bias (the gate rows are the
    source's kept rows, bit for bit), `router` the gate rows too; a refused layer keeps the
    source's rows. The guard applies each repair by a wide margin in some layer (held-out MSE
    falls, measured): bias 26% in layer 3 (layers 1-2: 6% and 3.5%); router 19% and 21% in
    layers 1 and 3 (layer 2: 8%)."""
    plan = load_plan(made[method] / PLAN_FILE)
    assert plan.repair == method
    manifest = json.loads((made[method] / "kconvert-manifest.json").read_text())
    assert method in json.dumps(manifest["options"])
    out, src = checkpoint_tensors(made[method]), checkpoint_tensors(SRC)
    applied = 0
    for key, entry in plan.layers.items():
        rec = entry.repair
        assert rec is not None and rec.method == method
        w = out[f"model.layers.{key}.mlp.gate.weight"]
        b = out[f"model.layers.{key}.mlp.gate.e_score_correction_bias"]
        assert w.dtype == torch.bfloat16 and b.dtype == torch.float32
        assert row_hashes(w) == rec.gate_rows_xxh3 and b.tolist() == rec.bias
        sw = src[f"model.layers.{key}.mlp.gate.weight"][entry.keep]
        sb = src[f"model.layers.{key}.mlp.gate.e_score_correction_bias"][entry.keep]
        if rec.applied:
            applied += 1
            assert rec.heldout_mse_after < rec.heldout_mse_before
            assert not torch.equal(b, sb)
            assert torch.equal(w, sw) if method == "bias" else not torch.equal(w, sw)
        else:
            assert torch.equal(w, sw) and torch.equal(b, sb)
        for e, s in enumerate(entry.keep):  # experts are never changed
            for p in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{key}.mlp.experts.{{}}.{p}.weight"
                assert torch.equal(out[name.format(e)], src[name.format(s)])
    assert applied, "no layer's repair lowered its held-out error"


@pytest.mark.parametrize("method", ["bias", "router"])
def test_repaired_output_loads_in_transformers_and_routes_as_written(made, method):
    assert_moe_blocks_route_as_written(made[method], tokens=64, tol=1e-5)


@pytest.mark.parametrize("method", ["bias", "router"])
def test_audit_passes_on_repaired_output(made, method):
    assert_audit_passes(made[method], "--source", str(SRC))


def test_audit_names_layer_and_row_of_an_altered_repaired_row(made, tmp_path):
    """In the first layer the guard applied (layer 1: held-out MSE 0.404 -> 0.327, 19%)."""
    dst = shutil.copytree(made["router"], tmp_path / "altered")
    plan = load_plan(dst / PLAN_FILE)
    layer = next(int(k) for k, v in plan.layers.items() if v.repair.applied)
    name = f"model.layers.{layer}.mlp.gate.weight"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][name]
    edit_tensor(shard, name, add_at((5, 3), 0.25))
    code, report = audit_json(dst, "--source", str(SRC))
    assert code == 1
    found = [f for f in report["failures"] if f["group"] == "source" and f["check"] == "router"]
    assert len(found) == 1, report["failures"]
    assert found[0]["layer"] == layer and found[0]["tensor"] == name
    assert "row 5 " in found[0]["message"]


def test_a_repaired_plan_file_alone_is_refused(made):
    ckpt = open_checkpoint(str(SRC))
    try:
        with pytest.raises(KconvertError, match="only a calibration run can compute"):
            prune_stage(load_plan(made["router"] / PLAN_FILE), ckpt)
    finally:
        ckpt.close()


def test_repair_without_data_is_refused(made, tmp_path):
    plan = made["none"] / PLAN_FILE
    res = cli_inproc("reap", SRC, tmp_path / "o", "--plan", plan, "--repair", "bias")
    assert res.exit_code != 0 and "--data" in res.output


def test_plan_repair_record_must_cover_the_kept_rows():
    layer = {"keep": [0, 1], "repair": {
        "method": "bias", "applied": True, "fit_tokens": 1, "heldout_tokens": 1,
        "fit_mse_before": 1.0, "fit_mse_after": 0.5, "heldout_mse_before": 1.0,
        "heldout_mse_after": 0.5, "gate_rows_xxh3": ["00"], "bias": [0.0]}}
    with pytest.raises(KconvertError, match="repair records 1 rows but keep has 2"):
        parse_plan({"layers": {"1": layer}})
