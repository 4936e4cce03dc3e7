"""`kconvert eval` of one full-size synthetic Kimi MoE layer pair against calibrate.

Builds synthetic.kimi_set's Kimi-K2-Thinking-shaped INT4 checkpoint (layer 0 dense, layer 1
MoE with 384 INT4 experts, MLA attention, a 16k vocabulary), converts it with `int4-to-nvfp4`,
then in one process times `calibrate` on the INT4 source and `evaluate` (INT4 source vs its
NVFP4 output) on the same SEQS x SEQ random tokens. Prints one JSON line (also written to
OUT): seconds per layer of each, the MoE layer's eval/calibrate ratio (target <= 2), peak GPU
memory and peak host RSS of each phase.

Device (H200, ~4 min):
    ROOT=/tmp/kbench OUT=$OUT python -m benchmarks eval
CPU smoke test (tiny dims, seconds):
    python -m benchmarks eval --tiny

Env as `calibrate`: ROOT, OUT, SEQS (256), SEQ (2048), BATCH (8), DIMS.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch

from benchmarks.harness import (
    Timer,
    arguments,
    now,
    record,
    reset_vmhwm,
    result_path,
    save,
    vmhwm_bytes,
)
from benchmarks.synthetic import TINY, dims_from_env, kimi_set, random_ids


def reset_peaks(dev: str) -> None:
    """Start a new peak for GPU memory and host RSS."""
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_vmhwm()


def peaks(dev: str) -> dict[str, float | None]:
    return {"peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if dev == "cuda" else None, "peak_rss_gib": round(vmhwm_bytes() / 2**30, 2)}


def main(argv: list[str]) -> None:
    ap = arguments("eval", __doc__)
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU (a check)")
    a = ap.parse_args(argv)
    from kconvert.calibrate.plan import forward_plan
    from kconvert.calibrate.run import measure_stats
    from kconvert.convert import RunControl, convert
    from kconvert.evaluate.metrics import LOGIT_ELEMS
    from kconvert.evaluate.run import evaluate
    from kconvert.gpu_budget import GpuRequest
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.recipes import load_recipe

    if a.tiny:
        os.environ.update(SEQS="4", SEQ="32", BATCH="2")
        os.environ.setdefault("ROOT", "/tmp/kbench-eval-tiny")
    root = Path(os.environ.get("ROOT", "/tmp/kbench"))
    seqs, seq, batch = (int(os.environ.get(k, d)) for k, d in
                        (("SEQS", 256), ("SEQ", 2048), ("BATCH", 8)))
    dims = TINY if a.tiny else dims_from_env()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec = record("eval", gpu=dev == "cuda", scratch=root)
    made = Timer()
    src, cand = kimi_set(root, dims), root / "eval-nvfp4"
    res: dict = {"record": rec, "make_s": round(made.elapsed(), 1)}
    made = Timer()
    convert(str(src), str(cand), load_recipe("int4-to-nvfp4"), {},
            RunControl(device=dev, overwrite=True, quiet=True))
    res.update(convert_s=round(made.elapsed(), 1), seqs=seqs, seq_len=seq,
               batch=batch, tokens=seqs * seq)
    ids = random_ids(seqs, seq, dims.vocab)

    source = open_checkpoint(str(src))
    marks = [now()]
    reset_peaks(dev)
    gpu = GpuRequest(torch.device(dev)).context  # what the commands plan for, once
    calibration = forward_plan(source, gpu, ids.shape, batch, torch.bfloat16, "calibration")
    measure_stats(source, ids, dev, batch, gpu_plan=calibration,
                  on_layer=lambda _layer, _h: marks.append(now(dev)))
    calib_layers = [round(b - a, 2) for a, b in itertools.pairwise(marks)]
    res["calibrate"] = {"seconds_per_layer": calib_layers, **peaks(dev)}

    candidate = open_checkpoint(str(cand))
    reset_peaks(dev)
    report = evaluate(source, [candidate], ids, dev, batch, gpu_plan=forward_plan(
        source, gpu, ids.shape, batch, torch.bfloat16, "eval", models=2,
        logit_elems=LOGIT_ELEMS["cuda"]))
    res["eval"] = {"seconds_per_layer": report.layer_seconds, "seconds": report.seconds,
                   **peaks(dev)}
    res["moe_layer_eval_over_calibrate"] = round(report.layer_seconds[-1] / calib_layers[-1], 2)
    res["eval_logits"] = report.candidates[0].logits.model_dump()
    res["eval_layers"] = {k: v.model_dump() for k, v in report.candidates[0].layers.items()}
    res["projected_61_layers_eval_min"] = round(
        (report.layer_seconds[0] + 60 * report.layer_seconds[-1]) / 60, 1)
    source.close()
    candidate.close()
    print(json.dumps({k: v for k, v in res.items() if k != "record"}))
    save(res, result_path(rec))
