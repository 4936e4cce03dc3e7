"""Benchmark: `kconvert eval` of one full-size synthetic Kimi MoE layer pair against calibrate.

Builds bench_calibrate's Kimi-K2-Thinking-shaped INT4 checkpoint (layer 0 dense, layer 1 MoE
with 384 INT4 experts, MLA attention, a 16k vocabulary), converts it with `int4-to-nvfp4`, then
in one process times `calibrate` on the INT4 source and `evaluate` (INT4 source vs its NVFP4
output) on the same SEQS x SEQ random tokens. Prints one JSON line (also written to
$OUT/bench_eval.json): seconds per layer of each, the MoE layer's eval/calibrate ratio (target
<= 2), peak GPU memory and peak host RSS of each phase.

Device (H200, ~4 min):
    ROOT=/tmp/kbench OUT=$OUT python scripts/bench_eval.py
CPU smoke test (tiny dims, seconds):
    python scripts/bench_eval.py --tiny

Env as bench_calibrate: ROOT, OUT, SEQS (256), SEQ (2048), BATCH (8), DIMS.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # before bench_calibrate reads its dims from the environment
    os.environ.update(DIMS="128,64,256,16,512,64,32,4", SEQS="4", SEQ="32", BATCH="2")
    os.environ.setdefault("ROOT", "/tmp/kbench-eval-tiny")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_calibrate import BATCH, OUT, ROOT, SEQ, SEQS, V, dev, make_checkpoint


def reset_peaks() -> None:
    """Start a new peak for GPU memory and host RSS (Linux: clear_refs 5 resets VmHWM)."""
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")


def peaks() -> dict[str, float | None]:
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text()
               .splitlines() if line.startswith("VmHWM:"))
    return {"peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if dev == "cuda" else None, "peak_rss_gib": round(hwm / 2**20, 2)}


def main() -> None:
    from kconvert.calibrate.plan import forward_plan
    from kconvert.calibrate.run import measure_stats
    from kconvert.convert import RunControl, convert
    from kconvert.evaluate.metrics import LOGIT_ELEMS
    from kconvert.evaluate.run import evaluate
    from kconvert.gpu_budget import GpuRequest
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.recipes import load_recipe

    OUT.mkdir(parents=True, exist_ok=True)
    src, cand = ROOT / "calib-src", ROOT / "eval-nvfp4"
    t0 = time.perf_counter()
    make_checkpoint(src)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 "make_s": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    convert(str(src), str(cand), load_recipe("int4-to-nvfp4"), {},
            RunControl(device=dev, overwrite=True, quiet=True))
    res.update(convert_s=round(time.perf_counter() - t0, 1), seqs=SEQS, seq_len=SEQ,
               batch=BATCH, tokens=SEQS * SEQ)
    ids = torch.randint(0, V, (SEQS, SEQ), generator=torch.Generator().manual_seed(0))

    source = open_checkpoint(str(src))
    marks = [time.perf_counter()]
    reset_peaks()
    gpu = GpuRequest(torch.device(dev)).context  # what the commands plan for, once
    calibration = forward_plan(source, gpu, ids.shape, BATCH, torch.bfloat16, "calibration")
    measure_stats(source, ids, dev, BATCH, gpu_plan=calibration,
                  on_layer=lambda _layer, _h: marks.append(
        (torch.cuda.synchronize() if dev == "cuda" else None) or time.perf_counter()))
    calib_layers = [round(b - a, 2) for a, b in itertools.pairwise(marks)]
    res["calibrate"] = {"seconds_per_layer": calib_layers, **peaks()}

    candidate = open_checkpoint(str(cand))
    reset_peaks()
    report = evaluate(source, [candidate], ids, dev, BATCH, gpu_plan=forward_plan(
        source, gpu, ids.shape, BATCH, torch.bfloat16, "eval", models=2,
        logit_elems=LOGIT_ELEMS["cuda"]))
    res["eval"] = {"seconds_per_layer": report.layer_seconds, "seconds": report.seconds,
                   **peaks()}
    res["moe_layer_eval_over_calibrate"] = round(report.layer_seconds[-1] / calib_layers[-1], 2)
    res["eval_logits"] = report.candidates[0].logits.model_dump()
    res["eval_layers"] = {k: v.model_dump() for k, v in report.candidates[0].layers.items()}
    res["projected_61_layers_eval_min"] = round(
        (report.layer_seconds[0] + 60 * report.layer_seconds[-1]) / 60, 1)
    source.close()
    candidate.close()
    line = json.dumps(res)
    print(line)
    (OUT / "bench_eval.json").write_text(line + "\n")


if __name__ == "__main__":
    main()
