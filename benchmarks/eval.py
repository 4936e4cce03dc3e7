"""`kconvert eval` of one full-size synthetic Kimi MoE layer pair against calibrate.

Builds synthetic.kimi_set's Kimi-K2-Thinking-shaped INT4 checkpoint (layer 0 dense, layer 1
MoE with 384 INT4 experts, MLA attention, a 16k vocabulary), converts it with `int4-to-nvfp4`,
then in one process times `calibrate` on the INT4 source and `evaluate` (INT4 source vs its
NVFP4 output) on the same --seqs x --seq random tokens. Prints one JSON line (also written
to --out-dir): seconds per layer of each, the MoE layer's eval/calibrate ratio (target <= 2),
peak GPU memory and peak host RSS of each phase.

Device (H200, ~4 min):
    python -m benchmarks eval --root /tmp/kbench --out-dir $OUT
CPU smoke test (tiny dims, seconds):
    python -m benchmarks eval --tiny
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from benchmarks.child_process import reset_vmhwm, vmhwm_bytes
from benchmarks.harness import Timer, arguments, now, parse, record, result_path, save
from benchmarks.synthetic import TINY, add_dims, kimi_set, random_ids


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
    ap = arguments("eval", __doc__, root="/tmp/kbench", results=True)
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims and data on the CPU (a check), in /tmp/kbench-eval-tiny")
    add_dims(ap, moe_layers=None)
    ap.add_argument("--seqs", type=int, default=256, help="sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default: %(default)s)")
    a = parse(ap, argv, tiny={"dims": TINY, "seqs": 4, "seq": 32, "batch": 2,
                              "root": Path("/tmp/kbench-eval-tiny")})
    from kconvert.calibrate.plan import forward_plan
    from kconvert.calibrate.run import measure_stats
    from kconvert.driver.convert import RunControl, convert
    from kconvert.driver.recipes import load_recipe
    from kconvert.evaluate.metrics import LOGIT_ELEMS
    from kconvert.evaluate.run import evaluate
    from kconvert.gpu.budget import GpuRequest
    from kconvert.io.checkpoint import open_checkpoint

    root, seqs, seq, batch, dims = a.root, a.seqs, a.seq, a.batch, a.dims
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
    save(res, result_path(rec, out_dir=a.out_dir))
