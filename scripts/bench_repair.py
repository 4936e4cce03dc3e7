"""Benchmark: REAP router repair and compensation of one full-size synthetic Kimi MoE layer,
beyond calibration.

Builds scripts/bench_calibrate.py's checkpoint (layer 0 dense, layer 1 MoE with 384 INT4
experts, real Kimi-K2 shapes), runs `kconvert.calibrate.calibrate` on SEQS x SEQ tokens once
alone and once with `RouterRepair` (keep KEEP, router repair METHOD, compensation COMPENSATE)
in the same pass, and reports the
repair hook's seconds per layer (the MoE layer's is the number to read) and where the MoE
layer's seconds went (`phases`, RouterRepair.seconds: the unpruned target; router repair's
candidates, Adam fit and guard; compensation's setup (features, source outputs, Gram
matrices), Cholesky factors, Gauss-Seidel solves, held-out ridge choice, encode of the chosen
ridge's matrices, guard and write-back; the output; `other` is the hook's rest: the layer's
attention on the repair stream), the calibration seconds per layer of both runs, and peak GPU
memory and host RSS of each run. One JSON line on stdout and in $OUT/bench_repair.json.

    ROOT=/tmp/kbench OUT=$OUT python3 scripts/bench_repair.py         # H100: ~2 minutes
    python scripts/bench_repair.py --tiny                              # CPU smoke, tiny dims

Env: ROOT, OUT, SEQS (256), SEQ (2048), BATCH (8) as bench_calibrate; KEEP (192), METHOD
(router), COMPENSATE (down), MAX_TOKENS (32768: the repair stream's tokens).

The synthetic experts are INT4 (the shared expert BF16), as Kimi-K2-Thinking ships: the
re-fitted down_proj matrices are re-encoded in INT4 (kconvert.pruning.recode), and the
seconds include that encode for every ridge tried.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:  # bench_calibrate reads its dims at import
    os.environ.update({"DIMS": "128,64,256,24,512,64,32,4", "SEQS": "8", "SEQ": "64",
                       "KEEP": "12", "ROOT": os.environ.get("ROOT", "/tmp/kbench-tiny"),
                       "OUT": os.environ.get("OUT", "/tmp/kbench-tiny-out")})
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_calibrate as bc  # noqa: E402
import torch  # noqa: E402

KEEP, METHOD = int(os.environ.get("KEEP", 192)), os.environ.get("METHOD", "router")
COMPENSATE = os.environ.get("COMPENSATE", "down")
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", 32768))


def _sync() -> float:
    if bc.dev == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _calibrate(ckpt, ids: torch.Tensor, hook) -> dict:
    from kconvert.calibrate.plan import forward_plan
    from kconvert.calibrate.run import measure_stats
    from kconvert.gpu_budget import GpuRequest
    from kconvert.pruning.repair import stream_bytes

    if bc.dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    marks = [_sync()]
    plan = forward_plan(ckpt, GpuRequest(torch.device(bc.dev)).context, ids.shape, bc.BATCH,
                        torch.bfloat16, "calibration", repair_bytes=stream_bytes(
                            ckpt.text_config["hidden_size"], 2, ids.numel()))
    measure_stats(ckpt, ids, bc.dev, bc.BATCH, on_weights=hook, gpu_plan=plan,
              on_layer=lambda _layer, _h: marks.append(_sync()))
    return {"seconds_per_layer": [round(b - a, 2) for a, b in itertools.pairwise(marks)],
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if bc.dev == "cuda" else None,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.pruning.repair import RepairSettings, RouterRepair

    bc.OUT.mkdir(parents=True, exist_ok=True)
    src = bc.ROOT / "calib-src"
    t0 = time.perf_counter()
    bc.make_checkpoint(src)
    res: dict = {"device": torch.cuda.get_device_name() if bc.dev == "cuda" else "cpu",
                 "make_s": round(time.perf_counter() - t0, 1), "seqs": bc.SEQS,
                 "seq_len": bc.SEQ, "experts": bc.E, "keep": KEEP, "method": METHOD,
                 "compensate": COMPENSATE, "max_tokens": MAX_TOKENS}
    ids = torch.randint(0, bc.V, (bc.SEQS, bc.SEQ), generator=torch.Generator().manual_seed(0))
    ckpt = open_checkpoint(str(src))
    try:
        res["calibrate"] = _calibrate(ckpt, ids, None)
        repair = RouterRepair(ckpt, ids, RepairSettings(METHOD, KEEP, "reap",
                                                        max_tokens=MAX_TOKENS,
                                                        compensate=COMPENSATE),
                              torch.device(bc.dev), batch_size=bc.BATCH)
        hook_s: list[float] = []

        def timed(layer: int, module: torch.nn.Module) -> None:
            start = _sync()
            repair(layer, module)
            hook_s.append(round(_sync() - start, 2))

        res["with_repair"] = _calibrate(ckpt, ids, timed)
    finally:
        ckpt.close()
    phases = {k: round(v, 2) for k, v in repair.seconds[1].items()}
    phases["other"] = round(hook_s[-1] - sum(repair.seconds[1].values()), 2)
    res.update({"repair_s_per_layer": hook_s, "repair_moe_layer_s": hook_s[-1],
                "phases": phases})
    for name, recs in (("router", repair.records), ("compensation", repair.compensations)):
        if 1 in recs:
            rec = recs[1]
            res[name] = {"tokens": rec.fit_tokens + rec.heldout_tokens,
                         "fit_mse": [rec.fit_mse_before, rec.fit_mse_after],
                         "heldout_mse": [rec.heldout_mse_before, rec.heldout_mse_after],
                         "applied": rec.applied}
            if name == "compensation":
                res[name]["ridge"] = rec.ridge
    line = json.dumps(res)
    print(line)
    print(f"MoE layer repair {hook_s[-1]} s: " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    (bc.OUT / "bench_repair.json").write_text(line + "\n")


if __name__ == "__main__":
    main()
