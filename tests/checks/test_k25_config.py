"""Moonshot's K2.5 and K2.6 configs: `text_config.quantization_config` governs the language model
only, under its own module names (`lm_head`, not `language_model.lm_head`), and never the vision
tower or the projector. The audit passes both sources and every output made from them, and still
fails a config that really mis-describes a module."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import assert_audit_passes, audit_json, run_inproc
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.pruning.plan import load_plan
from kconvert.stages.prune import prune_stage
from kconvert.testing.fixture_config import kimi_quantization_config

VARIANTS = ("k25-int4", "k26-int4")
COMMANDS = ("int4-to-nvfp4", "dequant", "sparsify", "reap")


@pytest.fixture(scope="module")
def outputs(fixture_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("k25")
    plan = root / "plan.json"
    plan.write_text(json.dumps({"layers": {str(layer): {"keep": [0, 2, 3, 5, 8, 9, 12, 15]}
                                           for layer in (1, 2)}}))
    made = {}
    for variant in VARIANTS:
        src = fixture_dir(variant)
        for command in COMMANDS:
            dst = root / f"{variant}-{command}"
            if command == "reap":
                convert(str(src), str(dst), load_recipe("reap"), {}, RunControl(quiet=True),
                        prepare=lambda ckpt: {"prune": prune_stage(load_plan(plan), ckpt)})
            else:
                run_inproc(command, src, dst)
            made[(variant, command)] = (src, dst)
    return made


@pytest.mark.parametrize("variant", VARIANTS)
def test_moonshot_sources_pass(fixture_dir, variant):
    src = fixture_dir(variant)
    config = json.loads((src / "config.json").read_text())
    assert "quantization_config" not in config
    want = kimi_quantization_config(k26=variant == "k26-int4")
    assert config["text_config"]["quantization_config"] == want
    assert_audit_passes(src)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_outputs_of_both_pass_with_and_without_source(outputs, variant, command):
    src, dst = outputs[(variant, command)]
    assert_audit_passes(dst)
    assert_audit_passes(dst, "--source", src)


def test_a_config_that_mis_describes_a_module_still_fails(fixture_dir, tmp_path):
    """K2.5's ignore list without its self_attn entry gives attention INT4, which it is not."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("k25-int4"), src)
    path = src / "config.json"
    config = json.loads(path.read_text())
    qconfig = config["text_config"]["quantization_config"]
    qconfig["ignore"] = [e for e in qconfig["ignore"] if "self_attn" not in e]
    path.write_text(json.dumps(config))
    code, report = audit_json(src)
    failed = report["failures"]
    assert code == 1 and not report["passed"]
    assert failed and all("self_attn" in (f["tensor"] or "") for f in failed), failed
    assert any("gives this module INT4" in f["message"] for f in failed)
