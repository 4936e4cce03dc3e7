"""SparseGPT p48+NVFP4 loop time for full-size Kimi expert batches (GPU), extrapolated to a layer.

The end-to-end `bench_sparsify.py sparsegpt` run on one full 384-expert layer did not finish in
the device call's time; this times the loop itself: one engine-sized batch of B experts,
gate+up as one [B, 4096, 7168] matrix sharing H (7168^2), down as [B, 7168, 2048] (H 2048^2),
Hessians from random routed tokens. Seconds per layer = (384 / B) * (gate_up + down).
Env: B (6), TOKENS (2800: ~32x2048 tokens x top-8 / 384 experts).
"""

from __future__ import annotations

import json
import os
import time

import torch

from kconvert.formats import nvfp4
from kconvert.methods import obs, sparsegpt

B, T = int(os.environ.get("B", 6)), int(os.environ.get("TOKENS", 2800))
dev = "cuda"


def timed(rows: int, k: int) -> float:
    w = torch.randn(B, rows, k, device=dev) * k ** -0.5
    x = torch.randn(B, T, k, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h = x.transpose(1, 2) @ x
    u = obs.prepare_inverse(h)
    gs = nvfp4.global_scale(w.abs().amax((1, 2))).repeat_interleave(rows).reshape(B, rows)
    sparsegpt.prune_quantize(w, u, gs, 16, "mse")
    torch.cuda.synchronize()
    return time.perf_counter() - t0


timed(512, 256)  # warm-up
gu, dn = timed(4096, 7168), timed(7168, 2048)
print(json.dumps({"device": torch.cuda.get_device_name(), "batch_experts": B, "tokens": T,
                  "gate_up_s": round(gu, 2), "down_s": round(dn, 2),
                  "layer_s_extrapolated": round(384 / B * (gu + dn), 1)}))
