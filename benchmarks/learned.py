"""The learned methods on full-size experts.

The trainer (issue 36): seconds per step of a batch of Kimi-shaped routed experts (hidden 7168,
moe_intermediate 2048), eager and compiled, p48 and dense NVFP4, and the peak GPU memory per
expert. On a GPU the compiled step is timed as the method runs it, inside
kconvert.gpu.devices.deterministic() (where inductor takes its reductions' untuned tiles), and
outside it; p48's also with its mask passes compiled by inductor rather than the Triton kernels
(kconvert.methods.pattern_masks_triton) the method uses.

Device (one H100):
    python3 -m benchmarks learned $OUT/learned.json [--experts 8] [--steps 12] [--tokens 256]
CPU check (tiny dims):
    python -m benchmarks learned --tiny /tmp/learned_tiny.json

A whole MoE layer against another tree (issue 47, `--layer OLD_TREE`): `sparsify --method
learned` (p48) and `int4-to-nvfp4 --method learned` (NVFP4) on synthetic.kimi_set (layer 0
dense, --moe-layers MoE layers of 384 INT4 experts) with --seqs random sequences of --seq
tokens, each command in its own process under --gpu-memory, from OLD_TREE's kconvert and this
one's, interleaved (old p48, new p48, old NVFP4, new NVFP4). Per run: exit, wall, and from `-v`
each MoE layer's method seconds per phase (one-shot, routing, data, train, guard: the sum of its
items' lines), its first item (where the trainer compiles) and `steady_s`: the layer's items at
the median of its later items (what a layer costs once compiled). The JSON is rewritten after
every run; a run that would start past --deadline-s is skipped (`--methods nvfp4` runs the rest
in another call on the same machine, the set kept in ROOT). `--methods gptq` times
`int4-to-nvfp4 --method gptq` the same way, each MoE layer from its `-v` "OBS layer" line (the
calibration forward it waited for, then its solve; with --moe-layers 2 the second is a
steady layer).
    git archive 7a98966 kconvert pipelines | tar -x -C .bench/old      # the old tree
    python3 -m benchmarks learned --layer .bench/old --root /tmp/kbench --out-dir $OUT
CPU check (tiny dims, a few minutes):
    python -m benchmarks learned --layer OLD_TREE --tiny --root /tmp/kl --out-dir /tmp/kl

p48's two mask passes alone (`--passes`): the masked weights and the update of one stack of E
gate_up matrices [E, 2I, H], inductor's compiled passes inside and outside deterministic() and
the Triton kernels, milliseconds per call (the median of --steps calls after a first), beside
a copy of the weights and logits (the memory floor of the masked pass's reads):
    python3 -m benchmarks learned $OUT/passes.json --passes --experts 16

Random weights and tokens (speed only: quality is measured on the trained tiny MoEs,
`python -m benchmarks learned_quality`). Each configuration trains E experts for STEPS steps
after WARMUP steps (compilation happens there); reported: seconds per step, per expert-step,
the projection for a 384-expert layer at the method's default steps, and the peak memory.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    STARTED,
    Timer,
    arguments,
    comma_list,
    record,
    result_path,
    save,
    sync,
)
from benchmarks.multi_gpu_ranks import OBS_LINE, layer_seconds
from benchmarks.synthetic import FULL, random_ids, write_ids
from benchmarks.synthetic import TINY as TINY_SET
from benchmarks.synthetic import kimi_set as make_set

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
            tokens: int, dev: torch.device, in_deterministic: bool = True,
            mask_kernel: bool = True) -> dict:
    from kconvert.gpu.devices import deterministic
    from kconvert.methods import expert_training as et
    from kconvert.methods.learned import training_bytes
    from kconvert.plugins.methods import LearnedNvfp4Settings, LearnedP48Settings

    et.COMPILE, et.MASK_KERNEL = compiled, mask_kernel
    et.compiled.cache_clear()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = {"experts": experts, "sparse": sparse, "compiled": compiled, "tokens": tokens,
           "deterministic": in_deterministic, "mask_kernel": sparse and mask_kernel}
    for label, n in (("warmup", 2), ("timed", steps)):
        ex, enc = problem(experts, *dims, sparse, dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        with torch.enable_grad(), deterministic() if in_deterministic else nullcontext():
            et.train(ex, enc, et.TrainSettings(n, tokens, 2e-3, 2e-3, 0),
                     [torch.Generator(device=dev).manual_seed(e) for e in range(experts)],
                     dtype)
        sync()
        out[f"{label}_s"] = round(time.perf_counter() - t, 3)
        del ex
    per = out["timed_s"] / steps / experts
    out.update(step_s=round(out["timed_s"] / steps, 4), expert_step_ms=round(per * 1e3, 3),
               layer_384_default_steps_s=round(
                   per * 384 * (LearnedP48Settings if sparse else LearnedNvfp4Settings)
                   .model_fields["steps"].default, 1),
               planned_bytes_per_expert=training_bytes(*dims, sparse, tokens))
    if dev.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["peak_gib_per_expert"] = round(out["peak_gib"] / experts, 3)
    return out


# --layer's methods: (command, --method).
COMMANDS = {"p48": ("sparsify", "learned"), "nvfp4": ("int4-to-nvfp4", "learned"),
            "gptq": ("int4-to-nvfp4", "gptq")}


def obs_layer_seconds(log: str) -> dict[str, dict]:
    """Per MoE layer of an OBS method (from `-v`'s layer lines): the calibration forward it
    waited for, its solve, and their sum."""
    return {m["layer"]: {"waiting_s": float(m["waited"]), "solving_s": float(m["solving"]),
                         "total_s": round(float(m["waited"]) + float(m["solving"]), 2)}
            for m in OBS_LINE.finditer(log)}


def guard_summary(out: Path) -> dict:
    """What the guard saw of a learned run's routed matrices (its manifest's records): how many
    trained to a finite held-out error, how many were written learned, and the median ratio of
    learned to one-shot error."""
    manifest = out / "kconvert-manifest.json"
    if not manifest.exists():
        return {}
    records = [r for k, r in json.loads(manifest.read_text()).get("obs", {}).items()
               if ".mlp.experts." in k and "learned_error" in r]
    ratios = [r["learned_error"] / r["oneshot_error"] for r in records
              if r["learned_error"] is not None and r["oneshot_error"]]
    return {"matrices": len(records), "finite": len(ratios),
            "learned": sum(r["method"] != r["oneshot"] for r in records),
            "median_learned_over_oneshot": round(statistics.median(ratios), 4) if ratios else None}


def layer_runs(a) -> None:
    """--layer: each method from the old tree and this one, one process per run."""
    dims = TINY_SET if a.tiny else FULL
    root = Path(a.root)
    src = make_set(root, dims, a.moe_layers)
    data = write_ids(root / f"learned-{a.seqs}x{a.seq}.jsonl",
                     random_ids(a.seqs, a.seq, dims.vocab))
    device = "cpu" if a.tiny else "cuda"
    trees = {"old": Path(a.layer).resolve(), "new": Path(__file__).resolve().parent.parent}
    rec = record("learned_layer", gpu=not a.tiny)
    result = {"record": rec, "dims": str(dims), "moe_layers": a.moe_layers, "seqs": a.seqs,
              "seq": a.seq, "gpu_memory": a.gpu_memory, "trees": {k: str(v) for k, v in
                                                                  trees.items()}, "runs": []}
    path = result_path(rec, a.out, out_dir=Path(a.out_dir))
    budget = [] if a.tiny else ["--gpu-memory", a.gpu_memory]
    for method in a.methods:
        for tree in ("old", "new"):
            name = f"{tree}-{method}"
            if time.perf_counter() - STARTED > a.deadline_s:
                result["runs"].append({"run": name, "skipped": "past --deadline-s"})
                save(result, path)
                continue
            dst = root / "learned-out" / name
            shutil.rmtree(dst, ignore_errors=True)
            command, flag = COMMANDS[method]
            argv = [sys.executable, "-m", "kconvert", command, str(src), str(dst),
                    "--method", flag, "--data", str(data), "--samples", str(a.seqs),
                    "--seq-len", str(a.seq), "--device", device, *budget, "-v"]
            c = run_child(argv, env=child_env(trees[tree]), cwd=trees[tree], merge=True)
            layers = obs_layer_seconds if flag != "learned" else layer_seconds
            result["runs"].append({"run": name, "rc": c.rc, "wall_s": c.wall_s,
                                   "layers": layers(c.stdout), "guard": guard_summary(dst),
                                   "last_lines": c.stdout.splitlines()[-6:]})
            save(result, path)
            print(result["runs"][-1], flush=True)
            shutil.rmtree(dst, ignore_errors=True)  # a full-size output: the disk is small


def pass_runs(experts: int, dims: tuple[int, int], calls: int, dev: torch.device) -> dict:
    """--passes: milliseconds per call of each p48 mask pass, as the module doc says."""
    from kconvert.formats import p48
    from kconvert.gpu.devices import deterministic
    from kconvert.methods import expert_training as et

    hidden, inter = dims
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) / 50
    logits = torch.randn(*w.shape[:-1], hidden // 8, 6, generator=g, device=dev) / 10
    seed = torch.randint(1 << 62, (experts,), generator=g, device=dev)
    grad = (torch.randn(w.shape, generator=g, device=dev) / 1000).to(torch.bfloat16)
    state = tuple(torch.zeros_like(t) for t in (w, w, logits, logits))
    scalars = [torch.tensor(v, device=dev) for v in (100.0, 2.0, 1e-3, 0.1, 0.1)]
    scale, temperature, mask_step, c1, c2 = scalars
    step, masks = torch.full((experts, 1, 1), 1e-3, device=dev), p48.patterns(dev)
    timer = Timer(dev)

    def ms(fn: Callable, *args: object) -> float:
        return round(statistics.median(timer.each(calls + 1, fn, *args)[0][1:]) * 1e3, 3)

    out = {"experts": experts, "shape": list(w.shape),
           "copy_ms": ms(lambda: (w.clone(), logits.clone()))}
    configs = ([("inductor", True), ("inductor", False), ("kernel", True)]
               if dev.type == "cuda" else [("eager", True)])
    for passes, in_deterministic in configs:
        et.MASK_KERNEL = passes == "kernel"
        et.compiled.cache_clear()
        masked, update = et.mask_passes(dev.type)
        with deterministic() if in_deterministic else nullcontext():
            key = f"{passes}{'_deterministic' if in_deterministic else ''}"
            out[f"{key}_masked_ms"] = ms(masked, w, logits, seed, scale, temperature, masks)
            out[f"{key}_update_ms"] = ms(update, w, logits, grad, seed, scale, temperature,
                                         masks, state, step, mask_step, c1, c2)
        print(out, flush=True)
    return out


def main(argv: list[str]) -> None:
    ap = arguments("learned", __doc__, root="/tmp/kbench", results=True, deadline_s=570.0)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--passes", action="store_true", help="p48's mask passes alone (module doc)")
    ap.add_argument("--layer", metavar="OLD_TREE",
                    help="time whole MoE layers against OLD_TREE's kconvert (module doc)")
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gpu-memory", default="74GiB")
    ap.add_argument("--methods", type=comma_list, default=["p48", "nvfp4"],
                    help="of p48,nvfp4,gptq (default p48,nvfp4): --layer's commands, or the "
                         "trainer's (p48 and nvfp4; gptq has none)")
    a = ap.parse_args(argv)
    if a.layer:
        layer_runs(a)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dims = TINY if a.tiny else KIMI
    rec = record("learned", gpu=dev.type == "cuda")
    result = {"record": rec, "dims": dims, "runs": []}
    path = result_path(rec, a.out, out_dir=Path(a.out_dir))
    if a.passes:
        result["passes"] = pass_runs(a.experts, dims, a.steps, dev)
        save(result, path)
        return
    # (compiled, inside deterministic(), p48's mask kernels): eager, as the method runs, and
    # with inductor's mask passes inside and outside the mode
    configs = ([(False, True, False), (True, True, True), (True, True, False),
                (True, False, False)] if dev.type == "cuda" else [(False, True, False)])
    for sparse in (s == "p48" for s in a.methods):
        for compiled, in_deterministic, mask_kernel in configs:
            if mask_kernel and not sparse:
                continue
            got = measure(a.experts, dims, sparse, compiled, a.steps, a.tokens, dev,
                          in_deterministic, mask_kernel)
            result["runs"].append(got)
            save(result, path)
            print(got, flush=True)
