"""`kconvert sparsify` (p48 + NVFP4) on one full-size synthetic Kimi MoE layer.

    python3 -m benchmarks sparsify --root /tmp/kbench --out-dir $OUT

The checkpoint is synthetic.kimi_set's (layer 0 dense, layer 1 MoE with 384 INT4 experts of
real shape, MLA attention, 16k vocabulary). In one process, each run timed on its own:
  dense      int4-to-nvfp4 (no sparsity), the reference cost of the same bytes
  magnitude  int4-p48-nvfp4, data-free masks
  sparsegpt  int4-p48-nvfp4 --method sparsegpt on --seqs x --seq random tokens (the calibration
             forward of layers 0-1 runs beside the conversion; its time is included)
Plus, on a tiny fixture, CPU vs GPU bytes of magnitude (must be identical) and of sparsegpt
(Cholesky/matmul rounding differ between devices: the share of differing bytes is reported).
--runs picks among dense, magnitude, sparsegpt and fixture (the tiny fixture's comparison).
Results as JSON in --out-dir.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path

import torch

from benchmarks.harness import Timer, arguments, comma_list, now, record, result_path, save
from benchmarks.outputs import share_differing
from benchmarks.synthetic import add_dims, kimi_set, random_ids
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.methods.hessians import Calibration, CalibrationHessians
from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.fixtures import make_fixture


def run(src: Path, dst: Path, recipe: str, opts: dict, device: str, batch: int,
        ids: torch.Tensor | None = None) -> dict:
    shutil.rmtree(dst, ignore_errors=True)

    def prepare(ckpt):
        if ids is None:
            return {}
        return {"sparsify": Calibration(
            CalibrationHessians(ckpt, ids, torch.device(device), batch))}

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = now()
    manifest = convert(str(src), str(dst), load_recipe(recipe), opts,
                       RunControl(device=device, quiet=True), prepare=prepare)
    out = {"wall_s": round(now() - t0, 2), "rel_mse_mean": manifest.summary["rel_mse_mean"],
           "out_gb": round(sum(f.stat().st_size for f in dst.glob("*.safetensors")) / 1e9, 3)}
    if device == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return out


def main(argv: list[str]) -> None:
    ap = arguments("sparsify", __doc__, root="/tmp/kbench", results=True)
    add_dims(ap, moe_layers=None)
    ap.add_argument("--seqs", type=int, default=32, help="sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default: %(default)s)")
    ap.add_argument("--runs", type=comma_list,
                    default=["dense", "magnitude", "sparsegpt", "fixture"],
                    help="which runs (default: dense,magnitude,sparsegpt,fixture)")
    a = ap.parse_args(argv)
    root, seqs, seq, batch, runs = a.root, a.seqs, a.seq, a.batch, a.runs
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec = record("sparsify", gpu=dev == "cuda", scratch=root)
    res: dict = {"record": rec, "device": rec["device"]["name"], "cpus": os.cpu_count(),
                 "seqs": seqs, "seq_len": seq, "runs": {}}
    if set(runs) & {"dense", "magnitude", "sparsegpt"}:
        made = Timer()
        dims = a.dims
        src = kimi_set(root, dims)
        res["make_s"] = round(made.elapsed(), 1)
        ids = random_ids(seqs, seq, dims.vocab)
        specs = {"dense": ("int4-to-nvfp4", {}, None),
                 "magnitude": ("int4-p48-nvfp4", {"method": "magnitude"}, None),
                 "sparsegpt": ("int4-p48-nvfp4", {"method": "sparsegpt"}, ids)}
        for name in [r for r in runs if r in specs]:
            recipe, opts, data = specs[name]
            res["runs"][name] = run(src, root / f"out-{name}", recipe, opts, dev, batch, data)
            print(name, res["runs"][name], flush=True)
            shutil.rmtree(root / f"out-{name}", ignore_errors=True)
    if "fixture" in runs and dev == "cuda":
        fx = make_fixture(root / "fixture", "k2-int4-kimi", FixtureDims())
        ids = random_ids(16, 64, FixtureDims().vocab)
        for method, data in (("magnitude", None), ("sparsegpt", ids)):
            dirs = {}
            for device in ("cpu", "cuda"):
                dirs[device] = root / f"fx-{method}-{device}"
                run(fx, dirs[device], "sparsify", {"method": method}, device, batch, data)
            res[f"fixture_cpu_vs_cuda_{method}"] = share_differing(dirs["cpu"], dirs["cuda"])
            print(method, res[f"fixture_cpu_vs_cuda_{method}"], flush=True)
    res["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)
    print(json.dumps({k: v for k, v in res.items() if k != "record"}, indent=1))
    save(res, result_path(rec, out_dir=a.out_dir))
