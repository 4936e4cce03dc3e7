"""One batch of routed experts three ways, on the tiny MoE's shapes or Kimi's.

  loop     a Python loop over the non-empty experts (the calibration forward before issue 30)
  grouped  torch.nn.functional.grouped_mm over the experts' token groups (what it uses now)
  bmm      every expert's tokens padded to the largest group, one batched matmul

Prints and writes JSON (median seconds of each, and the max difference from `loop`).

    python -m benchmarks grouped_experts --tiny OUT.json      # CPU, seconds
    python3 -m benchmarks grouped_experts OUT.json            # Kimi shapes, GPU, ~30 s
"""

from __future__ import annotations

import json

import torch
from torch import nn

from benchmarks.harness import Timer, arguments, record, result_path, save


def routed_loop(xs, counts, gate_up, down):
    out, start = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device), 0
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
    pos = torch.arange(xs.shape[0], device=xs.device)
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=xs.device), counts)
    slot = pos - starts[expert]
    padded = torch.zeros(counts.numel(), width, xs.shape[1], dtype=xs.dtype, device=xs.device)
    padded[expert, slot] = xs
    gate, up = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(nn.functional.silu(gate) * up, down.transpose(1, 2))[expert, slot]


def main(argv: list[str]) -> None:
    ap = arguments("grouped_experts", __doc__)
    ap.add_argument("out", nargs="?", help="JSON results file (default: in OUT)")
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE's shapes on the CPU")
    a = ap.parse_args(argv)
    # tokens per batch, hidden, expert intermediate, experts, top-k
    T, H, INTER, E, K = (4096, 128, 64, 24, 4) if a.tiny else (16384, 7168, 2048, 384, 8)
    dev = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, device=dev, generator=g).to(dtype) * H ** -0.5
    down = torch.randn(E, H, INTER, device=dev, generator=g).to(dtype) * INTER ** -0.5
    x = torch.randn(T, H, device=dev, generator=g).to(dtype)
    # skewed routing, as a trained router's: expert popularity ~ 1/(rank+1)
    p = 1 / torch.arange(1, E + 1, device=dev, dtype=torch.float32)
    exp = torch.multinomial(p.expand(T, E), K, generator=g).reshape(-1)
    order = torch.argsort(exp, stable=True)
    xs = x[torch.arange(T, device=dev).repeat_interleave(K)[order]]
    counts = torch.bincount(exp, minlength=E)
    ref = routed_loop(xs, counts, gate_up, down).float()
    rec = record("grouped_experts", gpu=dev == "cuda")
    res = {"device": rec["device"]["name"], "threads": torch.get_num_threads(),
           "dtype": str(dtype), "T": T, "H": H, "I": INTER, "E": E, "K": K}
    padded_gib = E * int(counts.max()) * (2 * INTER + H) * x.element_size() / 2**30
    res["bmm_padded_gib"] = round(padded_gib, 1)
    ways = [("loop", routed_loop), ("grouped", routed_grouped)]
    if padded_gib <= 16:  # skewed routing pads every group to the busiest one
        ways.append(("bmm", routed_bmm))
    timer = Timer(dev)
    for name, fn in ways:
        timer.each(1, fn, xs, counts, gate_up, down)  # warm-up
        times, _ = timer.each(5, fn, xs, counts, gate_up, down)
        res[f"{name}_s"] = round(sorted(times)[2], 5)
        res[f"{name}_max_abs_diff"] = float((fn(xs, counts, gate_up, down).float() - ref)
                                            .abs().max())
    print(json.dumps(res))
    save({"record": rec, **res}, result_path(rec, a.out))
