"""SparseGPT p48+NVFP4 loop time for full-size Kimi expert batches (GPU), extrapolated to a layer.

    python3 -m benchmarks sparsegpt_batch

The end-to-end `sparsify sparsegpt` run on one full 384-expert layer did not finish in
the device call's time; this times the loop itself: one engine-sized batch of --experts,
gate+up as one [B, 4096, 7168] matrix sharing H (7168^2), down as [B, 7168, 2048] (H 2048^2),
Hessians from random routed tokens. Seconds per layer = (384 / experts) * (gate_up + down).
"""

from __future__ import annotations

import json

import torch

from benchmarks.harness import Timer, arguments, record, result_path, save
from kconvert.formats import nvfp4
from kconvert.methods import obs, sparsegpt


def problem(batch: int, tokens: int, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random experts [rows, k] and their routed inputs [tokens, k] on the GPU."""
    w = torch.randn(batch, rows, k, device="cuda") * k ** -0.5
    return w, torch.randn(batch, tokens, k, device="cuda")


def prune_quantize(w: torch.Tensor, x: torch.Tensor) -> None:
    """Hessians, inverse and the p48 + NVFP4 loop of one batch."""
    batch, rows, _ = w.shape
    h = x.transpose(1, 2) @ x
    u = obs.prepare_inverse(h)
    gs = nvfp4.global_scale(w.abs().amax((1, 2))).repeat_interleave(rows).reshape(batch, rows)
    sparsegpt.prune_quantize(w, u, gs, 16, "mse")


def main(argv: list[str]) -> None:
    ap = arguments("sparsegpt_batch", __doc__, results=True)
    ap.add_argument("--experts", type=int, default=6,
                    help="experts in the batch (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=2800,
                    help="routed tokens per expert (default: %(default)s: ~32x2048 tokens x "
                         "top-8 / 384 experts)")
    a = ap.parse_args(argv)
    b, t = a.experts, a.tokens
    timer = Timer("cuda")  # the making of each batch is not timed
    timer("warm-up", prune_quantize, *problem(b, t, 512, 256))
    timer("gate_up", prune_quantize, *problem(b, t, 4096, 7168))
    timer("down", prune_quantize, *problem(b, t, 7168, 2048))
    gu, dn = timer.seconds["gate_up"], timer.seconds["down"]
    res = {"device": torch.cuda.get_device_name(), "batch_experts": b, "tokens": t,
           "gate_up_s": round(gu, 2), "down_s": round(dn, 2),
           "layer_s_extrapolated": round(384 / b * (gu + dn), 1)}
    print(json.dumps(res))
    rec = record("sparsegpt_batch")
    save({"record": rec, **res}, result_path(rec, out_dir=a.out_dir))
