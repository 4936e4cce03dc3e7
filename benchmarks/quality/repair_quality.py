"""REAP router repair quality on the trained tiny MoE (docs/tiny-moe.md).

For keep 75% / 50% / 25% of the 24 experts x repair none / bias / router (REAP criterion):
prune tests/fixtures/tiny-moe-trained with kconvert (calibration: 64 x 256 bytes of training
text, as tests/pruning/test_reap_quality.py), load source and pruned model whole into
transformers' DeepseekV3ForCausalLM (model_type "deepseek_v3", fp32), and measure on held-out
text the mean per-token KL(source || pruned) and the NLL increase (nats per byte).

    python -m benchmarks repair_quality --out benchmarks/results/repair_tiny_moe

writes OUT with .json and .md suffixes (the .md: the table in docs/quality.md, "REAP router
repair"); CPU, about 5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# Spin-waiting OpenMP threads slow small CPU steps ~10x on a shared machine (docs/tiny-moe.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from benchmarks.harness import REPO, Timer, arguments, record
from kconvert.calibrate.run import measure_stats
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.io.checkpoint import open_checkpoint
from kconvert.pruning.plan import PrunePlan
from kconvert.pruning.reap import plan_from_scores, scores_of
from kconvert.pruning.repair import RepairSettings, RouterRepair, with_repair
from kconvert.stages.prune import prune_stage
from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, load_kimi_checkpoint, windows

SRC = REPO / "tests" / "fixtures" / "tiny-moe-trained"
KEEPS = (18, 12, 6)  # of 24
METHODS = ("none", "bias", "router")


def log_probs(model_dir: Path, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """Next-token log-probabilities [sequences, len-1, vocab] of the model in `model_dir`."""
    model = load_kimi_checkpoint(model_dir)
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[0], batch):
            out.append(model(ids[s:s + batch]).logits[:, :-1].float().log_softmax(-1))
    return torch.cat(out)


def compare(source: torch.Tensor, pruned: torch.Tensor, ids: torch.Tensor) -> dict:
    target = ids[:, 1:, None]
    nll = lambda lp: float(-lp.gather(-1, target).mean())  # noqa: E731
    kl = float((source.exp() * (source - pruned)).sum(-1).mean())
    return {"kl": kl, "nll": nll(pruned), "nll_increase": nll(pruned) - nll(source)}


def prune(keep: int, settings: RepairSettings | None, calib: torch.Tensor, dst: Path,
          src: Path = SRC) -> PrunePlan:
    """Prune `src` into dst keeping `keep` experts per layer, with the router repair and
    compensation `settings` ask for in the calibration pass (None: plain REAP); its plan."""
    ckpt = open_checkpoint(str(src))
    try:
        fixer = None if settings is None else RouterRepair(
            ckpt, calib, settings, torch.device("cpu"), torch.float32, 16)
        stats = measure_stats(ckpt, calib, "cpu", 16, dtype=torch.float32, on_weights=fixer)
        plan = plan_from_scores(scores_of(stats), keep, "reap")
    finally:
        ckpt.close()
    rows = matrices = None
    options = {"repair": "none"}
    if fixer is not None:
        plan, rows, matrices = with_repair(plan, fixer), fixer.rows, fixer.matrices
        options = {"repair": settings.method, "compensate": settings.compensate}
    convert(str(src), str(dst), load_recipe("reap"), options, RunControl(quiet=True),
            prepare=lambda c: {"prune": prune_stage(plan, c, rows, matrices)})
    return plan


def table(results: list[dict], source_nll: float) -> str:
    lines = [f"Held-out: {results[0]['heldout_tokens']} bytes, source NLL {source_nll:.4f} "
             "nats/byte. KL(source || pruned) per token and NLL increase; KL change vs none "
             "at the same keep.", "",
             "| keep | repair | KL | KL vs none | NLL increase | layers repaired |",
             "|---|---|---|---|---|---|"]
    none = {r["keep"]: r["kl"] for r in results if r["method"] == "none"}
    for r in results:
        applied = sum(v["applied"] for v in r["layers"].values())
        change = (r["kl"] / none[r["keep"]] - 1) * 100
        lines.append(f"| {r['keep']}/24 | {r['method']} | {r['kl']:.4f} | {change:+.1f}% | "
                     f"{r['nll_increase']:+.4f} | "
                     f"{applied if r['method'] != 'none' else '-'}"
                     f"{'/' + str(len(r['layers'])) if r['layers'] else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = arguments("repair_quality", __doc__)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "repair_tiny_moe"))
    ap.add_argument("--heldout-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    calib = windows(corpus_ids("train"), 64, 256, torch.Generator().manual_seed(1))
    held = heldout_ids(args.heldout_tokens, seed=0).reshape(-1, 256)
    source = log_probs(SRC, held)
    source_nll = float(-source.gather(-1, held[:, 1:, None]).mean())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for keep in KEEPS:
            for method in METHODS:
                made = Timer()
                dst = Path(tmp) / f"{keep}-{method}"
                plan = prune(keep, None if method == "none" else RepairSettings(
                    method, keep, "reap"), calib, dst)
                layers = {k: v.repair.model_dump() for k, v in plan.layers.items()
                          if v.repair is not None}
                r = {"keep": keep, "method": method, **compare(source, log_probs(dst, held), held),
                     "layers": layers, "heldout_tokens": held.numel(),
                     "seconds": round(made.elapsed(), 1)}
                print(json.dumps({k: v for k, v in r.items() if k != "layers"}), flush=True)
                results.append(r)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"record": record("repair_quality", gpu=False), "source_nll": source_nll,
         "calibration": "64 x 256 training bytes, seed 1", "results": results}, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(results, source_nll))
    print(table(results, source_nll))
