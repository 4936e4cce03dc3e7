"""CPU end-to-end on the full-size set under thread/allocator knobs, kconvert unchanged.

    ROOT=/tmp/kbench OUT=... python scripts/bench_cpu_knobs.py

Builds anchor_convert.py's full-size set (DIMS=full, MOE_LAYERS=1), warms numba's kernel
cache on the bundled fixture, then runs `kconvert int4-to-nvfp4 --device cpu` in-process, page
cache dropped before each, once per variant: base; nt14 (NUMBA_NUM_THREADS=14: two cores left
to the reader/writer threads); nommap (glibc's own mmap threshold instead of the engine's
1 MiB); dyn (numba.set_parallel_chunksize(4): dynamic scheduling); base again (drift).
Prints wall and the compute thread's busy time on transform items; writes OUT/exp.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DIMS", "full")
os.environ.setdefault("MOE_LAYERS", "1")
import bench_convert as bc

CHILD = r'''
import contextlib, json, os, resource, sys, time
sys.path.insert(0, os.getcwd())
variant = sys.argv[1]
import numba
if variant == "dyn":
    numba.set_parallel_chunksize(4)
from kconvert import engine
if variant == "nommap":
    engine._fix_mmap_threshold = lambda *a, **k: None
import kconvert.cli as cli
busy = []
compute = engine.compute_item
def timed(plan, item, *a, **k):
    t = time.perf_counter()
    result = compute(plan, item, *a, **k)
    if isinstance(item, engine.TransformItem):
        busy.append(time.perf_counter() - t)
    return result
engine.compute_item = timed
t = time.perf_counter()
with contextlib.suppress(SystemExit):
    cli.main(["int4-to-nvfp4", sys.argv[2], sys.argv[3], "--device", "cpu", "--quiet",
              "--overwrite"], standalone_mode=False)
print("RESULT", json.dumps({"variant": variant, "wall_s": round(time.perf_counter() - t, 2),
                            "compute_xform_s": round(sum(busy), 2)}))
'''


def run(variant: str, src: Path, dst: Path, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, variant, str(src), str(dst)], env=env,
                       capture_output=True, text=True)
    got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    return json.loads(got[-1][7:]) if got else {"variant": variant, "err": p.stderr[-800:]}


def main() -> None:
    root = bc.ROOT
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    bc.load_anchor_ns()["make_src"](str(src))
    env = bc.env_with(CUDA_VISIBLE_DEVICES="")
    print("warm-up", run("base", bc.FIXTURE, root / "warm", env), flush=True)
    results = []
    for variant in ("base", "nt14", "nommap", "dyn", "base"):
        bc.rm(root / "kc")
        bc.drop_caches()
        extra = {"NUMBA_NUM_THREADS": "14"} if variant == "nt14" else {}
        results.append(run(variant, src, root / "kc", {**env, **extra}))
        print(json.dumps(results[-1]), flush=True)
    Path(os.environ.get("OUT", root)).joinpath("exp.json").write_text(
        json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
