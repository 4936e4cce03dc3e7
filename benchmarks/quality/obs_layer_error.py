"""The MoE layer's relative output error, RTN vs GPTQ, on full-size Kimi expert shapes (CPU).

A synthetic routed-expert MoE layer with Kimi-K2's shapes (hidden 7168, expert intermediate
2048; EXPERTS experts, Kimi-style INT4 weights: codes -7..7 times bf16 group-32 scales, the
decoded INT4 being the target as in `int4-to-nvfp4 --method gptq`), inputs with correlated
channels and a few outlier channels (log-normal channel scales, a random mixing), TOKENS
routed calibration tokens and as many held-out tokens per expert. Each expert is quantized to
NVFP4 (mse block scales) by RTN and by the OBS engine's GPTQ (kept per matrix only where it
beats RTN, `obs.quantize_batches`), Hessians from the calibration tokens (down's from the
source gate/up, `--hessian source`); then the layer output sum_e g_e down_e(silu(gate_e x) *
up_e x) of each is compared with the INT4 layer's on calibration and on held-out tokens.

    python -m benchmarks obs_layer_error [--experts 4] [--tokens 2800]
        [--out benchmarks/results/obs_layer_error_cpu.json]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.harness import REPO, Timer, arguments, record
from kconvert.formats import nvfp4
from kconvert.methods import obs

HIDDEN, INTER = 7168, 2048


def int4_weights(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(-7, 8, (rows, k), generator=gen).float()
    scale = (torch.randn(rows, k // 32, generator=gen).mul(0.3).exp() * 0.004).bfloat16()
    return codes * scale.float().repeat_interleave(32, -1)


def inputs(n: int, mix: torch.Tensor, chan: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return ((torch.randn(n, HIDDEN, generator=gen) @ mix) * chan).bfloat16().float()


def expert_out(gu: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gu.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.T


def decoded(w: torch.Tensor, codes: torch.Tensor | None) -> torch.Tensor:
    """What an NVFP4 checkpoint holds for w [1, M, K]: encode (given codes, or mse), decode."""
    q = nvfp4.quantize(w, w.abs().amax((1, 2)), "mse", block_codes=codes)
    return nvfp4.dequantize(q.packed, q.block_scales, q.global_scale)


def main(argv: list[str]) -> None:
    ap = arguments("obs_layer_error", __doc__)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2800, help="calibration tokens per expert")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                         "obs_layer_error_cpu.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    timer = Timer()
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5 * 0.5 + torch.eye(HIDDEN)
    chan = torch.randn(HIDDEN, generator=gen).mul(0.5).exp()
    chan[torch.randperm(HIDDEN, generator=gen)[:16]] *= 20  # outlier channels
    ref = {"calib": 0.0, "heldout": 0.0}
    err = {m: {"calib": 0.0, "heldout": 0.0} for m in ("rtn", "gptq")}
    choices = []
    for e in range(a.experts):
        gu = int4_weights(2 * INTER, HIDDEN, gen)[None]
        down = int4_weights(HIDDEN, INTER, gen)[None]
        xs = {"calib": inputs(a.tokens, mix, chan, gen),
              "heldout": inputs(a.tokens, mix, chan, gen)}
        g = torch.rand(1, generator=gen).item() * 0.2 + 0.05  # a routing weight
        x = xs["calib"]
        gate, up = (x @ gu[0].T).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        hess = {"gate_proj": x.T @ x, "down_proj": act.T @ act}
        got = {"rtn": (decoded(gu, None), decoded(down, None))}
        gptq = []
        for w, proj in ((gu, "gate_proj"), (down, "down_proj")):
            out, codes, ch = obs.quantize_batches(
                w, nvfp4.tensor_scale(w.abs().amax((1, 2))), [obs.Member(1, e, proj)],
                lambda mb, hess=hess: obs.HessianSplit(hess[mb.proj], None), 16, "mse",
                torch.float32, "compressed-tensors", against_rtn=True)
            gptq.append(decoded(out, codes))
            choices.append({"expert": e, "proj": "gate_up" if proj == "gate_proj" else "down",
                            **ch[0].__dict__})
        got["gptq"] = tuple(gptq)
        for part, xp in xs.items():
            y = g * expert_out(gu[0], down[0], xp)
            ref[part] += float(y.square().sum(dtype=torch.float64))
            for method, (q_gu, q_down) in got.items():
                d = g * expert_out(q_gu[0], q_down[0], xp) - y
                err[method][part] += float(d.square().sum(dtype=torch.float64))
        print(f"expert {e}: {choices[-2:]}, errors so far {err}, reference {ref}", flush=True)
    rel = {m: {p: v / ref[p] for p, v in parts.items()} for m, parts in err.items()}
    res = {"record": record("obs_layer_error", gpu=False), "experts": a.experts,
           "tokens_per_expert": a.tokens, "hidden": HIDDEN,
           "inter": INTER, "relative_output_error": rel,
           "gptq_over_rtn": {p: rel["gptq"][p] / rel["rtn"][p] for p in ref},
           "choices": choices, "seconds": round(timer.elapsed(), 1),
           "command": f"python -m benchmarks obs_layer_error --experts {a.experts} --tokens "
                      f"{a.tokens}"}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("choices", "record")}, indent=1))
