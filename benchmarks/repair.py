"""REAP router repair and compensation of one full-size synthetic Kimi MoE layer, beyond
calibration.

Builds synthetic.kimi_set's checkpoint (layer 0 dense, layer 1 MoE with 384 INT4 experts, real
Kimi-K2 shapes), runs `kconvert.calibrate.calibrate` on --seqs x --seq tokens once alone and
once with `RouterRepair` (keep --keep, router repair --repair, compensation --compensate) in
the same pass, and reports the
repair hook's seconds per layer (the MoE layer's is the number to read) and where the MoE
layer's seconds went (`phases`, RouterRepair.seconds: the unpruned target; router repair's
candidates, Adam fit and guard; compensation's setup (features, source outputs, Gram
matrices), Cholesky factors, Gauss-Seidel solves, held-out ridge choice, encode of the chosen
ridge's matrices, guard and write-back; the output; `other` is the hook's rest: the layer's
attention on the repair stream), the calibration seconds per layer of both runs, and peak GPU
memory and host RSS of each run. One JSON line on stdout and in --out-dir.

    python3 -m benchmarks repair --root /tmp/kbench --out-dir $OUT   # H100: ~2 minutes
    python -m benchmarks repair --tiny                              # CPU smoke, tiny dims

The synthetic experts are INT4 (the shared expert BF16), as Kimi-K2-Thinking ships: the
re-fitted down_proj matrices are re-encoded in INT4 (kconvert.pruning.recode), and the
seconds include that encode for every ridge tried.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import resource
from pathlib import Path

import torch

from benchmarks.harness import Timer, arguments, now, parse, record, result_path, save
from benchmarks.synthetic import TINY, add_dims, kimi_set, random_ids


def calibrate(ckpt, ids: torch.Tensor, dev: str, batch: int, hook) -> dict:
    from kconvert.calibrate.plan import forward_plan
    from kconvert.calibrate.run import measure_stats
    from kconvert.gpu.budget import GpuRequest
    from kconvert.pruning.repair import stream_bytes

    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    marks = [now(dev)]
    plan = forward_plan(ckpt, GpuRequest(torch.device(dev)).context, ids.shape, batch,
                        torch.bfloat16, "calibration", repair_bytes=stream_bytes(
                            ckpt.text_config["hidden_size"], 2, ids.numel()))
    measure_stats(ckpt, ids, dev, batch, on_weights=hook, gpu_plan=plan,
                  on_layer=lambda _layer, _h: marks.append(now(dev)))
    return {"seconds_per_layer": [round(b - a, 2) for a, b in itertools.pairwise(marks)],
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if dev == "cuda" else None,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv: list[str]) -> None:
    ap = arguments("repair", __doc__, root="/tmp/kbench", results=True)
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims (24 experts) on the CPU (a check), in /tmp/kbench-tiny")
    add_dims(ap, moe_layers=None)
    ap.add_argument("--seqs", type=int, default=256, help="sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default: %(default)s)")
    ap.add_argument("--keep", type=int, default=192,
                    help="experts kept per layer (default: %(default)s)")
    ap.add_argument("--repair", default="router",
                    help="the router repair kind (default: %(default)s)")
    ap.add_argument("--compensate", default="down",
                    help="the compensation kind (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32768,
                    help="the repair stream's tokens (default: %(default)s)")
    a = parse(ap, argv, tiny={"seqs": 8, "seq": 64, "keep": 12,
                              "dims": dataclasses.replace(TINY, experts=24),
                              "root": Path("/tmp/kbench-tiny")})
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.pruning.repair import RepairSettings, RouterRepair

    root, seqs, seq, batch, dims = a.root, a.seqs, a.seq, a.batch, a.dims
    keep, method, compensate, max_tokens = a.keep, a.repair, a.compensate, a.max_tokens
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec = record("repair", gpu=dev == "cuda", scratch=root)
    made = Timer()
    src = kimi_set(root, dims)
    res: dict = {"record": rec, "device": rec["device"]["name"],
                 "make_s": round(made.elapsed(), 1), "seqs": seqs, "seq_len": seq,
                 "experts": dims.experts, "keep": keep, "method": method,
                 "compensate": compensate, "max_tokens": max_tokens}
    ids = random_ids(seqs, seq, dims.vocab)
    ckpt = open_checkpoint(str(src))
    try:
        res["calibrate"] = calibrate(ckpt, ids, dev, batch, None)
        repair = RouterRepair(ckpt, ids, RepairSettings(method, keep, "reap",
                                                        max_tokens=max_tokens,
                                                        compensate=compensate),
                              torch.device(dev), batch_size=batch)
        hook_s: list[float] = []

        def timed(layer: int, module: torch.nn.Module) -> None:
            start = now(dev)
            repair(layer, module)
            hook_s.append(round(now(dev) - start, 2))

        res["with_repair"] = calibrate(ckpt, ids, dev, batch, timed)
    finally:
        ckpt.close()
    phases = {k: round(v, 2) for k, v in repair.seconds[1].items()}
    phases["other"] = round(hook_s[-1] - sum(repair.seconds[1].values()), 2)
    res.update({"repair_s_per_layer": hook_s, "repair_moe_layer_s": hook_s[-1],
                "phases": phases})
    for name, recs in (("router", repair.records), ("compensation", repair.compensations)):
        if 1 in recs:
            r = recs[1]
            res[name] = {"tokens": r.fit_tokens + r.heldout_tokens,
                         "fit_mse": [r.fit_mse_before, r.fit_mse_after],
                         "heldout_mse": [r.heldout_mse_before, r.heldout_mse_after],
                         "applied": r.applied}
            if name == "compensation":
                res[name]["ridge"] = r.ridge
    print(json.dumps({k: v for k, v in res.items() if k != "record"}))
    print(f"MoE layer repair {hook_s[-1]} s: " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    save(res, result_path(rec, out_dir=a.out_dir))
