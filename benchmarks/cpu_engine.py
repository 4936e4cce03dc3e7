"""The CPU path end to end per expert matrix, under engine variants: where the time goes.

    python -m benchmarks cpu_engine --variants base,every1000000,gil --root /tmp/kbench

Builds two shards of full-size INT4 experts (--cpu-sizes, default 8 and 32, as
synthetic.expert_set makes them), then runs one child process per variant. Each child
converts the bundled fixture first (numba loads or compiles its kernels), then both shards
--reps times (default 2) in-process, page cache warm, with `--device cpu`. Per matrix, as the slope
between the two shards (start-up costs cancel): wall, compute thread busy (the engine's
`compute` timing events, kconvert.common.events), the INT4 -> NVFP4 kernel and the amax kernel (the
public kernels of kconvert.formats.nvfp4_cpu, wrapped in the child), process CPU time, minor
page faults, involuntary context switches; and the same kernels alone in that process on a
gate+up item (2 x 2048x7168), for comparison. Variants (set in the child only):
  base          the engine as it is
  every<N>      kconvert.engine.execute.IO_CORE_EVERY = N (every1000000: no core set apart for
                the I/O threads)
  nommap        kconvert.engine.execute.MMAP_THRESHOLD = None: glibc's own sliding mmap
                threshold instead of the engine's 1 MiB
  q<N>          kconvert.engine.execute.RESULT_QUEUE = N results between compute and writer
  gil           the parallel kernels hold the GIL while they run (own numba cache dir)
  nohash        no content hashes: kconvert.io.hashing.TensorHashes.update replaced
                (diagnostic: output not valid)
  nowrite       no pwrite: kconvert.io.shards.ShardWriter.write replaced (diagnostic)
  r<N>          --readers N
  nt<N>         NUMBA_NUM_THREADS=N
  dyn           numba.set_parallel_chunksize(8): dynamic scheduling
Prints one JSON line per variant; writes OUT_DIR/cpu_engine_<device>_<date>_<code>.json.
"""

from __future__ import annotations

import json
import sys

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    REPO,
    Timer,
    arguments,
    comma_ints,
    comma_list,
    log,
    record,
    result_path,
    save,
)
from benchmarks.synthetic import FIXTURE, expert_set

# Runs in this repository (its working directory): numba is patched before kconvert loads.
CHILD = r'''
import contextlib, json, re, resource, statistics, sys, time
variant, root, fixture, sizes, reps = sys.argv[1:6]
small, large = (int(x) for x in sizes.split(","))
import numba
if variant == "gil":
    _njit = numba.njit
    def njit(*a, **k):
        if k.get("parallel"):
            k["nogil"] = False
        return _njit(*a, **k)
    numba.njit = njit
if variant == "dyn":
    numba.set_parallel_chunksize(8)
import torch
from benchmarks.encode import fused
from benchmarks.synthetic import random_int4
from kconvert.common import events
from kconvert.engine import execute
from kconvert.formats import nvfp4_cpu
from kconvert.io import hashing, shards
import kconvert.cli as cli
if variant.startswith("every"):
    execute.IO_CORE_EVERY = int(variant[5:])
if variant == "nommap":
    execute.MMAP_THRESHOLD = None
if re.fullmatch(r"q\d+", variant):
    execute.RESULT_QUEUE = int(variant[1:])
if variant == "nohash":
    hashing.TensorHashes.update = lambda self, name, piece, size: "0"
if variant == "nowrite":
    shards.ShardWriter.write = lambda self, *a, **k: None
readers = variant[1:] if re.fullmatch(r"r\d+", variant) else "4"
busy = {"kernel": 0.0, "amax": 0.0, "compute": 0.0}
def timed(mod, name, key):
    fn = getattr(mod, name)
    def inner(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            busy[key] += time.perf_counter() - t
    setattr(mod, name, inner)
timed(nvfp4_cpu, "quantize_int4_rows", "kernel")
timed(nvfp4_cpu, "int4_row_amax", "amax")
def on_event(event, info):
    if event == "compute":
        busy["compute"] += info["end"] - info["start"]
events.subscribe(on_event, timings=True)
def convert(src, dst):
    for k in busy:
        busy[k] = 0.0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    with contextlib.suppress(SystemExit):
        cli.main(["int4-to-nvfp4", src, dst, "--device", "cpu", "--quiet", "--overwrite",
                  "--readers", readers], standalone_mode=False)
    wall = time.perf_counter() - t
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": wall, **busy, "minflt": ru.ru_minflt - ru0.ru_minflt,
            "nivcsw": ru.ru_nivcsw - ru0.ru_nivcsw,
            "cpu": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime}
convert(fixture, root + "/warm")
runs = {small: [], large: []}
for _ in range(int(reps)):
    for n in (small, large):
        runs[n].append(convert(f"{root}/cpu{n}", f"{root}/cpu{n}_out"))
matrices = 3 * (large - small)
out = {"variant": variant}
for key in ("wall", "compute", "kernel", "amax", "cpu", "minflt", "nivcsw"):
    scale = 1e3 if key in ("wall", "compute", "kernel", "amax", "cpu") else 1
    out[key + ("_ms" if scale > 1 else "") + "_per_matrix"] = [
        round((b[key] - a[key]) / matrices * scale, 2) for a, b in zip(runs[small], runs[large])]
packed, scale = random_int4(2, 2048, 7168, torch.Generator().manual_seed(0), "cpu")
alone = []
for _ in range(6):
    for k in busy:
        busy[k] = 0.0
    t = time.perf_counter()
    fused(packed, scale, "mse")
    alone.append(((time.perf_counter() - t) / 2, busy["kernel"] / 2, busy["amax"] / 2))
out["alone_ms_per_matrix"] = dict(zip(("all", "kernel", "amax"), (
    round(statistics.median(x[i] for x in alone[1:]) * 1e3, 2) for i in range(3))))
print("RESULT", json.dumps(out), flush=True)
'''


def main(argv: list[str]) -> None:
    ap = arguments("cpu_engine", __doc__, root="/tmp/kbench", results=True, deadline_s=540)
    ap.add_argument("--cpu-sizes", type=comma_ints, default=[8, 32],
                    help="experts of the two shards (default: 8,32)")
    ap.add_argument("--variants", type=comma_list, default=["base", "every1000000", "gil"],
                    help="the engine variants above, in order (default: base,every1000000,gil)")
    ap.add_argument("--reps", type=int, default=2,
                    help="conversions of both shards per child (default: %(default)s)")
    a = ap.parse_args(argv)
    root = a.root
    root.mkdir(parents=True, exist_ok=True)
    timer = Timer(deadline_s=a.deadline_s)
    sizes = ",".join(map(str, a.cpu_sizes))
    for n in a.cpu_sizes:
        if not (root / f"cpu{n}" / "config.json").exists():
            expert_set(root / f"cpu{n}", n)
    rec = record("cpu_engine", gpu=False, scratch=root)
    out = result_path(rec, out_dir=a.out_dir)
    results = []
    for variant in a.variants:
        if timer.late():
            log("deadline: skipped", variant)
            continue
        extra = {}
        if variant.startswith("nt"):
            extra["NUMBA_NUM_THREADS"] = variant[2:]
        if variant == "gil":
            extra["NUMBA_CACHE_DIR"] = str(root / "numba_gil")
        c = run_child([sys.executable, "-c", CHILD, variant, root, FIXTURE, sizes, a.reps],
                      env=child_env(CUDA_VISIBLE_DEVICES="", **extra), cwd=REPO)
        r = c.result or {"variant": variant, "err": c.stderr[-1500:]}
        r["process_s"] = round(c.wall_s, 1)
        results.append(r)
        print(json.dumps(r), flush=True)
        save({"record": rec, "sizes": sizes, "results": results}, out)
