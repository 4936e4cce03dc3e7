"""The learned method's trainer on full-size experts (issue 36): seconds per step of a batch of
Kimi-shaped routed experts (hidden 7168, moe_intermediate 2048), eager and compiled, p48 and
dense NVFP4, and the peak GPU memory per expert.

Device (one H100):
    python3 -m benchmarks learned $OUT/learned.json [--experts 8] [--steps 12] [--tokens 256]
CPU check (tiny dims):
    python -m benchmarks learned --tiny /tmp/learned_tiny.json

Random weights and tokens (speed only: quality is measured on the trained tiny MoEs,
`python -m benchmarks learned_quality`). Each configuration trains E experts for STEPS steps
after WARMUP steps (compilation happens there); reported: seconds per step, per expert-step,
the projection for a 384-expert layer at the method's default steps, and the peak memory.
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness import arguments, record, result_path, save, sync

KIMI = (7168, 2048)
TINY = (256, 64)


def problem(experts: int, hidden: int, inter: int, sparse: bool, dev: torch.device):
    from kconvert.formats import nvfp4, p48
    from kconvert.methods import expert_training as et

    g = torch.Generator(device=dev).manual_seed(0)
    w = {"gate_up": torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) / 50,
         "down": torch.randn(experts, hidden, inter, generator=g, device=dev) / 50}
    gs = {n: nvfp4.tensor_scale(v.abs().amax((1, 2))).repeat_interleave(v.shape[1])
          .reshape(experts, -1) for n, v in w.items()}
    keep = ({n: p48.top2_pairs(p48.pair_scores(v)) for n, v in w.items()} if sparse else None)
    tokens = 2048
    x = [torch.randn(tokens, hidden, generator=g, device=dev, dtype=torch.bfloat16)
         for _ in range(experts)]
    y = [torch.randn(tokens, hidden, generator=g, device=dev, dtype=torch.bfloat16)
         for _ in range(experts)]
    gw = [torch.rand(tokens, generator=g, device=dev) for _ in range(experts)]
    return et.Experts(w, keep, gs, x, y, gw), et.Encoding(16, "mse", "compressed-tensors")


def measure(experts: int, dims: tuple[int, int], sparse: bool, compiled: bool, steps: int,
            tokens: int, dev: torch.device) -> dict:
    from kconvert.methods import expert_training as et
    from kconvert.methods.learned import LearnedNvfp4, LearnedP48, training_bytes

    et.COMPILE = compiled
    et._compiled.cache_clear()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = {"experts": experts, "sparse": sparse, "compiled": compiled, "tokens": tokens}
    for label, n in (("warmup", 2), ("timed", steps)):
        ex, enc = problem(experts, *dims, sparse, dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        et.train(ex, enc, et.TrainSettings(n, tokens, 2e-3, 2e-3, 0),
                 [torch.Generator(device=dev).manual_seed(e) for e in range(experts)], dtype)
        sync()
        out[f"{label}_s"] = round(time.perf_counter() - t, 3)
        del ex
    per = out["timed_s"] / steps / experts
    out.update(step_s=round(out["timed_s"] / steps, 4), expert_step_ms=round(per * 1e3, 3),
               layer_384_default_steps_s=round(
                   per * 384 * (LearnedP48 if sparse else LearnedNvfp4).steps, 1),
               planned_bytes_per_expert=training_bytes(*dims, sparse, tokens))
    if dev.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["peak_gib_per_expert"] = round(out["peak_gib"] / experts, 3)
    return out


def main(argv: list[str]) -> None:
    ap = arguments("learned", __doc__)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dims = TINY if a.tiny else KIMI
    rec = record("learned", gpu=dev.type == "cuda")
    result = {"record": rec, "dims": dims, "runs": []}
    path = result_path(rec, a.out)
    for sparse in (True, False):
        for compiled in ((False, True) if dev.type == "cuda" else (False,)):
            got = measure(a.experts, dims, sparse, compiled, a.steps, a.tokens, dev)
            result["runs"].append(got)
            save(result, path)
            print(got, flush=True)
