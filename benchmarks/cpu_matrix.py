"""CPU milliseconds per full-size expert matrix, INT4 -> NVFP4, with every core of this machine.

    python -m benchmarks cpu_matrix [--shape 2048x7168] [--batch 4] [--reps 5]
        [--anchor-results FILE] [--out FILE]

Source: random Kimi-style INT4 (codes -7..7, bf16 group-32 scales), as Kimi-K2-Thinking ships.
Two paths, each for the `amax` and `mse` block-scale rules:
  decode+quantize  Int4Codec.decode to fp32, amax from it, nvfp4.quantize (what the engine does)
  quantize_int4    nvfp4.int4_amax + nvfp4.quantize_int4 (INT4 decoded inside the fused kernel)
The anchor's time per matrix is not assumed: with --anchor-results, a JSON file written by
`python -m benchmarks convert cpu` (or `full`) on the same machine (its
`per_matrix.anchor.slope_ms_per_matrix`), each path's time is also given as the anchor's
multiple. Prints one JSON line (and writes it with its record to --out, else to OUT); the first
(compiling) call of each path is not timed.
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from benchmarks import encode
from benchmarks.harness import Timer, arguments, record, result_path, save
from benchmarks.synthetic import pack_nibbles


def kimi_int4(batch: int, m: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """packed int32 [B, M, K/8] with codes -7..7 (low nibble first), bf16 scales [B, M, K/32]."""
    g = torch.Generator().manual_seed(seed)
    packed = pack_nibbles(torch.randint(1, 16, (batch, m, k), generator=g, dtype=torch.int32))
    scale = (torch.rand(batch, m, k // 32, generator=g) * 0.004 + 0.001).to(torch.bfloat16)
    return packed, scale


def main(argv: list[str]) -> None:
    ap = arguments("cpu_matrix", __doc__)
    ap.add_argument("--shape", default="2048x7168", help="MxK of one matrix")
    ap.add_argument("--batch", type=int, default=4, help="matrices per call")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--anchor-results", default=None,
                    help="`convert cpu` results of this machine (anchor ms)")
    ap.add_argument("--out", default=None, help="the results file (default: in OUT)")
    args = ap.parse_args(argv)
    m, k = (int(v) for v in args.shape.split("x"))
    packed, scale = kimi_int4(args.batch, m, k)
    paths = {"decode+quantize": encode.decoded, "quantize_int4": encode.fused}
    import numba

    out: dict = {"nproc": os.cpu_count(), "numba_threads": numba.get_num_threads(),
                 "torch_threads": torch.get_num_threads(), "shape": args.shape,
                 "batch": args.batch}
    for name, fn in paths.items():
        for mode in ("amax", "mse"):
            fn(packed, scale, mode)  # compile / warm up
            times, _ = Timer().each(args.reps, fn, packed, scale, mode)
            out[f"{name} {mode} ms/matrix"] = round(statistics.median(times) / args.batch * 1e3, 2)
    if args.anchor_results:
        with open(args.anchor_results) as f:
            anchor = json.load(f)["cpu"]["per_matrix"]["anchor"]["slope_ms_per_matrix"]
        out["anchor ms/matrix"] = anchor
        out["anchor_results"] = args.anchor_results
        for key in [k for k in out if k.endswith(" ms/matrix") and not k.startswith("anchor")]:
            out[key.replace(" ms/matrix", " speed-up vs anchor")] = round(anchor / out[key], 1)
    rec = record("cpu_matrix", gpu=False)
    save({"record": rec, **out}, result_path(rec, args.out))
    print(json.dumps(out))
