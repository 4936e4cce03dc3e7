"""The prune plan file `kconvert audit --plan` and the reap command read: its committed JSON
schema is current and a bad plan is refused with one line naming the field."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from kconvert.pruning.plan import PrunePlan, load_plan, plan_json_schema

# ------------------------------------------------------------------ plan file and schema


def test_committed_plan_schema_is_current():
    committed = json.loads((ROOT / "manifests" / "plan.schema.json").read_text())
    assert committed == plan_json_schema(), (
        "regenerate: python -m kconvert.plan > manifests/plan.schema.json")
    layer = committed["$defs"]["PruneLayer"]["properties"]
    assert {"keep", "saliency", "frequency"} <= set(layer)
    assert {"criterion", "layers"} <= set(committed["properties"])


def test_plan_validation(tmp_path):
    ok = PrunePlan.model_validate({"criterion": "reap", "layers": {
        "1": {"keep": [0, 2, 5], "saliency": [1, 0, 2, 0, 0, 3], "frequency": [4, 0, 1, 0, 0, 2]}}})
    assert ok.keep(1) == [0, 2, 5] and ok.keep(2) is None
    for bad in ({"layers": {"1": {"keep": [2, 1]}}},  # not ascending
                {"layers": {"1": {"keep": [1, 1]}}},  # duplicate
                {"layers": {"1": {"keep": [0, 9], "saliency": [0.0] * 4}}},  # beyond source
                {"layers": {"x": {"keep": [0]}}},  # not a layer index
                {"n_routed_experts": 4, "layers": {"1": {"keep": [0, 4]}}}):
        path = tmp_path / "p.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(Exception, match="invalid plan") as info:
            load_plan(path)
        # one line naming the field, without pydantic's boilerplate
        said = str(info.value)
        assert "\n" not in said and "errors.pydantic.dev" not in said and "[type=" not in said
        assert "layer" in said and "Value error" not in said, said
    path.write_text(json.dumps({"layers": {"1": {"keep": "x"}}}))
    with pytest.raises(Exception, match=r"invalid plan: layers\.1\.keep: Input should be"):
        load_plan(path)
