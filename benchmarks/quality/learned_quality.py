"""Learned compression against the one-shot methods (issue 36), through the command line's
default path, on the trained tiny MoEs.

For each fixture (tests/fixtures/tiny-moe-trained: 24 experts top-4; tests/fixtures/tiny-moe-96:
96 experts top-8) every configuration is made by `python -m kconvert sparsify|quantize SRC DST
--method M --data CALIB ...` (default dtype and device, as a user runs it) and all of a
fixture's outputs are compared with the source by ONE `python -m kconvert eval` on held-out
text (fp32, CPU): p48 by sparsegpt and by learned, NVFP4 by gptq and by learned, each with
source and sequential inputs (`--hessian`), and p48 W4A4 (calibrated input scales) by both.
`--steps` adds learned rows at other step counts (the quality-versus-time curve). Calibration:
64 windows of 256 training bytes (seed 1); held-out: `heldout_ids(64 * 256, seed=0)`.

    python -m benchmarks learned_quality --out benchmarks/results/learned_tiny_moe
        [--fixtures trained 96] [--configs p48-sparsegpt p48-learned ...] [--steps 25 50 200]

Writes OUT + ".json" (every number, each configuration's flags, the per-layer errors of eval,
the guard's per-expert choices summarised, and the run's record) after each fixture, and OUT +
".md" (the table). CPU only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

from benchmarks.harness import REPO, arguments, record
from benchmarks.quality.reap_quality import CALIB, FIXTURES, HELD, SEQ, kconvert, write_data

# name -> (what it is, command, flags)
CONFIGS = {
    "p48-sparsegpt": ("p48 by sparsegpt", "sparsify", ["--method", "sparsegpt"]),
    "p48-learned": ("p48 learned (from sparsegpt)", "sparsify", ["--method", "learned"]),
    "p48-sparsegpt-seq": ("p48 by sparsegpt, sequential inputs", "sparsify",
                          ["--method", "sparsegpt", "--hessian", "sequential"]),
    "p48-learned-seq": ("p48 learned, sequential inputs", "sparsify",
                        ["--method", "learned", "--hessian", "sequential"]),
    "nvfp4-gptq": ("NVFP4 by gptq (mse)", "quantize", ["--method", "gptq"]),
    "nvfp4-learned": ("NVFP4 learned (from gptq)", "quantize", ["--method", "learned"]),
    "nvfp4-gptq-seq": ("NVFP4 by gptq, sequential inputs", "quantize",
                       ["--method", "gptq", "--hessian", "sequential"]),
    "nvfp4-learned-seq": ("NVFP4 learned, sequential inputs", "quantize",
                          ["--method", "learned", "--hessian", "sequential"]),
    "p48-sparsegpt-w4a4": ("p48 by sparsegpt, W4A4", "sparsify", ["--method", "sparsegpt"]),
    "p48-learned-w4a4": ("p48 learned, W4A4", "sparsify", ["--method", "learned"]),
}
# The one-shot row each learned row is compared with.
BASELINE = {"p48-learned": "p48-sparsegpt", "p48-learned-seq": "p48-sparsegpt-seq",
            "nvfp4-learned": "nvfp4-gptq", "nvfp4-learned-seq": "nvfp4-gptq-seq",
            "p48-learned-w4a4": "p48-sparsegpt-w4a4"}


def guard_summary(dst: Path) -> dict:
    """How many matrices the guard wrote learned, and the median held-out error ratio."""
    obs = json.loads((dst / "kconvert-manifest.json").read_text()).get("obs", {})
    learned = [r for r in obs.values() if "oneshot" in r]
    if not learned:
        return {}
    ratios = sorted(r["learned_error"] / r["oneshot_error"] for r in learned
                    if r["learned_error"] is not None and r["oneshot_error"])
    return {"matrices": len(learned),
            "written_learned": sum(r["method"] == "learned" for r in learned),
            "median_error_ratio": ratios[len(ratios) // 2] if ratios else None}


def run_fixture(name: str, configs: list[str], steps: list[int], tmp: Path) -> list[dict]:
    src = FIXTURES[name]
    calib, held = write_data(tmp)
    act = None
    if any(c.endswith("w4a4") for c in configs):
        act = tmp / f"stats-{name}"
        kconvert("calibrate", str(src), "--data", str(calib), "-o", str(act), "--samples",
                 str(CALIB), "--seq-len", str(SEQ), "--quiet")
    runs = [(c, *CONFIGS[c]) for c in configs]
    runs += [(f"p48-learned-steps{n}", f"p48 learned, {n} steps", "sparsify",
              ["--method", "learned", "--steps", str(n)]) for n in steps]
    made = []
    for config, what, command, flags in runs:
        dst = tmp / f"{name}-{config}"
        extra = ["--act-stats", str(act / "act_stats.json")] if config.endswith("w4a4") else []
        secs = kconvert(command, str(src), str(dst), "--data", str(calib), "--samples",
                        str(CALIB), "--seq-len", str(SEQ), "--quiet", *flags, *extra)
        made.append({"fixture": name, "config": config, "what": what,
                     "flags": [command, *flags, *(["--act-stats"] if extra else [])],
                     "seconds": round(secs, 1), "guard": guard_summary(dst), "dir": dst})
        print(f"{name} {config}: {secs:.0f} s", flush=True)
    out = tmp / f"eval-{name}"
    kconvert("eval", str(src), *(str(m["dir"]) for m in made), "--data", str(held),
             "--samples", str(HELD), "--seq-len", str(SEQ), "--dtype", "float32", "--device",
             "cpu", "--quiet", "-o", str(out))
    report = json.loads((out / "eval.json").read_text())
    for m, c in zip(made, report["candidates"], strict=True):
        lg = c["logits"]
        m.update(kl=lg["kl_mean"], kl_p99=lg["kl_p99"], top1=lg["top1_agreement"],
                 nll_increase=lg["nll_candidate"] - lg["nll_source"],
                 layers={k: v for k, v in c["layers"].items()}, dir=str(m["dir"]))
    return made


def table(results: list[dict]) -> str:
    lines = ["| fixture | configuration | KL | KL / one-shot | top-1 | ΔNLL | learned / matrices "
             "| median held-out error ratio | s |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["fixture"], r["config"]): r for r in results}
    for r in results:
        base = by.get((r["fixture"], BASELINE.get(r["config"], "p48-sparsegpt"
                                                   if "steps" in r["config"] else "")))
        ratio = f"{r['kl'] / base['kl']:.3f}" if base and base is not r else "-"
        g = r["guard"]
        written = f"{g['written_learned']}/{g['matrices']}" if g else "-"
        median = f"{g['median_error_ratio']:.3f}" if g and g["median_error_ratio"] else "-"
        lines.append(f"| {r['fixture']} | {r['what']} | {r['kl']:.5f} | {ratio} | "
                     f"{r['top1']:.4f} | {r['nll_increase']:+.4f} | {written} | {median} | "
                     f"{r['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = arguments("learned_quality", __doc__)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "learned_tiny_moe"))
    ap.add_argument("--fixtures", nargs="+", default=list(FIXTURES), choices=list(FIXTURES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", nargs="*", type=int, default=[],
                    help="learned p48 rows at these step counts too")
    a = ap.parse_args(argv)
    rec = record("learned_quality", gpu=False)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.fixtures:
            results += run_fixture(name, a.configs, a.steps, Path(tmp))
            out.with_suffix(".json").write_text(json.dumps(
                {"record": rec, "calibration": f"{CALIB} x {SEQ} training bytes, seed 1",
                 "heldout": f"heldout_ids({HELD} * {SEQ}, seed=0)", "results": results},
                indent=1, default=str) + "\n")
            out.with_suffix(".md").write_text(table(results))
    print(table(results))
