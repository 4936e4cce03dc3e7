"""One conversion's pipeline second by second: what each engine thread did and what the disks
moved, for kconvert trees side by side on the full-size synthetic set.

    python -m benchmarks trace old=/tmp/old,cuda new=.,cuda new=.,cuda --root /tmp/kbench \
        --out-dir $OUT

Builds ROOT/src as `ab` does (anchor_convert.make_src) if it is not there, unless --src names
another checkpoint. Each run NAME=TREE,DEVICE is `int4-to-nvfp4 --device DEVICE -v` (and
--options, e.g. a method and its data) from TREE's kconvert in a process of its own,
page cache dropped first, timed from the command's start (its imports of torch and the rest
included: the child imports none of them before; `torch_imported_before` says so) to
os.sync(). The child subscribes to the engine's timing events (kconvert.common.events) and
samples /proc/diskstats every 0.1 s. Per run:
- `phases`: each phase's start and end (s from the command's start): open_source, planning,
  execute;
- `stages`: per event kind, its count, busy seconds (summed over threads) and union seconds;
- `first_transform_s` and `median_transform_s`: the first item that encodes (its kernels'
  first use) against the others;
- `seconds`: one row per second: disk read and write GB/s, then the seconds of that second
  spent in each of STAGES (reads summed over the reader threads).
Writes OUT_DIR/trace_<device>_<date>_<code>.json.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.child_process import child_env, report, run_child
from benchmarks.harness import arguments, drop_page_cache, record, result_path, save, tree_run
from benchmarks.inprocess import intervals_union
from benchmarks.timeline import disk_sectors

# The columns of a `seconds` row after the disk rates: (event, what its thread's name starts
# with), reads summed over the reader threads.
STAGES = (("read", "kconvert-read"), ("compute", "MainThread"), ("wait-read", "MainThread"),
          ("wait-put", "MainThread"), ("write", "kconvert-writer"),
          ("wait-get", "kconvert-writer"), ("fsync", "kconvert-writer"))
SAMPLE_S = 0.1
SECTOR = 512


def covered(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of [a, b) inside `spans`, summed (overlapping spans count twice)."""
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)


def summarise(events: list[tuple[str, dict]], disk: list[tuple[float, int, int]],
              t0: float, end: float) -> dict:
    """The run's phases, stages, first/median encoding item and per-second rows, from its
    timing events and disk samples (time, sectors read, sectors written), times from t0."""
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    phases, transforms = {}, []
    for name, info in events:
        if "start" not in info:
            continue
        span = (info["start"] - t0, info["end"] - t0)
        spans.setdefault((name, info.get("thread", "")), []).append(span)
        if name == "phase":
            phases[info["name"]] = [round(x, 2) for x in span]
        if name == "compute" and info.get("kind") == "transform":
            transforms.append(span[1] - span[0])
    # a pool's threads (kconvert-read_0, _1, ...) as one stage
    by_stage: dict[str, list[tuple[float, float]]] = {}
    for (name, thread), got in sorted(spans.items()):
        by_stage.setdefault(f"{name}@{thread.rstrip('_0123456789')}", []).extend(got)
    stages = {k: {"n": len(v), "busy_s": round(sum(e - s for s, e in v), 2),
                  "union_s": round(intervals_union(v), 2)} for k, v in by_stage.items()}
    rows = []
    for second in range(int(end - t0) + 1):
        a, b = second, second + 1.0
        inside = [d for d in disk if a <= d[0] - t0 <= b]
        rd = wr = 0.0
        if len(inside) > 1:
            dt = inside[-1][0] - inside[0][0]
            rd = (inside[-1][1] - inside[0][1]) * SECTOR / 1e9 / dt
            wr = (inside[-1][2] - inside[0][2]) * SECTOR / 1e9 / dt
        work = [sum(covered(got, a, b) for (name, thread), got in spans.items()
                    if name == event and thread.startswith(prefix))
                for event, prefix in STAGES]
        rows.append([second, round(rd, 2), round(wr, 2), *(round(w, 2) for w in work)])
    return {"phases": phases, "stages": stages,
            "first_transform_s": round(transforms[0], 3) if transforms else None,
            "median_transform_s": (round(statistics.median(transforms[1:]), 3)
                                   if len(transforms) > 1 else None),
            "seconds_cols": ["s", "disk_read_gb_s", "disk_write_gb_s",
                             *(f"{e}@{p}" for e, p in STAGES)],
            "seconds": rows}


def child(argv: list[str]) -> None:
    """In the child: SRC DST DEVICE [OPTION ...]; one conversion (the options added to its
    command), traced; its summary as the RESULT."""
    src, dst, device, *options = argv
    import kconvert.cli as cli
    from kconvert.common import events

    got: list[tuple[str, dict]] = []
    events.subscribe(lambda name, info: got.append((name, dict(info))), timings=True)
    disk: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            disk.append((time.perf_counter(), *disk_sectors()))
            stop.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    torch_before = "torch" in sys.modules  # False: the command's own imports are timed
    t0 = time.perf_counter()
    rc = cli.main(["int4-to-nvfp4", src, dst, "--device", device, "-v", "--overwrite",
                   *options], standalone_mode=False)
    os.sync()
    end = time.perf_counter()
    stop.set()
    sampler.join()
    disk.append((time.perf_counter(), *disk_sectors()))
    report({"rc": rc or 0, "wall": round(end - t0, 2), "torch_imported_before": torch_before,
            **summarise(got, disk, t0, end)})


def main(argv: list[str]) -> None:
    if argv and argv[0] == "_child":
        child(argv[1:])
        return
    # here, not at the top: it imports torch, which the child must import inside its timer
    from benchmarks.synthetic import add_anchor_dims, anchor_set

    ap = arguments("trace", __doc__, root="/tmp/kbench", results=True, page_cache=True)
    ap.add_argument("runs", nargs="+", metavar="NAME=TREE,DEVICE",
                    help="the runs in order, e.g. old=/tmp/old,cuda new=.,cuda")
    ap.add_argument("--src", type=Path, default=None,
                    help="convert this checkpoint (e.g. the set `learned` builds) instead of "
                         "ROOT/src, which is built if missing")
    ap.add_argument("--options", default="",
                    help="more options for every run's command, one string, e.g. "
                         "\"--method gptq --data F --gpu-memory 74GiB\"")
    add_anchor_dims(ap)
    a = ap.parse_args(argv)
    a.root.mkdir(parents=True, exist_ok=True)
    src = a.src or a.root / "src"
    if a.src is None and not (src / "config.json").exists():
        anchor_set(src, a.dims, a.moe_layers)
    options = shlex.split(a.options)
    rec = record("trace", scratch=a.root)
    out = result_path(rec, out_dir=a.out_dir)
    results = []
    for spec in a.runs:
        name, tree, device = tree_run(spec)
        dst = a.root / "kc"
        shutil.rmtree(dst, ignore_errors=True)
        drop_page_cache(a.keep_page_cache)
        c = run_child([sys.executable, "-m", "benchmarks", "trace", "_child", src, dst, device,
                       *options], env=child_env(tree), cwd=tree)
        r = {"run": name, "tree": str(tree), "device": device, "src": str(src),
             "options": options, "process_s": round(c.wall_s, 2),
             **(c.result or {"error": c.stderr[-1500:]})}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("seconds", "stages")}),
              flush=True)
        save({"record": rec, "results": results}, out)
    shutil.rmtree(a.root / "kc", ignore_errors=True)
