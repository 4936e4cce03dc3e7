"""Learned compensation's steps, step size and batch against the closed form, by model KL
on a tiny MoE (docs/reap.md, "Learned compensation").

At keep half the experts (12 of 24 on the trained tiny MoE; `--fixture 96`: 48 of 96) with
`--repair router`: the closed form (`--compensate down`) and learned compensation at each
SETTING (steps:lr[:batch[:bf16]]), each made by the library calls `kconvert reap --data
--compensate ...` makes (RouterRepair in the calibration pass, then the prune stage:
the settings are not command-line options; `repair_quality.prune`), loaded whole into transformers'
DeepseekV3ForCausalLM (fp32) and compared with the source on held-out text (KL per token,
top-1 agreement, NLL increase), as `repair_quality` does. Calibration: 64 x 256 training
bytes (seed 1), the repair stream's default 32,768 tokens.

    python -m benchmarks compensation_sweep --out benchmarks/results/compensation_sweep_tiny_moe
        [--settings 100:2e-3 200:2e-3 200:2e-3:16:bf16 ...]

Writes OUT + ".json" (every number, each layer's guard records, seconds) and OUT + ".md".
CPU; a few minutes per setting on 2 cores.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

import torch

from benchmarks.harness import REPO, Timer, arguments, record
from benchmarks.quality.reap_quality import FIXTURES
from benchmarks.quality.repair_quality import compare, log_probs, prune
from kconvert.pruning.compensate_learned import LearnedSettings
from kconvert.pruning.repair import RepairSettings
from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, windows

DEFAULT_SETTINGS = ("100:2e-3", "200:2e-3", "400:2e-3", "200:1e-3", "200:5e-3", "200:2e-3:4")


def parse(setting: str) -> LearnedSettings:
    """steps:lr[:batch[:bf16]] (bf16: the products in bf16 as on a GPU, fp32 masters)."""
    steps, lr, *rest = setting.split(":")
    extra = {"batch": int(rest[0])} if rest else {}
    if "bf16" in rest[1:]:
        extra["bf16"] = True
    return LearnedSettings(steps=int(steps), lr=float(lr), **extra)


def top1(source: torch.Tensor, pruned: torch.Tensor) -> float:
    return float((source.argmax(-1) == pruned.argmax(-1)).float().mean())


def table(results: list[dict]) -> str:
    lines = ["| compensation | steps | lr | batch | KL | KL / down | top-1 | NLL increase | "
             "layers learned | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    down = next(r["kl"] for r in results if r["compensate"] == "down")
    for r in results:
        learned = [v["learned"] for v in r["layers"].values() if v.get("learned")]
        s = r.get("settings") or {}
        kept = f"{sum(v['applied'] for v in learned)}/{len(learned)}" if learned else "-"
        lines.append(
            f"| {r['compensate']} | {s.get('steps', '-')} | {s.get('lr', '-')} | "
            f"{s.get('batch', '-')}{' bf16' if s.get('bf16') else ''} | {r['kl']:.4f} | "
            f"{r['kl'] / down:.3f} | {r['top1']:.4f} | "
            f"{r['nll_increase']:+.4f} | "
            f"{kept} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = arguments("compensation_sweep", __doc__)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         "compensation_sweep_tiny_moe"))
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    ap.add_argument("--fixture", default="trained", choices=list(FIXTURES),
                    help="the tiny MoE, pruned to half its experts (default: %(default)s)")
    ap.add_argument("--heldout-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    calib = windows(corpus_ids("train"), 64, 256, torch.Generator().manual_seed(1))
    held = heldout_ids(args.heldout_tokens, seed=0).reshape(-1, 256)
    src = FIXTURES[args.fixture]
    experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    keep = experts // 2
    source = log_probs(src, held)
    runs = [("down", None), *(("learned", s) for s in args.settings)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for compensate, setting in runs:
            learned = parse(setting) if setting else LearnedSettings()
            made = Timer()
            dst = Path(tmp) / f"{compensate}-{setting or ''}".replace(":", "_")
            plan = prune(keep, RepairSettings("router", keep, "reap", compensate=compensate,
                                              learned=learned), calib, dst, src)
            layers = {k: v.compensation.model_dump() for k, v in plan.layers.items()}
            pruned = log_probs(dst, held)
            r = {"compensate": compensate, "settings": learned.__dict__ if setting else None,
                 **compare(source, pruned, held), "top1": top1(source, pruned),
                 "layers": layers, "seconds": round(made.elapsed(), 1)}
            print(json.dumps({k: v for k, v in r.items() if k != "layers"}), flush=True)
            results.append(r)
            out.with_suffix(".json").write_text(json.dumps(
                {"record": record("compensation_sweep", gpu=False), "fixture": args.fixture,
                 "keep": f"{keep}/{experts}",
                 "repair": "router", "calibration": "64 x 256 training bytes, seed 1",
                 "heldout": f"heldout_ids({args.heldout_tokens}, seed=0)",
                 "results": results}, indent=1) + "\n")
            out.with_suffix(".md").write_text(table(results))
    print(table(results))
