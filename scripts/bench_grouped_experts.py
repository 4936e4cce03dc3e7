"""Benchmark: one batch of routed experts three ways, on the tiny MoE's shapes or Kimi's.

  loop     a Python loop over the non-empty experts (the calibration forward before issue 30)
  grouped  torch.nn.functional.grouped_mm over the experts' token groups (what it uses now)
  bmm      every expert's tokens padded to the largest group, one batched matmul

Prints and writes JSON (median seconds of each, and the max difference from `loop`).

    python scripts/bench_grouped_experts.py --tiny OUT.json      # CPU, seconds
    python3 scripts/bench_grouped_experts.py OUT.json            # Kimi shapes, GPU, ~30 s
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

TINY = "--tiny" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--tiny"]
# tokens per batch, hidden, expert intermediate, experts, top-k
T, H, INTER, E, K = (4096, 128, 64, 24, 4) if TINY else (16384, 7168, 2048, 384, 8)
DEV = "cuda" if torch.cuda.is_available() and not TINY else "cpu"
DTYPE = torch.float32 if DEV == "cpu" else torch.bfloat16


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def routed_loop(xs, counts, gate_up, down):
    out, start = torch.empty(xs.shape[0], H, dtype=xs.dtype, device=DEV), 0
    for e, c in enumerate(counts.tolist()):
        if c:
            gate, up = nn.functional.linear(xs[start:start + c], gate_up[e]).chunk(2, dim=-1)
            out[start:start + c] = nn.functional.linear(nn.functional.silu(gate) * up, down[e])
            start += c
    return out


def routed_grouped(xs, counts, gate_up, down):
    ends = counts.cumsum(0).to(torch.int32)
    gate, up = nn.functional.grouped_mm(xs, gate_up.transpose(1, 2), offs=ends).chunk(2, -1)
    return nn.functional.grouped_mm(nn.functional.silu(gate) * up, down.transpose(1, 2),
                                    offs=ends)


def routed_bmm(xs, counts, gate_up, down):
    width = int(counts.max())
    ends = counts.cumsum(0)
    starts = ends - counts
    pos = torch.arange(xs.shape[0], device=DEV)
    expert = torch.repeat_interleave(torch.arange(E, device=DEV), counts)
    slot = pos - starts[expert]
    padded = torch.zeros(E, width, H, dtype=xs.dtype, device=DEV)
    padded[expert, slot] = xs
    gate, up = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(nn.functional.silu(gate) * up, down.transpose(1, 2))[expert, slot]


def timed(fn, *args) -> float:
    fn(*args)
    sync()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        runs.append(time.perf_counter() - t0)
    return sorted(runs)[2]


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, device=DEV, generator=g).to(DTYPE) * H ** -0.5
    down = torch.randn(E, H, INTER, device=DEV, generator=g).to(DTYPE) * INTER ** -0.5
    x = torch.randn(T, H, device=DEV, generator=g).to(DTYPE)
    # skewed routing, as a trained router's: expert popularity ~ 1/(rank+1)
    p = 1 / torch.arange(1, E + 1, device=DEV, dtype=torch.float32)
    exp = torch.multinomial(p.expand(T, E), K, generator=g).reshape(-1)
    order = torch.argsort(exp, stable=True)
    xs = x[torch.arange(T, device=DEV).repeat_interleave(K)[order]]
    counts = torch.bincount(exp, minlength=E)
    ref = routed_loop(xs, counts, gate_up, down).float()
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "dtype": str(DTYPE), "T": T, "H": H, "I": INTER,
           "E": E, "K": K}
    padded_gib = E * int(counts.max()) * (2 * INTER + H) * x.element_size() / 2**30
    res["bmm_padded_gib"] = round(padded_gib, 1)
    ways = [("loop", routed_loop), ("grouped", routed_grouped)]
    if padded_gib <= 16:  # skewed routing pads every group to the busiest one
        ways.append(("bmm", routed_bmm))
    for name, fn in ways:
        res[f"{name}_s"] = round(timed(fn, xs, counts, gate_up, down), 5)
        res[f"{name}_max_abs_diff"] = float((fn(xs, counts, gate_up, down).float() - ref)
                                            .abs().max())
    print(json.dumps(res))
    if ARGS:
        Path(ARGS[0]).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
