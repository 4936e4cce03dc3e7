"""What `sparsify --method learned` promises per expert (docs/learned.md), on a small MoE whose
4 experts (top-2, hidden 64) each get about 2,000 routed tokens from 16 x 256 calibration
tokens: an expert's result does not depend on which experts share its work item (its seed is
its own); its fit and held-out tokens split its routed tokens, every 8th held out, none in
both; an expert below either minimum (fit tokens or held-out tokens) keeps the one-shot
(SparseGPT) bytes; the guard judges held-out error, so a training that only fits its own
tokens is refused; the audit against the source passes what it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kconvert
from helpers import MANIFEST, assert_audit_passes, checkpoint_tensors, write_input_ids
from kconvert.driver import run_plan
from kconvert.gpu.parts import OBS_BATCH
from kconvert.methods import expert_training as et
from kconvert.methods import learned, obs_memory
from kconvert.model.names import parse_name

SAMPLES, SEQ_LEN, TOP_K, EXPERTS = 16, 256, 2, 4
STEPS, TOKENS = 2, 64


@pytest.fixture(scope="module")
def small(fixture_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(a small MoE source, its calibration data)."""
    src = fixture_dir("k2-int4-kimi", hidden=64, moe_intermediate=32, experts=EXPERTS,
                      top_k=TOP_K, moe_layers=1, q_lora_rank=32, heads=2)
    ids = torch.randint(0, 500, (SAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return src, write_input_ids(tmp_path_factory.mktemp("data") / "d.jsonl", ids.tolist())


def _sparsify(small, out: Path, method: str = "learned", **options) -> Path:
    src, data = small
    extra = {"steps": STEPS, "tokens": TOKENS} if method == "learned" else {}
    kconvert.sparsify(str(src), str(out), method=method, data=str(data), samples=SAMPLES,
                      seq_len=SEQ_LEN, device="cpu", **{**extra, **options})
    return out


@pytest.fixture(scope="module")
def runs(small, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {"learned": _sparsify(small, root / "learned"),
            "sparsegpt": _sparsify(small, root / "sparsegpt", "sparsegpt")}


def _experts(out: Path) -> dict[int, dict]:
    """expert -> its record (gate, up and down share one)."""
    obs = json.loads((out / MANIFEST).read_text())["obs"]
    records = {}
    for name, r in obs.items():
        if ".mlp.experts." in name:
            records.setdefault(parse_name(f"{name}.weight").expert, []).append(r)
    assert all(len(rs) == 3 and rs[0] == rs[1] == rs[2] for rs in records.values())
    return {e: rs[0] for e, rs in sorted(records.items())}


def _expert_tensors(out: Path, expert: int) -> dict[str, torch.Tensor]:
    return {k: t for k, t in checkpoint_tensors(out).items()
            if f".mlp.experts.{expert}." in k}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_learning_wins_somewhere_and_the_audit_passes_it(runs, small):
    records = _experts(runs["learned"])
    assert any(r["method"] == "learned" for r in records.values()), records
    assert_audit_passes(runs["learned"], "--source", small[0])


def test_fit_and_held_out_tokens_split_each_experts_routed_tokens(runs):
    """Every routed slot of the data is an expert's fit or held-out token, once: the counts add
    up to samples x seq_len x top-k, and each expert holds out every 8th of its own."""
    records = _experts(runs["learned"])
    routed = {e: r["fit_tokens"] + r["held_out_tokens"] for e, r in records.items()}
    assert sum(routed.values()) == SAMPLES * SEQ_LEN * TOP_K
    for e, r in records.items():
        assert r["held_out_tokens"] == routed[e] // 8, (e, r)


def test_an_experts_result_does_not_depend_on_the_experts_beside_it(runs, small, tmp_path,
                                                                    monkeypatch):
    """Work items of one expert each (another budget's items): every expert's bytes are those
    it has beside the others."""
    plan = run_plan.build_work_plan

    def one_expert_per_item(ckpt, stages, _work_elems, *args, **kwargs):
        return plan(ckpt, stages, 1, *args, **kwargs)

    monkeypatch.setattr(run_plan, "build_work_plan", one_expert_per_item)
    alone = _sparsify(small, tmp_path / "alone")
    assert _same(checkpoint_tensors(alone), checkpoint_tensors(runs["learned"]))


def test_padded_batches_write_the_same_bytes(runs, small, tmp_path, monkeypatch):
    """The GPU's padding forced on the CPU (kconvert.methods.obs_memory.pads_batches): the 4
    experts train and solve as a batch of OBS_BATCH with 12 repeats of the last; the padding's
    results are dropped, and every byte is the unpadded run's."""
    trained = []
    train = et.train
    monkeypatch.setattr(et, "train", lambda experts, *a: trained.append(len(experts.x))
                        or train(experts, *a))
    monkeypatch.setattr(obs_memory, "pads_batches", lambda device: True)
    padded = _sparsify(small, tmp_path / "padded")
    assert trained == [OBS_BATCH]
    assert _same(checkpoint_tensors(padded), checkpoint_tensors(runs["learned"]))


def test_the_router_weights_come_from_calls_of_one_row_count():
    """A product's rounding follows its row count (benchmarks learned_batches), and a rank
    captures another count of tokens than one process: every router call has ROUTER_ROWS rows,
    the last padded with zeros, and each token's weights are its own row's."""
    rows = []

    def gate(x):  # a row's weights depend on that row alone, as the router's
        rows.append(len(x))
        return None, torch.stack([x.sum(-1), x.amax(-1)], -1)

    x = torch.randn(learned.ROUTER_ROWS + 100, 8, generator=torch.Generator().manual_seed(0))
    got = torch.cat([learned.router_weights(gate, part)
                     for part in x.split(learned.ROUTER_ROWS)])
    assert rows == [learned.ROUTER_ROWS] * 2
    assert torch.equal(got, gate(x)[1])


@pytest.mark.parametrize("minimum", ["fit", "held-out"])
def test_an_expert_below_either_minimum_keeps_the_one_shot_result(runs, small, tmp_path,
                                                                  monkeypatch, minimum):
    """The minimum raised to just above the second-busiest expert's count: the two busiest
    train (at least the busiest), the others keep SparseGPT's bytes and records say why."""
    records = _experts(runs["learned"])
    key = "fit_tokens" if minimum == "fit" else "held_out_tokens"
    counts = sorted(r[key] for r in records.values())
    bar = counts[-2] + 1
    monkeypatch.setattr(learned, "MIN_FIT_TOKENS" if minimum == "fit" else "HELDOUT_MIN", bar)
    out = _sparsify(small, tmp_path / "out")
    got = _experts(out)
    below = {e for e, r in records.items() if r[key] < bar}
    assert len(below) == EXPERTS - 1
    for e, r in got.items():
        if e in below:
            assert r["method"] == "sparsegpt" and r["learned_error"] is None, (e, r)
            assert r["oneshot_error"] is None, (e, r)
            assert _same(_expert_tensors(out, e), _expert_tensors(runs["sparsegpt"], e)), e
        else:
            assert r["learned_error"] is not None, (e, r)


def test_the_guard_judges_held_out_error_not_fit_error(runs, small, tmp_path, monkeypatch):
    """Trained long on 16 tokens each, every expert fits those and loses on the tokens it
    did not see: the guard, judging held-out error, keeps SparseGPT's bytes everywhere.
    Margin, measured on a 2-core CPU: every expert's learned held-out error is at least 1.47x
    its one-shot error."""
    monkeypatch.setattr(learned, "MAX_FIT_TOKENS", 16)
    monkeypatch.setattr(learned, "MIN_FIT_TOKENS", 16)
    out = _sparsify(small, tmp_path / "out", steps=30, tokens=16)
    got = _experts(out)
    assert all(r["fit_tokens"] == 16 and r["method"] == "sparsegpt" for r in got.values()), got
    assert all(r["learned_error"] > r["oneshot_error"] for r in got.values()), got
    for e in got:
        assert _same(_expert_tensors(out, e), _expert_tensors(runs["sparsegpt"], e)), e
