"""The checkpoints the `kconvert audit` test modules audit, as fixtures built once for all of
them: a pytest plugin of those modules (`pytest_plugins = ["audit_fixtures"]`), so that pytest
imports it itself and rewrites its asserts."""

from __future__ import annotations

import json

import pytest
from audit_support import OUTPUTS, REAP_KEEP, RECIPES, run

from helpers import cli_inproc
from kconvert.driver.recipes import load_recipe
from third_party_prune import prune


@pytest.fixture(scope="session")
def outputs(fixture_dir, tmp_path_factory):
    """Every command and recipe, on the fixtures: name -> (output, source)."""
    root = tmp_path_factory.mktemp("audit-outputs")
    kimi, ct, k25, bf16 = (fixture_dir(v) for v in ("k2-int4-kimi", "k2-int4-ct", "k25-int4",
                                                    "bf16"))
    made = {
        "int4-to-nvfp4-ct": (run(kimi, root / "a", "int4-to-nvfp4"), kimi),
        "int4-to-nvfp4-amax": (run(kimi, root / "a2", "int4-to-nvfp4", block_scale="amax"),
                               kimi),
        "int4-to-nvfp4-modelopt": (run(ct, root / "b", "int4-to-nvfp4", format="modelopt"), ct),
        "k25-int4-to-nvfp4-ct": (run(k25, root / "c", "int4-to-nvfp4"), k25),
        "quantize-ct": (run(bf16, root / "e", "quantize"), bf16),
        "quantize-modelopt-all": (run(bf16, root / "f", "quantize", format="modelopt",
                                      targets="experts,shared_experts,dense_mlp,attention"),
                                  bf16),
        "dequant-int4": (run(ct, root / "g", "dequant"), ct),
        "dequant-int4-f32": (run(kimi, root / "g2", "dequant", dtype="F32"), kimi),
    }
    made["dequant-nvfp4"] = (run(made["int4-to-nvfp4-ct"][0], root / "h", "dequant"),
                             made["int4-to-nvfp4-ct"][0])
    plan = root / "reap-plan.json"
    plan.write_text(json.dumps({"criterion": "manual", "layers": {
        k: {"keep": v} for k, v in REAP_KEEP.items()}}))
    made["reap"] = (run(kimi, root / "i", "reap", plan=plan), kimi)
    made["reap-int4-to-nvfp4"] = (run(k25, root / "j", "reap-int4-to-nvfp4", plan=plan), k25)
    for storage in ("dense", "pair-bitmask"):
        for group in (16, 32):
            name = f"sparsify-{storage}-{group}"
            made[name] = (run(kimi, root / name, "sparsify", storage=storage, group_size=group),
                          kimi)
    bitmask = made["sparsify-pair-bitmask-16"][0]
    made["densify"] = (run(bitmask, root / "densify", "densify"), bitmask)
    for recipe in RECIPES:  # as `kconvert run NAME` runs them
        spec = load_recipe(recipe)
        src = {"nvfp4-pair-bitmask": bitmask,
               "mxfp4": made.get("run-int4-to-mxfp4", (kimi,))[0]}.get(spec.requires_source, kimi)
        prunes = any(s.get("stage") == "prune" for s in spec.stages)
        dst = root / f"run-{recipe}"
        res = cli_inproc("run", recipe, src, dst, "--quiet",
                         *(["--plan", str(plan)] if prunes else []))
        assert res.exit_code == 0, res.output
        made[f"run-{recipe}"] = (dst, src)
    assert sorted(made) == sorted(OUTPUTS)
    return made


@pytest.fixture(scope="session")
def pruned(fixture_dir, tmp_path_factory):
    """The third-party pruned checkpoint (8 of 16 experts per layer) and its plan."""
    src = fixture_dir("k2-int4-kimi")
    root = tmp_path_factory.mktemp("pruned")
    plan = prune(src, root / "pruned", keep=8, rule="router-l2")
    (root / "plan.json").write_text(json.dumps(plan))
    return root / "pruned", src, root / "plan.json", plan
