"""NVFP4 W4A4's input-scale policies measured through the command line (issues 37 and 48):
`kconvert calibrate` on training text, `kconvert quantize --act-stats ACT --input-scale P` for
every policy that reads statistics (expert, layer-max, headroom) and `--input-scale one`
without them, the W4A16 twin (same weights), then one `kconvert eval` of them all on held-out
text, each run as served (eval quantizes the activations with the stored scales under the
declared policy, kconvert/evaluate/activations.py): KL / top-1 and, per W4A4 candidate, the
share of its activation blocks that clamp (amax above 448 x 6 / g).

Sources: the trained tiny MoE (`--model tiny-moe`: byte ids, windows of the stdlib split's
training and held-out files) or the Kimi-routed proxy (`--model kimi-proxy`: the same files as
text, tokenized by its own tokenizer). Routed experts are the targets (the CLI's default), mse
block scales, fp32 on the CPU.

    python -m benchmarks input_scales [--model tiny-moe|kimi-proxy] [--samples 64]
        [--seq-len 256] [--calib 64] [--out benchmarks/results/input_scales_tiny_moe]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

import torch
from safetensors import safe_open

from benchmarks.harness import REPO, Timer, arguments, record

FIXTURES = REPO / "tests" / "fixtures"
ACT = "act_stats"
# name -> (what, quantize options; ACT: the calibration's act_stats.json)
CANDIDATES = {
    "w4a16": ("NVFP4 W4A16 experts (the weights of every row below)", []),
    "w4a4-expert": ("W4A4, each expert's own calibrated input amax",
                    ["--act-stats", ACT, "--input-scale", "expert"]),
    "w4a4-layer-max": ("W4A4, each layer's largest over its experts (gate/up, down apart)",
                       ["--act-stats", ACT, "--input-scale", "layer-max"]),
    "w4a4-headroom": ("W4A4, each expert's max(16384 x p1, p99.99) of its block amax "
                      "(ModelOpt's nvfp4_act_headroom)",
                      ["--act-stats", ACT, "--input-scale", "headroom"]),
    "w4a4-one": ("W4A4, every input scale 1.0 (no calibration)", ["--input-scale", "one"]),
}


def tiny_moe_data(root: Path, calib: int, samples: int, seq_len: int) -> tuple[Path, Path]:
    """Calibration and held-out JSONL of byte ids, windows of the tiny MoE's splits."""
    from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, windows

    train = windows(corpus_ids("train"), calib, 256, torch.Generator().manual_seed(1))
    held = heldout_ids(samples * seq_len, seed=0, window=seq_len).reshape(-1, seq_len)
    return (_jsonl(root / "calib.jsonl", [{"input_ids": r.tolist()} for r in train]),
            _jsonl(root / "heldout.jsonl", [{"input_ids": r.tolist()} for r in held]))


def proxy_data(root: Path, calib: int, samples: int, seq_len: int) -> tuple[Path, Path]:
    """Calibration and held-out JSONL of the proxy's split files as text (the command
    tokenizes, packs and takes the sequences it needs)."""
    from kconvert.testing.proxy import split_sources, stdlib_sources

    splits = split_sources(stdlib_sources())
    return tuple(_jsonl(root / f"{name}.jsonl", [{"text": t} for _, t in splits[name]])
                 for name in ("train", "heldout"))  # type: ignore[return-value]


MODELS = {"tiny-moe": ("tiny-moe-trained", tiny_moe_data),
          "kimi-proxy": ("kimi-proxy", proxy_data)}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kconvert(*args: str) -> str:
    """`python -m kconvert.cli ARGS` in a child process; its stdout, or the run's failure."""
    done = subprocess.run([sys.executable, "-m", "kconvert.cli", *args], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode:
        raise SystemExit(f"kconvert {' '.join(args)} failed ({done.returncode}):\n"
                         f"{done.stdout}\n{done.stderr}")
    return done.stdout


def clamp_cell(blocks: dict | None) -> str:
    """'0.0078% (183 of 2359296)', or '-' for a candidate without NVFP4 activations."""
    if blocks is None:
        return "-"
    return f"{blocks['clamped_share']:.4%} ({blocks['clamped']} of {blocks['blocks']})"


def distinct_scales(path: Path) -> int:
    """How many different input scale values the checkpoint's routed experts store."""
    values = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            values |= {float(fh.get_tensor(n)) for n in fh.keys()
                       if n.endswith(".input_global_scale")}
    return len(values)


def main(argv: list[str]) -> None:
    ap = arguments("input_scales", __doc__)
    ap.add_argument("--model", choices=list(MODELS), default="tiny-moe")
    ap.add_argument("--samples", type=int, default=64, help="held-out sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib", type=int, default=64, help="calibration sequences of 256")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="[default: benchmarks/results/"
                                                "input_scales_<model>]")
    a = ap.parse_args(argv)
    fixture, make_data = MODELS[a.model]
    src = str(FIXTURES / fixture)
    out = Path(a.out or REPO / "benchmarks" / "results" /
               f"input_scales_{a.model.replace('-', '_')}")
    timer = Timer()
    common = ["--device", "cpu", "--quiet"]
    with tempfile.TemporaryDirectory(prefix="input-scales-") as tmp:
        root = Path(tmp)
        calib, held = make_data(root, a.calib, a.samples, a.seq_len)
        timer("calibrate", kconvert, "calibrate", src, "--data", str(calib), "--samples",
              str(a.calib), "--seq-len", "256", "--batch-size", str(a.batch_size),
              "--dtype", "float32", "-o", str(root / "stats"), *common)
        act = str(root / "stats" / "act_stats.json")
        distinct = {}
        for name, (_, options) in CANDIDATES.items():
            timer(f"quantize {name}", kconvert, "quantize", src, str(root / name),
                  *[act if o == ACT else o for o in options], *common)
            distinct[name] = distinct_scales(root / name)
        timer("eval", kconvert, "eval", src, *(str(root / n) for n in CANDIDATES), "--data",
              str(held), "--samples", str(a.samples), "--seq-len", str(a.seq_len),
              "--batch-size", str(a.batch_size), "--dtype", "float32", "-o",
              str(root / "eval"), *common)
        data = json.loads((root / "eval" / "eval.json").read_text())
    labels = {str(root / n): n for n in CANDIDATES}
    rows = ["| candidate | what | distinct input scales | KL mean | KL p99 | top-1 | ΔNLL | "
            "clamped blocks |", "|---|---|---|---|---|---|---|---|"]
    kl, clamped = {}, {}
    for c in data["candidates"]:
        name, m, blocks = labels[c["candidate"]], c["logits"], c["activation_blocks"]
        kl[name] = m["kl_mean"]
        clamped[name] = None if blocks is None else blocks["clamped_share"]
        rows.append(f"| {name} | {CANDIDATES[name][0]} | {distinct[name] or '-'} | "
                    f"{m['kl_mean']:.5f} | {m['kl_p99']:.4f} | {m['top1_agreement']:.4f} | "
                    f"{m['nll_candidate'] - m['nll_source']:+.4f} | {clamp_cell(blocks)} |")
    best = min((n for n in kl if n != "w4a16"), key=kl.get)
    md = [f"# NVFP4 W4A4 input-scale policies on {fixture}", "",
          f"Source: tests/fixtures/{fixture}; routed experts NVFP4 (mse block scales), through "
          f"the CLI (calibrate -> quantize --act-stats --input-scale P -> eval); eval in fp32 "
          f"on the CPU on {a.samples} held-out sequences of {a.seq_len} ({data['tokens']} "
          f"positions); calibration on {a.calib} training sequences of 256. Clamped blocks: "
          "the candidate's NVFP4 activation blocks whose amax is above 448 x 6 / g, on its "
          f"own stream. Made by `python -m benchmarks input_scales --model {a.model} "
          f"--samples {a.samples} --seq-len {a.seq_len} --calib {a.calib}`: "
          f"{timer.elapsed():.0f} s.", "", *rows, "",
          f"Lowest KL of the W4A4 policies: **{best}** ({kl[best]:.5f}; W4A16 "
          f"{kl['w4a16']:.5f}).", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(md))
    out.with_suffix(".json").write_text(json.dumps(
        {"record": record("input_scales", gpu=False), "settings": vars(a) | {"out": None},
         "distinct_input_scales": distinct, "kl_mean": kl, "clamped_share": clamped,
         "seconds": timer.seconds, "eval": data}, indent=1) + "\n")
    print("\n".join(md))
