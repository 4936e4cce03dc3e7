"""A plug-in from outside the package, one module and one registration call, used everywhere a
built-in one is (command line, recipe, Python API, manifest, docs table, audit); the methods
table is what the declarations write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers import checkpoint_tensors

# --- A plug-in from outside the package, used everywhere a built-in one is -----------------

# A quantize method of a test, one module: its declaration (two settings, a stage record, a
# per-matrix record) and its class, and one registration call. Each routed expert's rows
# (all, or the even ones) are scaled by 1 - permille / 1000 before the codec's rounding, and
# each matrix records how many rows it scaled and their squared norm before.
SHRINK_PLUGIN = '''
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kconvert.formats.linear import Transformed
from kconvert.methods.base import Method
from kconvert.plugins.methods import register_method
from kconvert.plugins.registry import Declaration
from kconvert.pruning.kinds import Criterion


class ShrinkSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shrink_permille: int = Field(0, ge=0, le=100, description="how much rows shrink, in 1/1000.")
    shrink_rows: Literal["all", "even"] = Field("all", description="which rows shrink.")


class ShrinkRecord(BaseModel):
    shrink_permille: int | None = Field(None, description="how much rows shrank, in 1/1000")
    shrink_rows: str | None = None


class ShrinkEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shrunk_rows: int
    norm_before: float


class Shrink(Method):
    declaration = Declaration(
        "shrink", ("quantize",), "rows scaled toward zero (a test's method)",
        f"{__name__}:Shrink", ShrinkSettings, record=ShrinkRecord, matrix_record=ShrinkEntry)

    def transforms(self, m) -> bool:
        return True

    def transform_batch(self, batch):
        w = batch.weights.clone()
        rows = slice(None) if self.settings["shrink_rows"] == "all" else slice(None, None, 2)
        w[:, rows] *= 1 - self.settings["shrink_permille"] / 1000
        return Transformed(w, records=[
            {"shrunk_rows": int(m[rows].shape[0]), "norm_before": float(m[rows].square().sum())}
            for m in batch.weights])

    def record(self):
        return {"method": self.name, "shrink_permille": self.settings["shrink_permille"],
                "shrink_rows": self.settings["shrink_rows"]}


register_method(Shrink.declaration)
'''


def _with_plugin(tmp_path: Path, module: str, text: str, code: str, *args: object
                 ) -> subprocess.CompletedProcess:
    """A fresh interpreter that imports the plug-in module `module` (its source `text`, in
    tmp_path) first, as a program that ships its own plug-ins would, then runs `code` with
    sys.argv[1:] = args."""
    (tmp_path / f"{module}.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", f"import {module}\n{code}", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


CLI_WITH_PLUGIN = "from kconvert.cli import run\nrun()"


def test_a_new_method_with_settings_is_one_module_and_one_registration(tmp_path):
    """The plug-in method above, registered by one call, is offered by `--help` (its name and
    both settings), runs from the command line with its settings, from a `run` recipe and
    through the Python API (the same bytes each way), records its settings in the stage record
    and one entry per matrix in the manifest, is in the docs table, and passes the audit."""
    from conftest import BUNDLED

    def cli(*args: object) -> subprocess.CompletedProcess:
        return _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN, CLI_WITH_PLUGIN, *args)

    shown = cli("quantize", "--help").stdout
    assert "shrink:" in shown and "--shrink-permille" in shown and "--shrink-rows" in shown
    assert "--shrink-permille" in cli("run", "--help").stdout

    cli("quantize", BUNDLED, tmp_path / "cli", "--method", "shrink", "--shrink-permille", 3,
        "--shrink-rows", "even", "--device", "cpu", "--quiet")
    (tmp_path / "shrink.toml").write_text(
        'name = "shrink"\n[[stages]]\nstage = "quantize"\nmethod = "shrink"\n'
        'shrink_permille = 3\nshrink_rows = "even"\n')
    cli("run", tmp_path / "shrink.toml", BUNDLED, tmp_path / "recipe", "--device", "cpu",
        "--quiet")
    _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN,
                 "import sys, kconvert\nkconvert.quantize(sys.argv[1], sys.argv[2], "
                 "method='shrink', shrink_permille=3, shrink_rows='even', device='cpu')",
                 BUNDLED, tmp_path / "api")
    cli("quantize", BUNDLED, tmp_path / "none", "--method", "shrink", "--device", "cpu",
        "--quiet")

    manifests = {name: json.loads((tmp_path / name / "kconvert-manifest.json").read_text())
                 for name in ("cli", "recipe", "api", "none")}
    made = manifests["cli"]
    assert made["options"]["quantize"]["method"] == "shrink"
    assert made["options"]["quantize"]["shrink_permille"] == 3
    assert made["options"]["quantize"]["shrink_rows"] == "even"
    assert manifests["none"]["options"]["quantize"]["shrink_permille"] == 0  # its default
    assert made["tensors"] == manifests["recipe"]["tensors"] == manifests["api"]["tensors"]
    assert made["tensors"] != manifests["none"]["tensors"]  # the setting reached the method

    # per matrix: every routed expert's record, computed here from the source's values
    kconvert_dequant = _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN,
                                    CLI_WITH_PLUGIN, "dequant", BUNDLED, tmp_path / "f32",
                                    "--dtype", "F32", "--device", "cpu", "--quiet")
    assert kconvert_dequant.returncode == 0
    source = checkpoint_tensors(tmp_path / "f32")
    experts = {n.removesuffix(".weight"): w for n, w in source.items()
               if ".mlp.experts." in n}
    assert experts and set(made["obs"]) == set(experts)
    for module, w in experts.items():
        entry = made["obs"][module]
        assert entry["shrunk_rows"] == (w.shape[0] + 1) // 2
        assert entry["norm_before"] == pytest.approx(float(w[::2].square().sum()), rel=1e-6)

    docs = _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN,
                        "from kconvert.plugins.docs import families, render\n"
                        "print(render(families()))").stdout
    assert "| `shrink` | quantize |" in docs and "`--shrink-permille` (0)" in docs

    report = json.loads(cli("audit", tmp_path / "cli", "--source", BUNDLED, "--json",
                            "--quiet", "--device", "cpu").stdout)
    assert report["passed"], report["failures"]
    assert not [w for w in report["warnings"] if "RunRecord" in str(w)]  # its record is typed


# A compensation kind of a test, one module: the shared expert's down_proj re-fitted as
# `shared` does, at one stiff ridge only, and one registration call.
STIFF_PLUGIN = '''
from kconvert.plugins.pruning import COMPENSATIONS
from kconvert.plugins.registry import Declaration
from kconvert.pruning.kinds import CompensationKind


class StiffShared(CompensationKind):
    declaration = Declaration(
        "stiff-shared", ("prune",), "the shared expert's down_proj re-fitted at ridge 1 only "
        "(a test's kind)", f"{__name__}:StiffShared", needs="data", gpu=True)
    ridges = (1.0,)


COMPENSATIONS.register(StiffShared.declaration)
'''


def test_a_new_compensation_kind_is_one_module_and_one_registration(tmp_path):
    """The compensation kind above, registered by one call, is offered by `reap --help`, runs
    from the command line, from a `run` recipe and through the Python API (the same bytes each
    way), is recorded in the manifest and the plan (its name, its one ridge, per layer), is in
    the docs table, and passes the audit."""
    from helpers import write_input_ids
    from kconvert.testing.tiny_moe import corpus_ids, windows

    src = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
    data = write_input_ids(tmp_path / "calib.jsonl", windows(
        corpus_ids("train"), 8, 64, torch.Generator().manual_seed(3)))
    calibration = ["--data", data, "--keep", 12, "--samples", 8, "--seq-len", 64]

    def cli(*args: object) -> subprocess.CompletedProcess:
        return _with_plugin(tmp_path, "stiff_plugin", STIFF_PLUGIN, CLI_WITH_PLUGIN, *args)

    assert "stiff-shared:" in cli("reap", "--help").stdout
    cli("reap", src, tmp_path / "cli", *calibration, "--compensate", "stiff-shared",
        "--device", "cpu", "--quiet")
    (tmp_path / "stiff.toml").write_text(
        'name = "stiff"\n[[stages]]\nstage = "prune"\ncompensate = "stiff-shared"\n')
    cli("run", tmp_path / "stiff.toml", src, tmp_path / "recipe", *calibration, "--device",
        "cpu", "--quiet")
    _with_plugin(tmp_path, "stiff_plugin", STIFF_PLUGIN,
                 "import sys, kconvert\nkconvert.reap(sys.argv[1], sys.argv[2], data=sys.argv[3], "
                 "keep=12, samples=8, seq_len=64, compensate='stiff-shared', device='cpu')",
                 src, tmp_path / "api", data)

    manifests = {name: json.loads((tmp_path / name / "kconvert-manifest.json").read_text())
                 for name in ("cli", "recipe", "api")}
    made = manifests["cli"]
    assert made["options"]["prune"]["compensate"] == "stiff-shared"
    assert made["tensors"] == manifests["recipe"]["tensors"] == manifests["api"]["tensors"]
    plan = json.loads((tmp_path / "cli" / "reap-plan.json").read_text())
    assert plan["compensation"] == "stiff-shared"
    records = [layer["compensation"] for layer in plan["layers"].values()]
    assert records and all(r["method"] == "stiff-shared" and r["ridge"] == 1.0
                           for r in records)
    # what it re-fits: the shared experts' down_proj only, where its guard applied it
    refit = {name for r in records for name in r["matrices_xxh3"]}
    assert all(".shared_experts.down_proj." in name for name in refit)

    docs = _with_plugin(tmp_path, "stiff_plugin", STIFF_PLUGIN,
                        "from kconvert.plugins.docs import families, render\n"
                        "print(render(families()))").stdout
    assert "| `stiff-shared` | prune |" in docs

    report = json.loads(cli("audit", tmp_path / "cli", "--source", src, "--json", "--quiet",
                            "--device", "cpu").stdout)
    assert report["passed"], report["failures"]
    assert not [w for w in report["warnings"] if "RunRecord" in str(w)]


def test_the_methods_table_is_current():
    """docs/methods.md is what the plug-ins' declarations write now."""
    from kconvert.plugins.docs import families, render

    assert (ROOT / "docs" / "methods.md").read_text() == render(families()) + "\n", \
        "docs/methods.md is stale: python -m kconvert.plugins.docs > docs/methods.md"
