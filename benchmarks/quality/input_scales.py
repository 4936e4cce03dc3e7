"""NVFP4 W4A4's three input-scale policies measured on the trained tiny MoE (issue 37): `kconvert
eval` KL / top-1 of `quantize --act-stats A --input-scale expert`, `--input-scale layer-max`
and `--input-scale one` (no statistics), beside the W4A16 twin (same weights), each run as
served (eval quantizes the activations with the stored scales under the declared policy,
kconvert/evaluate/activations.py).

The routed experts are the targets (the CLI's default), mse block scales; calibration
(`calibrate`'s act_stats.json) on 64 training windows of 256 bytes, eval on held-out windows,
every candidate in one eval pass, fp32 on the CPU, as benchmarks/quality/eval_pipelines.py
measures its W4A4 row.

    python -m benchmarks input_scales [--samples 64] [--seq-len 256] [--calib 64]
        [--out benchmarks/results/input_scales_tiny_moe]   # -> .json and .md
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spin-waiting threads on a shared CPU

import torch
from safetensors import safe_open

from benchmarks.harness import REPO, Timer, arguments, record
from kconvert.calibrate.run import measure_stats
from kconvert.calibrate.stats import ACT_FILE, save_stats
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.evaluate.run import evaluate
from kconvert.io.checkpoint import open_checkpoint
from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, windows

SRC = REPO / "tests" / "fixtures" / "tiny-moe-trained"
# name -> (what, quantize settings; ACT: the calibration's act_stats.json)
ACT = "act_stats"
CANDIDATES = {
    "w4a16": ("NVFP4 W4A16 experts (the weights of every row below)", {}),
    "w4a4-expert": ("W4A4, each expert's own calibrated input scale",
                    {"act_stats": ACT, "input_scale": "expert"}),
    "w4a4-layer-max": ("W4A4, each layer's largest over its experts (gate/up, down apart)",
                       {"act_stats": ACT, "input_scale": "layer-max"}),
    "w4a4-one": ("W4A4, every input scale 1.0 (no calibration)", {"input_scale": "one"}),
}


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
    ap.add_argument("--samples", type=int, default=64, help="held-out sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib", type=int, default=64, help="calibration windows of 256")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         "input_scales_tiny_moe"))
    a = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    timer = Timer()
    calib = windows(corpus_ids("train"), a.calib, 256, torch.Generator().manual_seed(1))
    held = heldout_ids(a.samples * a.seq_len, seed=0, window=a.seq_len).reshape(-1, a.seq_len)
    with tempfile.TemporaryDirectory(prefix="input-scales-") as tmp:
        root = Path(tmp)
        ckpt = open_checkpoint(str(SRC))
        try:
            save_stats(measure_stats(ckpt, calib, "cpu", 16, dtype=torch.float32),
                       root / "stats")
        finally:
            ckpt.close()
        act = str(root / "stats" / ACT_FILE)
        distinct = {}
        for name, (_, settings) in CANDIDATES.items():
            options = {k: act if v == ACT else v for k, v in settings.items()}
            convert(str(SRC), str(root / name), load_recipe("quantize"), options,
                    RunControl(quiet=True))
            distinct[name] = distinct_scales(root / name)
        opened = [open_checkpoint(str(p)) for p in (SRC, *(root / n for n in CANDIDATES))]
        try:
            report = timer("eval", evaluate, opened[0], opened[1:], held, "cpu", a.batch_size,
                           dtype=torch.float32, labels=list(CANDIDATES), quiet=False)
        finally:
            for c in opened:
                c.close()
    data = report.model_dump(mode="json")
    rows = ["| candidate | what | distinct input scales | KL mean | KL p99 | top-1 | top-5 | "
            "ΔNLL |", "|---|---|---|---|---|---|---|---|"]
    for c in data["candidates"]:
        m = c["logits"]
        rows.append(f"| {c['candidate']} | {CANDIDATES[c['candidate']][0]} | "
                    f"{distinct[c['candidate']] or '-'} | {m['kl_mean']:.5f} | "
                    f"{m['kl_p99']:.4f} | {m['top1_agreement']:.4f} | "
                    f"{m['top5_overlap']:.4f} | {m['nll_candidate'] - m['nll_source']:+.4f} |")
    kl = {c["candidate"]: c["logits"]["kl_mean"] for c in data["candidates"]}
    best = min((n for n in kl if n != "w4a16"), key=kl.get)
    md = ["# NVFP4 W4A4 input-scale policies on the trained tiny MoE", "",
          f"Source: tests/fixtures/tiny-moe-trained (BF16); routed experts NVFP4 (mse block "
          f"scales); eval in fp32 on the CPU on {a.samples} held-out sequences of {a.seq_len} "
          f"bytes ({data['tokens']} positions); calibration on {a.calib} training windows of "
          f"256. Made by `python -m benchmarks input_scales --samples {a.samples} --seq-len "
          f"{a.seq_len} --calib {a.calib}`: {timer.elapsed():.0f} s.", "", *rows, "",
          f"Lowest KL of the three policies: **{best}** ({kl[best]:.5f}; W4A16 "
          f"{kl['w4a16']:.5f}).", ""]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(md))
    out.with_suffix(".json").write_text(json.dumps(
        {"record": record("input_scales", gpu=False), "settings": vars(a) | {"out": None},
         "distinct_input_scales": distinct, "eval": data}, indent=1) + "\n")
    print("\n".join(md))
