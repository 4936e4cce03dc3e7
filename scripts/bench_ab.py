"""A/B of kconvert trees on the full-size synthetic set: GPU or CPU, cold, one process each.

    git archive REV kconvert pipelines | tar -x -C /tmp/old      # a tree to compare with
    ROOT=/tmp/kbench OUT=... VARIANTS="old=/tmp/old,cuda new=.,cuda old=/tmp/old,cuda new=.,cuda" \
        python scripts/bench_ab.py

Builds ROOT/src as bench_convert.py does (anchor_convert.make_src: 15.5 GB, DIMS=full,
MOE_LAYERS=1) if it is not there. Each variant NAME=TREE,DEVICE runs `int4-to-nvfp4` (mse) from
the kconvert package in TREE, page cache dropped first, timed in-process after imports (on the
CPU also after numba's cached kernels are loaded), to os.sync(). Interleave the variants: this
disk's speed drifts within a run. Per run: wall, the writer's busy time (ShardSink.write),
peak RSS (VmHWM), the main thread's waits at each copy -> transform item boundary, and whether
the manifest's tensor hashes equal those of every earlier run on that device (they must).
Writes OUT/ab.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_convert as bc

CHILD = r'''
import contextlib, json, os, sys, time
src, dst, tree, device, scripts = sys.argv[1:6]
sys.path.insert(0, tree)
sys.path.insert(1, scripts)
from kconvert import engine
import kconvert.cli as cli
assert engine.__file__.startswith(tree), engine.__file__
writer_busy = [0.0]
items = []
write, compute = engine.ShardSink.write, engine.compute_item
def timed_write(self, *a, **k):
    t = time.perf_counter()
    try:
        return write(self, *a, **k)
    finally:
        writer_busy[0] += time.perf_counter() - t
def timed_compute(plan, item, *a, **k):
    t = time.perf_counter()
    try:
        return compute(plan, item, *a, **k)
    finally:
        items.append((isinstance(item, engine.CopyItem), t, time.perf_counter()))
engine.ShardSink.write, engine.compute_item = timed_write, timed_compute
if device == "cpu":
    import bench_convert
    bench_convert._load_cpu_kernels()
t = time.perf_counter()
with contextlib.suppress(SystemExit):
    cli.main(["int4-to-nvfp4", src, dst, "--device", device, "--quiet", "--overwrite"],
             standalone_mode=False)
os.sync()
wall = time.perf_counter() - t
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1]
gaps = [b[1] - a[2] for a, b in zip(items, items[1:]) if a[0] and not b[0]]
print("RESULT", json.dumps({"wall": round(wall, 2), "writer_busy": round(writer_busy[0], 2),
                            "vmhwm_gb": round(int(hwm) / 1e6, 2),
                            "copy_to_xform_waits_s": [round(g, 3) for g in gaps]}))
'''


def main() -> None:
    os.environ.setdefault("DIMS", "full")
    os.environ.setdefault("MOE_LAYERS", "1")
    root = bc.ROOT
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "config.json").exists():
        bc.load_anchor_ns()["make_src"](str(src))
    results, hash_sets = [], {}
    for spec in os.environ["VARIANTS"].split():
        name, rest = spec.split("=", 1)
        tree, device = rest.rsplit(",", 1)
        bc.rm(root / "kc")
        bc.drop_caches()
        env = bc.env_with(**({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
        p = subprocess.run([sys.executable, "-c", CHILD, str(src), str(root / "kc"),
                            str(Path(tree).resolve()), device, str(bc.REPO / "scripts")],
                           env=env, capture_output=True, text=True, cwd=bc.REPO)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        r = {"variant": name, "device": device,
             **(json.loads(got[-1][7:]) if got else {"error": p.stderr[-1500:]})}
        manifest = root / "kc" / "kconvert-manifest.json"
        if manifest.is_file():
            tensors = json.loads(manifest.read_text())["tensors"]
            hashes = json.dumps(sorted((k, v["hash"]) for k, v in tensors.items()))
            r["same_hashes_as_earlier_runs"] = hash_sets.setdefault(device, hashes) == hashes
        results.append(r)
        print(json.dumps(r), flush=True)
        bc.OUT.mkdir(parents=True, exist_ok=True)
        (bc.OUT / "ab.json").write_text(json.dumps(
            {"machine": bc.machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
