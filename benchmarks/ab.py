"""A/B of kconvert trees on the full-size synthetic set: GPU or CPU, cold, one process each.

    git archive REV kconvert pipelines | tar -x -C /tmp/old      # a tree to compare with
    python -m benchmarks ab old=/tmp/old,cuda new=.,cuda floor new=.,cuda old=/tmp/old,cuda \
        floor --root /tmp/kbench --out-dir $OUT

Builds ROOT/src as `convert full` does (anchor_convert.make_src: 15.5 GB with --dims full,
--moe-layers 1; --dims tiny makes a tiny set, to check the bench in seconds) if it is not there.
Each variant NAME=TREE,DEVICE runs `int4-to-nvfp4` (mse) from the kconvert package in TREE, page
cache dropped first, timed in-process after imports (on the CPU also after numba's cached
kernels are loaded), to os.sync(). Interleave the variants: this disk's speed drifts within a
run. Per run: wall, peak RSS (VmHWM), whether the manifest's tensor hashes equal those of every
earlier run on that device (they must), and, from the engine's timing events
(kconvert.common.events, `timings=True`), the writer's busy time (`write` events), the compute
thread's waits for reads (`compute_wait_read`) and its waits at each copy -> transform item
boundary (from one `compute` event to the next). A
tree whose engine has no timing events (before kconvert.common.events.TIMING_EVENTS, e.g. the tree
before the packages) is timed by wall and peak RSS only: writer_busy and copy_to_xform_waits_s are
null and `events` false.
A variant `floor` (no tree) is the bare concurrent read+write of the same bytes instead
(convert's `_iofloor`: every source byte read while the last output's size, else the source's,
is written), page cache dropped first: the floor a conversion is measured against. Each run
also has `process_s`, its whole process (imports and exit included), and `summary` gives
each name's median wall and process, and the wall over the floors' median.
Writes OUT_DIR/ab_<device>_<date>_<code>.json.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.convert_runs import du
from benchmarks.harness import (
    arguments,
    drop_page_cache,
    kconvert_sha,
    record,
    result_path,
    save,
    tree_run,
)
from benchmarks.synthetic import add_anchor_dims, anchor_set

# Runs with TREE first on its path (its working directory and PYTHONPATH), so kconvert is
# TREE's; benchmarks comes from this repository.
CHILD = r'''
import contextlib, json, os, sys, time
src, dst, tree, device = sys.argv[1:5]
import kconvert
import kconvert.cli as cli
assert kconvert.__file__.startswith(tree), kconvert.__file__
try:
    from kconvert.common import events
    timed = hasattr(events, "TIMING_EVENTS")
except ImportError:
    timed = False
writes, computes, waits = [], [], []
def listen(event, info):
    if event == "wait-read":
        waits.append(info["end"] - info["start"])
    elif event == "write":
        writes.append(info["end"] - info["start"])
    elif event == "compute":
        computes.append((info["kind"] == "copy", info["start"], info["end"]))
if timed:
    events.subscribe(listen, timings=True)
if device == "cpu":
    from benchmarks.inprocess import load_cpu_kernels
    load_cpu_kernels()
t = time.perf_counter()
with contextlib.suppress(SystemExit):
    cli.main(["int4-to-nvfp4", src, dst, "--device", device, "--quiet", "--overwrite"],
             standalone_mode=False)
os.sync()
wall = time.perf_counter() - t
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM")).split()[1]
gaps = [b[1] - a[2] for a, b in zip(computes, computes[1:]) if a[0] and not b[0]]
print("RESULT", json.dumps({
    "wall": round(wall, 2), "writer_busy": round(sum(writes), 2) if timed else None,
    "compute_wait_read": round(sum(waits), 2) if timed else None,
    "vmhwm_gb": round(int(hwm) / 1e6, 2), "events": timed,
    "copy_to_xform_waits_s": [round(g, 3) for g in gaps] if timed else None}))
'''


def main(argv: list[str]) -> None:
    ap = arguments("ab", __doc__, root="/tmp/kbench", results=True, page_cache=True)
    ap.add_argument("variants", nargs="+", metavar="NAME=TREE,DEVICE|floor",
                    help="the runs in order, e.g. old=/tmp/old,cuda new=.,cuda floor")
    add_anchor_dims(ap)
    a = ap.parse_args(argv)
    root = a.root
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "config.json").exists():
        anchor_set(src, a.dims, a.moe_layers)
    rec = record("ab", scratch=root)
    out = result_path(rec, out_dir=a.out_dir)
    results, hash_sets = [], {}
    for spec in a.variants:
        if spec == "floor":
            results.append(floor(src, root, a.keep_page_cache))
            print(json.dumps(results[-1]), flush=True)
            save({"record": rec, "results": results, "summary": summary(results)}, out)
            continue
        name, tree, device = tree_run(spec)
        shutil.rmtree(root / "kc", ignore_errors=True)
        drop_page_cache(a.keep_page_cache)
        env = child_env(tree, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}))
        c = run_child([sys.executable, "-c", CHILD, src, root / "kc", tree, device], env=env,
                      cwd=tree)
        r = {"variant": name, "device": device, "tree": str(tree),
             "kconvert_sha256": kconvert_sha(tree), "process_s": round(c.wall_s, 2),
             **(c.result or {"error": c.stderr[-1500:]})}
        manifest = root / "kc" / "kconvert-manifest.json"
        if manifest.is_file():
            tensors = json.loads(manifest.read_text())["tensors"]
            hashes = json.dumps(sorted((k, v["hash"]) for k, v in tensors.items()))
            r["same_hashes_as_earlier_runs"] = hash_sets.setdefault(device, hashes) == hashes
        results.append(r)
        print(json.dumps(r), flush=True)
        save({"record": rec, "results": results, "summary": summary(results)}, out)


def floor(src: Path, root: Path, keep_page_cache: bool) -> dict:
    """The concurrent read+write floor on the same disk, page cache dropped first."""
    out = root / "kc"
    nbytes = du(out) if out.is_dir() else du(src)
    drop_page_cache(keep_page_cache)
    c = run_child([sys.executable, "-m", "benchmarks", "convert", "_iofloor", str(src),
                   str(root / "floor"), str(nbytes)], env=child_env())
    return {"variant": "floor", "nbytes": nbytes, **(c.result or {"error": c.stderr[-1500:]})}


def summary(results: list[dict]) -> dict:
    """Per name: median wall and process seconds; with floors, the wall over their median."""
    floors = [r["both_s"] for r in results if r["variant"] == "floor" and "both_s" in r]
    out: dict = {"floor_s": round(statistics.median(floors), 2) if floors else None}
    for name in dict.fromkeys(r["variant"] for r in results if r["variant"] != "floor"):
        runs = [r for r in results if r["variant"] == name and "wall" in r]
        if not runs:
            continue
        wall = statistics.median(r["wall"] for r in runs)
        out[name] = {"wall_s": round(wall, 2),
                     "process_s": round(statistics.median(r["process_s"] for r in runs), 2),
                     "over_floor": round(wall / out["floor_s"], 3) if floors else None}
    return out
