"""Benchmark: `kconvert sparsify` (p48 + NVFP4) on one full-size synthetic Kimi MoE layer.

The checkpoint is bench_calibrate's (layer 0 dense, layer 1 MoE with 384 INT4 experts of real
shape, MLA attention, 16k vocabulary). In one process, each run timed on its own:
  dense      int4-to-nvfp4 (no sparsity), the reference cost of the same bytes
  magnitude  int4-p48-nvfp4, data-free masks
  sparsegpt  int4-p48-nvfp4 --method sparsegpt on SEQS x SEQ random tokens (the calibration
             forward of layers 0-1 runs beside the conversion; its time is included)
Plus, on a tiny fixture, CPU vs GPU bytes of magnitude (must be identical) and of sparsegpt
(Cholesky/matmul rounding differ between devices: the share of differing bytes is reported).
Results as JSON in $OUT/bench_sparsify.json.

Env: ROOT (scratch dir), OUT (result dir), SEQS (32), SEQ (2048), BATCH (8), RUNS (comma list).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_calibrate

from kconvert.convert import RunControl, convert
from kconvert.methods.hessians import Calibration, CalibrationHessians
from kconvert.recipes import load_recipe
from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.fixtures import make_fixture

ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
OUT = Path(os.environ.get("OUT", "/tmp/kbench-out"))
SEQS, SEQ, BATCH = (int(os.environ.get(k, d)) for k, d in
                    (("SEQS", 32), ("SEQ", 2048), ("BATCH", 8)))
RUNS = os.environ.get("RUNS", "dense,magnitude,sparsegpt,fixture").split(",")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(src: Path, dst: Path, recipe: str, opts: dict, device: str, ids=None) -> dict:
    shutil.rmtree(dst, ignore_errors=True)

    def prepare(ckpt):
        if ids is None:
            return {}
        return {"sparsify": Calibration(
            CalibrationHessians(ckpt, ids, torch.device(device), BATCH))}

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    manifest = convert(str(src), str(dst), load_recipe(recipe), opts,
                       RunControl(device=device, quiet=True), prepare=prepare)
    wall = time.perf_counter() - t0
    out = {"wall_s": round(wall, 2), "rel_mse_mean": manifest.summary["rel_mse_mean"],
           "out_gb": round(sum(f.stat().st_size for f in dst.glob("*.safetensors")) / 1e9, 3)}
    if device == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return out


def tensors(d: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    out = {}
    for p in sorted(d.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes()
    return out


def compare(a: Path, b: Path) -> dict:
    ta, tb = tensors(a), tensors(b)
    differ = [k for k in ta if ta[k] != tb.get(k)]
    nbytes = sum(len(ta[k]) for k in differ)
    diff_bytes = sum(sum(x != y for x, y in zip(ta[k], tb[k], strict=True)) for k in differ)
    return {"tensors": len(ta), "tensors_differ": len(differ),
            "bytes_differ_share": round(diff_bytes / max(sum(map(len, ta.values())), 1), 6),
            "differing_tensor_bytes": nbytes}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                 "cpus": os.cpu_count(), "seqs": SEQS, "seq_len": SEQ, "runs": {}}
    if set(RUNS) & {"dense", "magnitude", "sparsegpt"}:
        src = ROOT / "calib-src"
        t0 = time.perf_counter()
        bench_calibrate.make_checkpoint(src)
        res["make_s"] = round(time.perf_counter() - t0, 1)
        ids = torch.randint(0, bench_calibrate.V, (SEQS, SEQ),
                            generator=torch.Generator().manual_seed(0))
        specs = {"dense": ("int4-to-nvfp4", {}, None),
                 "magnitude": ("int4-p48-nvfp4", {"method": "magnitude"}, None),
                 "sparsegpt": ("int4-p48-nvfp4", {"method": "sparsegpt"}, ids)}
        for name in [r for r in RUNS if r in specs]:
            recipe, opts, data = specs[name]
            res["runs"][name] = run(src, ROOT / f"out-{name}", recipe, opts, DEV, data)
            print(name, res["runs"][name], flush=True)
            shutil.rmtree(ROOT / f"out-{name}", ignore_errors=True)
    if "fixture" in RUNS and DEV == "cuda":
        fx = make_fixture(ROOT / "fixture", "k2-int4-kimi", FixtureDims())
        ids = torch.randint(0, FixtureDims().vocab, (16, 64),
                            generator=torch.Generator().manual_seed(0))
        for method, data in (("magnitude", None), ("sparsegpt", ids)):
            dirs = {}
            for device in ("cpu", "cuda"):
                dirs[device] = ROOT / f"fx-{method}-{device}"
                run(fx, dirs[device], "sparsify", {"method": method}, device, data)
            res[f"fixture_cpu_vs_cuda_{method}"] = compare(dirs["cpu"], dirs["cuda"])
            print(method, res[f"fixture_cpu_vs_cuda_{method}"], flush=True)
    res["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)
    print(json.dumps(res, indent=1))
    (OUT / "bench_sparsify.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
