"""Benchmark: the whole SparseGPT p48 + NVFP4 stage on one full-size Kimi MoE layer, old vs new.

    git archive <commit before the batched loop> kconvert | tar -x -C /tmp/old   # optional
    OUT=/tmp/kbench-out python scripts/bench_sparsegpt.py --old /tmp/old      # H200, ~4-5 min
    python scripts/bench_sparsegpt.py --tiny                                  # CPU check, ~1 min

Parts (each timed on its own, JSON line on stdout and in $OUT/bench_sparsegpt.json):
  stage   384 synthetic experts (gate+up as one [4096, 7168] matrix sharing a 7168^2 Hessian,
          down [7168, 2048] with a 2048^2 one), TOKENS (2800) random routed tokens per expert:
          Hessians X^T X + U = chol(H^-1) + the prune/quantize loop + the NVFP4 encode, in
          batches sized by sparsegpt.experts_per_batch on half the default GPU budget. NEW runs the
          whole layer; OLD (the per-column loop: `--old TREE`'s kconvert/sparsity/sparsegpt.py,
          else tests/oracles.py's copy of it) runs OLD_EXPERTS (6) experts and is extrapolated
          to 384. Per phase seconds, GPU utilisation (nvidia-smi, sampled every 0.2 s), peak
          GPU memory (torch) and host RSS.
  precision  one gate+up batch with the error products in fp32, tf32 and bf16: seconds and
          the reconstruction error tr(dW H dW^T) / tr(W H W^T) of each.
  e2e     `kconvert sparsify --pattern p48 --method sparsegpt` on bench_calibrate's full-size
          one-MoE-layer checkpoint (SEQS x SEQ random tokens: ~2,700 routed per expert), then
          `kconvert audit` on its output; wall s, peak host RSS, GPU peak and mean utilisation.
--tiny: a few small experts on the CPU, and e2e on the tiny k2-int4-kimi fixture.
Env: ROOT (scratch, /tmp/kbench), OUT, TOKENS, OLD_EXPERTS, SEQS (64), SEQ (2048), PARTS.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from kconvert.formats import nvfp4  # noqa: E402
from kconvert.sparsity import sparsegpt  # noqa: E402

ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
OUT = Path(os.environ.get("OUT", "/tmp/kbench-out"))


class GpuSampler:
    """nvidia-smi's utilisation and memory.used, sampled on a thread while a part runs."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                line = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                     "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True, text=True, timeout=5).stdout.split(",")
                self.samples.append((float(line[0]), float(line[1])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def __enter__(self) -> GpuSampler:
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        util = [u for u, _ in self.samples]
        return {"gpu_util_mean_pct": round(sum(util) / len(util), 1),
                "gpu_mem_used_peak_gib": round(max(m for _, m in self.samples) / 1024, 1)}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Phases:
    """Seconds per phase, with the device synchronised at each boundary."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.s = dev, {}

    def __call__(self, name: str, fn, *args, **kw):
        sync(self.dev)
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        sync(self.dev)
        self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0
        return out


def load_old(tree: str | None):
    """(prepare_inverse, prune_quantize) of the per-column loop."""
    if tree is None:
        import oracles

        return oracles.sparsegpt_inverse_reference, (
            lambda w, u, gs, g, rule, *_a: oracles.sparsegpt_per_column(w, u, gs, g, rule))
    spec = importlib.util.spec_from_file_location(
        "old_sparsegpt", Path(tree) / "kconvert" / "sparsity" / "sparsegpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.prepare_inverse, mod.prune_quantize


def run_batch(ph: Phases, inverse, loop, e: int, rows: int, k: int, tokens: int,
              gen: torch.Generator, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of e experts through Hessian, inverse, loop and encode; (w, H, W-hat)."""
    dev = ph.dev
    w = torch.randn(e, rows, k, generator=gen, device=dev) * k ** -0.5
    x = torch.randn(e, tokens, k, generator=gen, device=dev).to(torch.bfloat16)
    h = ph("hessian", lambda x: torch.stack([xi.float().T @ xi.float() for xi in x]), x)
    del x
    u = ph("inverse", inverse, h)
    amax = w.abs().amax((1, 2))
    gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
    w_hat, codes = ph("loop", loop, w, u, gs, 16, "mse", torch.float32, "compressed-tensors",
                      **kw)
    del u
    ph("encode", nvfp4.quantize, w_hat, amax, "mse", group_size=16, block_codes=codes)
    return w, h, w_hat


def obs_budget(dev: torch.device) -> int | None:
    """The OBS batches' bytes when nothing else holds the GPU: half the default budget."""
    from kconvert.gpu_budget import resolve

    budget = resolve(dev, None)
    return None if budget is None else budget // 2


def layer(dev: torch.device, inverse, loop, experts: int, dims, tokens: int, batch=None) -> dict:
    """All `experts` of a layer, gate+up then down, in batches; seconds per phase."""
    gen = torch.Generator(device=dev).manual_seed(0)
    ph = Phases(dev)
    hidden, inter = dims
    t0 = time.perf_counter()
    batches = {}
    for name, rows, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        step = batch or sparsegpt.experts_per_batch(rows, k, obs_budget(dev), tokens)
        batches[name] = step
        for start in range(0, experts, step):
            run_batch(ph, inverse, loop, min(step, experts - start), rows, k, tokens, gen)
    return {"experts": experts, "batch_experts": batches,
            "seconds": round(time.perf_counter() - t0, 2),
            "phases_s": {k: round(v, 2) for k, v in ph.s.items()}}


def relative_error(w: torch.Tensor, h: torch.Tensor, w_hat: torch.Tensor) -> float:
    d = w - w_hat
    return float((d @ h * d).sum(dtype=torch.float64) / (w @ h * w).sum(dtype=torch.float64))


def precision_part(dev: torch.device, dims, tokens: int, e: int) -> dict:
    hidden, inter = dims
    out = {}
    for precision in sparsegpt.PRECISIONS:
        ph = Phases(dev)
        gen = torch.Generator(device=dev).manual_seed(1)  # the same problem for each
        w, h, w_hat = run_batch(ph, sparsegpt.prepare_inverse, sparsegpt.prune_quantize, e,
                                2 * inter, hidden, tokens, gen, precision=precision)
        out[precision] = {"loop_s": round(ph.s["loop"], 2),
                          "rel_error": round(relative_error(w, h, w_hat), 6)}
        del w, h, w_hat
    return {"experts": e, **out}


def cli(*args: str) -> float:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kconvert.cli", *args], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])})
    if res.returncode:
        raise SystemExit(f"kconvert {args[0]} failed ({res.returncode}):\n{res.stdout}\n"
                         f"{res.stderr}")
    return round(time.perf_counter() - t0, 2)


def e2e_part(tiny: bool, dev: str) -> dict:
    import shutil

    if tiny:
        from kconvert.testing.fixture_weights import FixtureDims
        from kconvert.testing.fixtures import make_fixture

        src = make_fixture(ROOT / "fixture", "k2-int4-kimi", FixtureDims())
        seqs, seq, vocab = 16, 64, FixtureDims().vocab
        make_s = 0.0
    else:
        import bench_calibrate

        src = ROOT / "calib-src"
        t0 = time.perf_counter()
        if not (src / "config.json").exists():
            bench_calibrate.make_checkpoint(src)
        make_s = round(time.perf_counter() - t0, 1)
        seqs, seq, vocab = (int(os.environ.get("SEQS", 64)), int(os.environ.get("SEQ", 2048)),
                            bench_calibrate.V)
    ids = torch.randint(0, vocab, (seqs, seq), generator=torch.Generator().manual_seed(0))
    data = ROOT / "calib.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ids.tolist()))
    dst = ROOT / "out-sparsegpt"
    shutil.rmtree(dst, ignore_errors=True)
    with GpuSampler() as gpu:
        sparsify_s = cli("sparsify", str(src), str(dst), "--pattern", "p48", "--method",
                         "sparsegpt", "--data", str(data), "--samples", str(seqs), "--seq-len",
                         str(seq), "--device", dev, "--quiet")
    audit_s = cli("audit", str(dst))
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    shutil.rmtree(dst, ignore_errors=True)
    return {"make_s": make_s, "seqs": seqs, "seq_len": seq, "sparsify_wall_s": sparsify_s,
            "audit_wall_s": audit_s, "audit": "passed", "hessian":
            manifest["options"]["sparsify"].get("hessian"),
            "rel_mse_mean": manifest["summary"]["rel_mse_mean"],
            "children_peak_rss_gib": round(
                resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
            **gpu.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="a kconvert tree with the per-column loop (git archive)")
    ap.add_argument("--tiny", action="store_true", help="small sizes, CPU (a check)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a check, not a benchmark: no thread contention
        nvfp4.warm_cpu_kernels()  # numba's compile is not the encode's time
    dims = (256, 128) if args.tiny else (7168, 2048)
    experts = 8 if args.tiny else 384
    tokens = int(os.environ.get("TOKENS", 300 if args.tiny else 2800))
    old_experts = int(os.environ.get("OLD_EXPERTS", 2 if args.tiny else 6))
    parts = os.environ.get("PARTS", "stage,precision,e2e").split(",")
    ROOT.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "tiny": args.tiny, "tokens_per_expert": tokens,
                 "old_tree": args.old or "tests/oracles.py"}
    if "stage" in parts:
        with torch.no_grad(), GpuSampler() as gpu:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            new = layer(dev, sparsegpt.prepare_inverse, sparsegpt.prune_quantize, experts, dims,
                        tokens)
            if dev.type == "cuda":
                new["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        new.update(gpu.summary())
        res["new"] = new
        print("new", new, flush=True)
        old = layer(dev, *load_old(args.old), old_experts, dims, tokens, batch=old_experts)
        old["layer_s_extrapolated"] = round(old["seconds"] * experts / old_experts, 1)
        res["old"] = old
        res["speedup"] = round(old["layer_s_extrapolated"] / new["seconds"], 1)
        print("old", old, flush=True)
    if "precision" in parts:
        with torch.no_grad():
            res["precision"] = precision_part(dev, dims, tokens, 4 if args.tiny else 16)
        print("precision", res["precision"], flush=True)
    if "e2e" in parts:
        res["e2e"] = e2e_part(args.tiny, dev.type)
        print("e2e", res["e2e"], flush=True)
    res["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    (OUT / "bench_sparsegpt.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
