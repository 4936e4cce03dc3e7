"""Does the REAP fit guard's objective track model KL? Per-layer ablation (issue 25, "a guard
per layer on held-out tokens by the objective shown to track model KL").

The guard (docs/reap.md "Router repair", "Compensation") writes a layer's fit (router rows,
re-fitted down_proj matrices) only when the block's mean squared output error on held-out
calibration tokens falls. This script asks, for each layer the guard judged, whether the
model felt the same: for each fixture (both trained tiny MoEs) at keep 50% and each fitting
configuration, it makes plain REAP and the configuration through the command line's default
path (reap_quality's settings), then builds one hybrid per MoE layer: the plain
output with that one layer's tensors taken from the configuration's output. ONE `kconvert eval`
per fixture compares every output with the source on held-out text. Per layer it records the
guard's held-out error before/after and the model's KL of the hybrid against plain REAP's;
the guard tracks KL where "the held-out block error fell" and "the model's KL fell" agree, and
the summary gives the agreement and the rank correlation of the two relative changes.

A layer whose fit the guard refused holds plain REAP's tensors in both outputs, so its hybrid
equals plain REAP: it is reported (the guard's figures) but cannot be ablated.

    python -m benchmarks guard_kl --out benchmarks/results/guard_kl_tiny_moe
        [--fixtures trained 96] [--configs bias router down router+down]

Writes the --out path with .json (every figure) and .md (the table). CPU, about 10 minutes
per fixture on 2 cores.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.harness import REPO, arguments, record
from benchmarks.quality.reap_quality import (
    CALIB,
    CONFIGS,
    FIXTURES,
    HELD,
    SEQ,
    evaluate,
    kconvert,
    write_data,
)

FITTED = ("repair", "compensation")


def reap(src: Path, dst: Path, calib: Path, keep: int, config: str) -> dict:
    """Run `kconvert reap` with the configuration's flags; its plan's per-layer records."""
    kconvert("reap", str(src), str(dst), "--data", str(calib), "--keep", str(keep),
             "--samples", str(CALIB), "--seq-len", str(SEQ), "--quiet", *CONFIGS[config][1])
    return json.loads((dst / "reap-plan.json").read_text())["layers"]


def hybrid(plain: Path, fitted: Path, layer: str, dst: Path) -> int:
    """`plain` with layer `layer`'s tensors from `fitted` (same names: same keep) -> dst; how
    many tensors differ."""
    shutil.copytree(plain, dst)
    prefix, changed = f"model.layers.{layer}.", 0
    fitted_tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(fitted.glob("*.safetensors")):
        fitted_tensors.update(load_file(shard))
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        swap = {n: fitted_tensors[n] for n in tensors if n.startswith(prefix)
                and not torch.equal(tensors[n], fitted_tensors[n])}
        if swap:
            changed += len(swap)
            save_file({**tensors, **swap}, shard, metadata={"format": "pt"})
    return changed


def guard_change(fit: dict) -> tuple[bool, float]:
    """(applied, relative change of the held-out block error) of one fit record."""
    before, after = fit["heldout_mse_before"], fit["heldout_mse_after"]
    return fit["applied"], (after - before) / before


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected among float changes)."""
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1]) if len(a) > 2 else float("nan")


def run_fixture(name: str, configs: list[str], tmp: Path) -> list[dict]:
    src = FIXTURES[name]
    experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    keep = experts // 2
    calib, held = write_data(tmp)
    plain_dir = tmp / f"{name}-none"
    plain_plan = reap(src, plain_dir, calib, keep, "none")
    rows, candidates = [], [plain_dir]
    for config in configs:
        out = tmp / f"{name}-{config}"
        plan = reap(src, out, calib, keep, config)
        candidates.append(out)
        for layer, entry in sorted(plan.items(), key=lambda kv: int(kv[0])):
            same_kept = entry["keep"] == plain_plan[layer]["keep"]
            for part in FITTED:
                if part not in entry:
                    continue
                applied, guard = guard_change(entry[part])
                row = {"fixture": name, "keep": keep, "of": experts, "config": config,
                       "layer": int(layer), "part": part, "applied": applied,
                       "same_kept": same_kept, "guard_heldout_change": guard,
                       "heldout_mse_before": entry[part]["heldout_mse_before"],
                       "heldout_mse_after": entry[part]["heldout_mse_after"]}
                rows.append(row)
        for layer in sorted(plan, key=int):
            # one hybrid per layer (router rows and matrices of a layer together)
            parts = [r for r in rows if r["config"] == config and r["layer"] == int(layer)]
            if any(r["applied"] for r in parts):
                h = tmp / f"{name}-{config}-L{layer}"
                changed = hybrid(plain_dir, out, layer, h)
                candidates.append(h)
                for r in parts:
                    r.update(hybrid=str(h), tensors_swapped=changed)
    logits = evaluate(src, candidates, held, tmp / f"eval-{name}")
    kl = {str(c): lg["kl_mean"] for c, lg in zip(candidates, logits, strict=True)}
    plain_kl = kl[str(plain_dir)]
    for r in rows:
        r["plain_kl"] = plain_kl
        r["config_kl"] = kl[str(tmp / f"{name}-{r['config']}")]
        if "hybrid" in r:
            r["hybrid_kl"] = kl[r.pop("hybrid")]
            r["model_kl_change"] = (r["hybrid_kl"] - plain_kl) / plain_kl
            r["agree"] = (r["guard_heldout_change"] < 0) == (r["model_kl_change"] < 0)
    return rows


def summary(rows: list[dict]) -> dict:
    ablated = [r for r in rows if "model_kl_change" in r]
    # one point per (fixture, config, layer): a layer's hybrid carries all its parts; take the
    # part the config is named for last (compensation after repair) as the guard's figure
    points = {(r["fixture"], r["config"], r["layer"]): r for r in ablated}
    guard = [p["guard_heldout_change"] for p in points.values()]
    model = [p["model_kl_change"] for p in points.values()]
    return {"layers_ablated": len(points),
            "layers_refused": sum(not r["applied"] for r in rows),
            "agree": sum(p["agree"] for p in points.values()),
            "applied_and_kl_rose": sum(p["applied"] and p["model_kl_change"] >= 0
                                       for p in points.values()),
            "spearman_guard_vs_kl": spearman(guard, model),
            "kept_sets_differ": sum(not r["same_kept"] for r in rows)}


def table(rows: list[dict], summ: dict) -> str:
    lines = ["| fixture | keep | config | layer | fit | guard | held-out block error | "
             "model KL, this layer's fit alone vs plain | agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        model = (f"{r['hybrid_kl']:.4f} vs {r['plain_kl']:.4f} ({100 * r['model_kl_change']:+.1f}%)"
                 if "hybrid_kl" in r else "-")
        lines.append(
            f"| {r['fixture']} | {r['keep']}/{r['of']} | {r['config']} | {r['layer']} | "
            f"{r['part']} | {'written' if r['applied'] else 'refused'} | "
            f"{r['heldout_mse_before']:.4g} -> {r['heldout_mse_after']:.4g} "
            f"({100 * r['guard_heldout_change']:+.1f}%) | {model} | "
            f"{r.get('agree', '-')} |")
    lines.append("")
    lines.append("Summary: " + json.dumps(summ))
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = arguments("guard_kl", __doc__)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "guard_kl_tiny_moe"))
    ap.add_argument("--fixtures", nargs="+", default=list(FIXTURES), choices=list(FIXTURES))
    ap.add_argument("--configs", nargs="+", default=["bias", "router", "down", "router+down"],
                    choices=[c for c in CONFIGS if c not in ("none",)])
    a = ap.parse_args(argv)
    rec = record("guard_kl", gpu=False)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.fixtures:
            fixture_tmp = Path(tmp) / name
            fixture_tmp.mkdir()
            rows += run_fixture(name, a.configs, fixture_tmp)
            summ = summary(rows)
            out.with_suffix(".json").write_text(json.dumps(
                {"record": rec, "calibration": f"{CALIB} x {SEQ} training bytes, seed 1",
                 "heldout": f"heldout_ids({HELD} * {SEQ}, seed=0)", "summary": summ,
                 "rows": rows}, indent=1) + "\n")
            out.with_suffix(".md").write_text(table(rows, summ))
    print(table(rows, summary(rows)))
