"""REAP pruning quality by direction (issue 25), through the command line's default path.

For each trained tiny MoE (tests/fixtures/tiny-moe-trained: 24 experts top-4;
tests/fixtures/tiny-moe-96: 96 experts top-8) and each keep (75/50/25% of the routed
experts), every configuration is made by `python -m kconvert reap SRC DST --data CALIB --keep N
...` (default dtype and device, as a user runs it) and all of a fixture's outputs are compared
with the source by ONE `python -m kconvert eval` on held-out text (fp32, CPU). Calibration: 64
windows of 256 training bytes (seed 1); held-out: `heldout_ids(64 * 256, seed=0)`.
`trained-nvfp4` is the trained tiny MoE made NVFP4 first by `kconvert quantize` (see QUANTIZED):
its outputs (compensation re-encodes the re-fitted matrices in NVFP4) are compared with the
BF16 model and with the NVFP4 source.

    python -m benchmarks reap_quality --out benchmarks/results/reap_quality_tiny_moe
        [--fixtures trained 96] [--keeps 75 50 25] [--configs none down ...] [--only-50 ...]
    python -m benchmarks reap_quality --fixtures trained-nvfp4 --keeps 75 50 25 \
        --configs none router+down --only-50 down \
        --out benchmarks/results/reap_quality_nvfp4_tiny_moe

Writes OUT + ".json" (every number, each configuration's CLI flags and the plan's per-layer
guard records, and the run's record) after each fixture, and OUT + ".md" (the table). CPU only;
about a minute of CPU per configuration on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

import torch

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import REPO, arguments, record
from benchmarks.synthetic import write_ids
from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, windows

FIXTURES = {"trained": REPO / "tests" / "fixtures" / "tiny-moe-trained",
            "96": REPO / "tests" / "fixtures" / "tiny-moe-96"}
# A quantized source made first by `kconvert quantize`: name -> (BF16 fixture, flags, what).
# Its outputs are evaluated against the BF16 fixture (what a user feels: quantization and
# pruning together; the unpruned quantized source is a row of its own) and against the
# quantized source itself (`kl_vs_source`: the pruning's damage alone).
QUANTIZED = {"trained-nvfp4": ("trained", ["--targets", "experts,shared_experts"],
                               "NVFP4 (compressed-tensors, routed and shared experts)")}
# name -> (what it is, `kconvert reap` flags)
CONFIGS = {
    "none": ("plain REAP (--repair none)", []),
    "frequency": ("frequency criterion", ["--criterion", "frequency"]),
    "ean": ("EAN criterion", ["--criterion", "ean"]),
    "man": ("MAN criterion", ["--criterion", "man"]),
    "msan": ("MSAN criterion", ["--criterion", "msan"]),
    "bias": ("--repair bias", ["--repair", "bias"]),
    "router": ("--repair router", ["--repair", "router"]),
    "shared": ("--compensate shared", ["--compensate", "shared"]),
    "down": ("--compensate down", ["--compensate", "down"]),
    "router+down": ("--repair router --compensate down",
                    ["--repair", "router", "--compensate", "down"]),
    "learned": ("--compensate learned", ["--compensate", "learned"]),
    "router+learned": ("--repair router --compensate learned",
                       ["--repair", "router", "--compensate", "learned"]),
    "msan+router+down": ("--criterion msan --repair router --compensate down",
                         ["--criterion", "msan", "--repair", "router", "--compensate", "down"]),
}
SEQ, CALIB, HELD = 256, 64, 64


def write_data(tmp: Path) -> tuple[Path, Path]:
    """The calibration text (CALIB training windows of SEQ bytes, seed 1) and the held-out
    text (`heldout_ids(HELD * SEQ, seed=0)`) as --data files in `tmp`."""
    calib = write_ids(tmp / "calib.jsonl", windows(corpus_ids("train"), CALIB, SEQ,
                                                   torch.Generator().manual_seed(1)))
    return calib, write_ids(tmp / "held.jsonl", heldout_ids(HELD * SEQ, seed=0).reshape(-1, SEQ))


def kconvert(*args: str) -> float:
    """`python -m kconvert ARGS` in its own process (its output passed through); its wall
    seconds. A failure stops the measurement with its output."""
    c = run_child([sys.executable, "-m", "kconvert", *args], env=child_env(), cwd=REPO,
                  echo=lambda line: print(line, end="", flush=True))
    if c.rc:
        raise SystemExit(f"kconvert {' '.join(args)} exited {c.rc}:\n{c.stderr[-3000:]}")
    return c.wall_s


def evaluate(reference: Path, candidates: list[Path], held: Path, out: Path) -> list[dict]:
    """The `logits` block of each candidate's `kconvert eval` against `reference`."""
    kconvert("eval", str(reference), *map(str, candidates), "--data", str(held),
             "--samples", str(HELD), "--seq-len", str(SEQ), "--dtype", "float32", "--device",
             "cpu", "--quiet", "-o", str(out))
    report = json.loads((out / "eval.json").read_text())
    return [c["logits"] for c in report["candidates"]]


def run_fixture(name: str, keeps: list[int], configs: list[str], only_50: list[str], tmp: Path
                ) -> list[dict]:
    if name in QUANTIZED:
        base, flags, what = QUANTIZED[name]
        reference, src = FIXTURES[base], tmp / name
        kconvert("quantize", str(reference), str(src), "--quiet", *flags)
    else:
        reference = src = FIXTURES[name]
    experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    calib, held = write_data(tmp)
    made = []
    for pct in keeps:
        keep = round(experts * pct / 100)
        for config in configs + (only_50 if pct == 50 else []):
            dst = tmp / f"{name}-k{keep}-{config}"
            secs = kconvert("reap", str(src), str(dst), "--data", str(calib), "--keep", str(keep),
                            "--samples", str(CALIB), "--seq-len", str(SEQ), "--quiet",
                            *CONFIGS[config][1])
            plan = json.loads((dst / "reap-plan.json").read_text())
            guards = {k: {r: v[r] for r in ("repair", "compensation") if r in v}
                      for k, v in plan["layers"].items()}
            made.append({"fixture": name, "keep": keep, "of": experts, "pct": pct,
                         "config": config, "what": CONFIGS[config][0],
                         "flags": CONFIGS[config][1], "reap_s": round(secs, 1),
                         "dir": dst, "guards": guards})
            print(f"{name} keep {keep}/{experts} {config}: {secs:.0f} s", flush=True)
    if src != reference:
        made.insert(0, {"fixture": name, "keep": experts, "of": experts, "pct": 100,
                        "config": "source", "what": f"{what}, unpruned", "flags": flags,
                        "reap_s": "-", "dir": src})
        vs_source = evaluate(src, [m["dir"] for m in made[1:]], held, tmp / f"eval-{name}-q")
        for m, logits in zip(made[1:], vs_source, strict=True):
            m["kl_vs_source"] = logits["kl_mean"]
    vs_reference = evaluate(reference, [m["dir"] for m in made], held, tmp / f"eval-{name}")
    for m, logits in zip(made, vs_reference, strict=True):
        m.update(kl=logits["kl_mean"], kl_p99=logits["kl_p99"], top1=logits["top1_agreement"],
                 nll_increase=logits["nll_candidate"] - logits["nll_source"])
        m["dir"] = str(m["dir"])
    return made


def table(results: list[dict]) -> str:
    lines = ["| fixture | keep | configuration | KL | KL vs none | top-1 | ΔNLL | reap s | "
             "KL vs quantized source |", "|---|---|---|---|---|---|---|---|---|"]
    none = {(r["fixture"], r["keep"]): r for r in results if r["config"] == "none"}
    for r in results:
        base = none.get((r["fixture"], r["keep"]))
        change = f"{(r['kl'] / base['kl'] - 1) * 100:+.1f}%" if base else "-"
        vs_source = "-"
        if "kl_vs_source" in r:
            vs_source = f"{r['kl_vs_source']:.4f}"
            if base:
                vs_source += f" ({(r['kl_vs_source'] / base['kl_vs_source'] - 1) * 100:+.1f}%)"
        lines.append(f"| {r['fixture']} | {r['keep']}/{r['of']} | {r['what']} | {r['kl']:.4f} | "
                     f"{change} | {r['top1']:.4f} | {r['nll_increase']:+.4f} | {r['reap_s']} | "
                     f"{vs_source} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    ap = arguments("reap_quality", __doc__)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         "reap_quality_tiny_moe"))
    ap.add_argument("--fixtures", nargs="+", default=list(FIXTURES),
                    choices=[*FIXTURES, *QUANTIZED])
    ap.add_argument("--keeps", nargs="+", type=int, default=[75, 50, 25])
    ap.add_argument("--configs", nargs="+", default=["none", "router", "down", "router+down"],
                    choices=list(CONFIGS), help="configurations made at every keep")
    ap.add_argument("--only-50", nargs="*", default=["man", "msan", "bias", "shared",
                                                     "msan+router+down"],
                    choices=list(CONFIGS), help="configurations made at keep 50%% only")
    a = ap.parse_args(argv)
    rec = record("reap_quality", gpu=False)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.fixtures:
            results += run_fixture(name, a.keeps, a.configs, a.only_50, Path(tmp))
            out.with_suffix(".json").write_text(json.dumps(
                {"record": rec, "calibration": f"{CALIB} x {SEQ} training bytes, seed 1",
                 "heldout": f"heldout_ids({HELD} * {SEQ}, seed=0)", "results": results},
                 indent=1, default=str) + "\n")
            out.with_suffix(".md").write_text(table(results))
    print(table(results))
