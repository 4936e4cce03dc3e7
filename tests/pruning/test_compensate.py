"""REAP compensation (`kconvert reap --compensate shared|down|learned`), router repair by
bias, and the new criteria, end to end through the command line on both trained tiny MoEs.

Oracles: transformers' DeepSeek-V3 model loads every output, and its MoE blocks compute what
a routing written in the test (tests/helpers.kimi_moe_block) computes from the tensors on disk
(the solver itself: test_compensate_solve.py); the audit accepts what the plan records and
names an altered re-fitted matrix; the same command twice writes the same bytes.
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
from kconvert.plugins.pruning import COMPENSATIONS, CRITERIA
from kconvert.pruning.plan import PLAN_FILE, load_plan
from kconvert.pruning.reap import keep_ids, plan_from_scores, tensor_hash
from kconvert.testing.tiny_moe import corpus_ids, windows

FIXTURES = {"trained": ROOT / "tests" / "fixtures" / "tiny-moe-trained",
            "96": ROOT / "tests" / "fixtures" / "tiny-moe-96"}
SEQ = 64
RUNS = {  # name -> (fixture, keep, flags)
    "down": ("trained", 12, ["--compensate", "down"]),
    "router+down": ("trained", 12, ["--repair", "router", "--compensate", "down"]),
    "router+down-again": ("trained", 12, ["--repair", "router", "--compensate", "down"]),
    "learned": ("trained", 12, ["--compensate", "learned"]),
    "learned-again": ("trained", 12, ["--compensate", "learned"]),
    "bias": ("trained", 12, ["--repair", "bias"]),
    "msan": ("trained", 12, ["--criterion", "msan"]),
    # every other option, twice
    "msan+bias+shared": ("trained", 12, ["--criterion", "msan", "--repair", "bias",
                                         "--compensate", "shared"]),
    "msan+bias+shared-again": ("trained", 12, ["--criterion", "msan", "--repair", "bias",
                                               "--compensate", "shared"]),
    "96-down": ("96", 48, ["--repair", "router", "--compensate", "down"]),
    # 192 fit tokens: 32 per kept expert on average, as many as its inputs, so the solver's
    # token form (fewer tokens than inputs, as on Kimi) and its input form both run
    "96-few": ("96", 48, ["--samples", "4", "--compensate", "down"]),
    "96-few-again": ("96", 48, ["--samples", "4", "--compensate", "down"]),
}


def _reap(src: Path, dst: Path, data: Path, keep: int, *extra: str):
    samples = [] if "--samples" in extra else ["--samples", "12"]
    return cli_inproc("reap", src, dst, "--data", data, "--keep", keep, *samples, "--seq-len", SEQ,
                      "--quiet", *extra)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compensate")
    # seed 0: every run's compensation is applied by a wide margin in some layer (see
    # test_refit_matrices_are_recorded_and_the_rest_is_the_source)
    ids = windows(corpus_ids("train"), 12, SEQ, torch.Generator().manual_seed(0))
    data = write_input_ids(root / "calib.jsonl", ids)
    out = {"data": data}
    for name, (fixture, keep, flags) in RUNS.items():
        out[name] = root / name
        res = _reap(FIXTURES[fixture], out[name], data, keep, *flags)
        assert res.exit_code == 0, res.output
    return out


def test_compensation_choices_agree():
    """--compensate offers every declared compensation kind, each one's class declaring it."""
    option = next(p for p in main.commands["reap"].params if p.name == "compensate")
    assert tuple(option.type.choices) == COMPENSATIONS.names("prune")
    assert all(d.load().declaration is d for d in COMPENSATIONS)


@pytest.mark.parametrize("run", [r for r in RUNS if not r.endswith("-again")])
def test_output_loads_in_transformers_and_blocks_route_as_written(made, run):
    assert_moe_blocks_route_as_written(made[run], tokens=32, tol=1e-5)


@pytest.mark.parametrize("run", ["down", "router+down", "msan+bias+shared", "96-down",
                                 "96-few", "learned"])
def test_refit_matrices_are_recorded_and_the_rest_is_the_source(made, run):
    """Whatever each layer's guard decided, its record follows the guard's rule and the bytes
    follow the record; each run applies its compensation in some layer by a wide margin
    (held-out MSE falls, measured): down 54%, 46%, 35% (layers 1-3); router+down 40%, 45%,
    32%; msan+bias+shared 23%, 22%, 20%; 96-down 31%, 28%; 96-few 12.5% in layer 2 (layer 1:
    0.8%, either way on another machine); learned 54%, 45%, 37% (its training: 19% in layer
    1, 9% and 8% in layers 2-3)."""
    fixture, _, flags = RUNS[run]
    plan = load_plan(made[run] / PLAN_FILE)
    method = flags[flags.index("--compensate") + 1]
    assert plan.compensation == method
    out, src = checkpoint_tensors(made[run]), checkpoint_tensors(FIXTURES[fixture])
    applied = 0
    for key, entry in plan.layers.items():
        rec = entry.compensation
        assert rec is not None and rec.method == method
        p = f"model.layers.{key}.mlp."
        kept = range(len(entry.keep))
        refit = {f"{p}shared_experts.down_proj.weight"}
        if method != "shared":
            refit |= {f"{p}experts.{i}.down_proj.weight" for i in kept}
        written = set()
        if rec.applied:
            applied += 1
            assert rec.heldout_mse_after < rec.heldout_mse_before
            written |= refit
        assert (rec.learned is not None) == (method == "learned")
        if rec.learned is not None and rec.learned.applied:
            applied += 1
            assert rec.learned.heldout_mse_after < rec.learned.heldout_mse_before
            written |= {f"{p}experts.{i}.{proj}.weight" for i in kept
                        for proj in ("gate_proj", "up_proj", "down_proj")}
        assert set(rec.matrices_xxh3) == written
        for name, digest in rec.matrices_xxh3.items():
            assert out[name].dtype == torch.bfloat16 and tensor_hash(out[name]) == digest
        shared = f"{p}shared_experts.down_proj.weight"
        assert torch.equal(out[shared], src[shared]) != (shared in rec.matrices_xxh3)
        for i, s in enumerate(entry.keep):  # the source's, unless re-fitted
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"{p}experts.{i}.{proj}.weight"
                if name not in rec.matrices_xxh3:
                    assert torch.equal(out[name], src[f"{p}experts.{s}.{proj}.weight"])
    assert applied, "no layer's compensation lowered its held-out error"


@pytest.mark.parametrize("run", ["router+down", "msan+bias+shared", "96-few", "learned"])
def test_same_command_twice_writes_the_same_bytes(made, run):
    """Together the two commands use every option (router repair had written different rows
    on every run: its fit's backward summed through indexing in a varying order)."""
    a, b = made[run], made[run + "-again"]
    files = sorted(p.name for p in a.iterdir() if p.suffix in (".safetensors", ".json")
                   and p.name != "kconvert-manifest.json")
    assert files
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("run", ["router+down", "bias", "96-down", "learned"])
def test_audit_passes(made, run):
    assert_audit_passes(made[run], "--source", FIXTURES[RUNS[run][0]])


def test_audit_names_an_altered_refit_matrix(made, tmp_path):
    """In the first layer the guard applied (layer 1: held-out MSE 0.411 -> 0.189, 54%)."""
    dst = shutil.copytree(made["down"], tmp_path / "altered")
    plan = load_plan(dst / PLAN_FILE)
    layer, entry = next((k, v) for k, v in plan.layers.items() if v.compensation.applied)
    name = f"model.layers.{layer}.mlp.experts.3.down_proj.weight"
    assert name in entry.compensation.matrices_xxh3
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    edit_tensor(dst / index["weight_map"][name], name, add_at((5, 7), 0.125))
    code, report = audit_json(dst, "--source", FIXTURES["trained"])
    assert code == 1
    found = [f for f in report["failures"] if f["check"] == "refit"]
    assert len(found) == 1 and found[0]["tensor"] == name, report["failures"]
    assert found[0]["layer"] == int(layer)


def test_man_and_msan_rank_by_routed_token_means():
    count = torch.tensor([10.0, 1.0, 4.0, 0.0], dtype=torch.float64)
    norms = [[1.0] * 10, [5.0], [2.0, 2.0, 2.0, 10.0], []]
    s = {"saliency": torch.zeros(4, dtype=torch.float64), "count": count,
         "ean_sum": torch.tensor([sum(n) for n in norms], dtype=torch.float64),
         "ean_sq_sum": torch.tensor([sum(v * v for v in n) for n in norms],
                                    dtype=torch.float64)}
    man = plan_from_scores({1: s}, 2, "man").layers["1"].keep
    msan = plan_from_scores({1: s}, 2, "msan").layers["1"].keep
    assert man == keep_ids(torch.tensor([1.0, 5.0, 4.0, 0.0]), 2) == [1, 2]
    assert msan == [1, 2] and {"man", "msan"} <= set(CRITERIA.names())
    ean = plan_from_scores({1: s}, 2, "ean").layers["1"].keep
    assert ean == [0, 2]  # sums favour the often-routed expert; the means do not


def test_keep_beside_a_plan(made, tmp_path):
    plan = made["down"].parent / "msan" / PLAN_FILE
    src = FIXTURES["trained"]
    ok = cli_inproc("reap", src, tmp_path / "a", "--plan", plan, "--keep", "12", "--quiet")
    assert ok.exit_code == 0, ok.output
    bad = cli_inproc("reap", src, tmp_path / "b", "--plan", plan, "--keep", "10", "--quiet")
    assert bad.exit_code == 2
    assert "--keep 10" in bad.output and "keeps 12" in bad.output


def test_compensation_needs_data(made, tmp_path):
    res = cli_inproc("reap", FIXTURES["trained"], tmp_path / "o", "--plan",
                     made["down"] / PLAN_FILE, "--compensate", "down")
    assert res.exit_code == 2 and "--data" in res.output
