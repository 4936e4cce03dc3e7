"""What a conversion process spends outside its in-process run (start-up and exit, phase by
phase, with fresh and with warm kernel caches), and the p48 audit check against a bare read of
the bytes it checks.

    python -m benchmarks overhead [SRC] [--device DEV] [--reps N] [--caches fresh,warm]
                                  [--tree T] [--p48 DIR] [--out F]
    python -m benchmarks overhead --tiny [--out F]   # the bundled checkpoint on the CPU

Start-up and exit: `kconvert int4-to-nvfp4 SRC DST --json` (SRC: the bundled tiny checkpoint
unless given) in its own process, as a user runs it (kconvert.cli.run: its exit included),
timed from inside by benchmarks/process_phases.py, N times per kernel cache:
  fresh  numba's and Triton's caches empty (NUMBA_CACHE_DIR, TRITON_CACHE_DIR: a new folder per
         run) and the page cache dropped where this runs as root (--keep-page-cache keeps it):
         the first run on a fresh machine
  warm   both caches filled by the first in-process run: every later run
Each run's wall (process_s, the launcher's) is split into the main thread's phases, which add
up to it:
  interpreter_exit_s  the interpreter's start and the process's exit (outside the script)
  cli_import_s        the script's first line to kconvert.cli imported
  to_run_s            then to the run's first planning phase: click, the API's imports, SRC
                      opened (the open_source phase)
  plan_s              the run's planning phases (prepare, read_shape_values, build_work_plan)
  startup_s           then to its pipeline: the source's checks (validate_source), DST
                      prepared, the CPU kernels loaded (compiled with a fresh cache)
  execute_s           its pipeline (the `execute` phase: on a GPU, Triton's compiles too)
  finish_s            then to run-finished: config, index, manifest, the output committed
  serve_check_s       then to the end of the serve checks on the output (`audit --serve`'s,
                      kconvert.api's serve_warnings; 0 in a tree without them)
  after_s             then to the end of the exit handlers: the summary, logging's flush
with imports_s (the main thread's imports, each phase's share in `imports_by_phase`, the
packages over 0.05 s in `imports_by_package`), cuda_thread_s (the CUDA start-up thread, which
overlaps the phases), cpu_s (the process's CPU seconds: the figure to compare on a shared
machine) and exit_s (interpreter_exit_s less a bare `python -c pass`).
In-process: the same command twice in one process (`inprocess_s`: the second run's wall, every
import, kernel and device already started). overhead_s = process_s - inprocess_s; the goal:
at most 5 s, on the bundled checkpoint as on a 15.5 GB one.

The p48 check (--p48 DIR, a p48 output, e.g. `kconvert sparsify SRC DIR`): in one process, the
packed NVFP4 bytes of every routed expert's weight (the tensors `kconvert audit` checks for
the pattern) read with 8 threads of preads (read_s; the page cache dropped first where this runs
as root), then kconvert.formats.p48.check_packed over them (check_s, torch's threads). The
audit runs the check beside its reads, so check_s <= read_s keeps it at read speed; the whole
audit against a bare read: `python -m benchmarks audit DIR [--tree T]`.

--tree T measures the same with another kconvert tree (its root, e.g. the tree before a change:
`git archive REV kconvert pipelines manifests | tar -x -C T`), run for run beside this one.
Writes one JSON with its record to F (default: OUT_DIR/overhead_DEVICE_DATE_CODE.json).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    REPO,
    arguments,
    comma_list,
    drop_page_cache,
    log,
    record,
    result_path,
    save,
)

BUNDLED = REPO / "tests" / "fixtures" / "tiny-k2-thinking-int4"
PHASES_SCRIPT = REPO / "benchmarks" / "process_phases.py"
CACHES = ("fresh", "warm")
PHASES = ("interpreter_exit_s", "cli_import_s", "to_run_s", "plan_s", "startup_s", "execute_s",
          "finish_s", "serve_check_s", "after_s")
PACKAGE_FLOOR_S = 0.05  # imports_by_package lists the packages that took longer
# The p48 check against a bare read of the same bytes, in one process.
P48 = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
from benchmarks.child_process import report
from kconvert.formats.p48 import check_packed
from kconvert.io.checkpoint import open_checkpoint
from kconvert.model.names import Role, parse_name
ckpt = open_checkpoint(sys.argv[1])
infos = [i for n, i in ckpt.tensors.items() if n.endswith(".weight_packed")
         and parse_name(n).role is Role.ROUTED_EXPERT]
def read(info):
    out = torch.empty(info.shape, dtype=torch.uint8)
    ckpt.reader_for(info).read_into(info, out)
    return out
t = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    packed = list(pool.map(read, infos))
read_s = time.perf_counter() - t
t = time.perf_counter()
bad = sum(not check_packed(p).ok for p in packed)
check_s = time.perf_counter() - t
n = sum(p.numel() for p in packed)
report({"tensors": len(packed), "bytes": n, "read_s": read_s, "check_s": check_s,
        "bad_tensors": bad, "threads": torch.get_num_threads()})
"""


def kernel_caches(folder: Path) -> dict[str, Path]:
    """The environment that keeps numba's and Triton's compiled kernels in `folder`."""
    return {"NUMBA_CACHE_DIR": folder / "numba", "TRITON_CACHE_DIR": folder / "triton"}


def conversion_args(src: Path, dst: Path, device: str) -> list:
    return ["int4-to-nvfp4", src, dst, "--overwrite", "--json", "--quiet", "--device", device]


def conversion(tree: Path, src: Path, dst: Path, device: str, caches: Path) -> dict:
    """One `kconvert int4-to-nvfp4` process, its wall split as the module docstring says."""
    bare = run_child([sys.executable, "-c", "pass"], env=child_env(tree)).wall_s
    c = run_child([sys.executable, PHASES_SCRIPT, "process", *conversion_args(src, dst, device)],
                  env=child_env(tree, **kernel_caches(caches)), cwd=tree)
    if c.rc != 0 or not c.result:
        raise SystemExit(f"kconvert failed ({c.rc}):\n{c.output[-3000:]}")
    summary = json.loads(next(ln for ln in reversed(c.stdout.splitlines())
                              if ln.startswith("{")))
    return attribute(c.wall_s, bare, c.result, summary["timings"])


def attribute(process_s: float, python_s: float, clock: dict, timings: dict) -> dict:
    """The process's wall by phase (PHASES, which add up to process_s), from the marks and
    events benchmarks/process_phases.py recorded, and its imports by phase and package."""
    phases, seen = clock["phases"], clock["events"]
    marks = [clock["first"], clock["imported"], phases["prepare"][0],
             phases["build_work_plan"][1], phases["execute"][0], phases["execute"][1],
             seen["run-finished"], seen.get("serve-end", seen["run-finished"]), clock["ended"]]
    split = {"interpreter_exit_s": process_s - (clock["ended"] - clock["first"])}
    split |= {name: end - start for name, start, end in zip(PHASES[1:], marks[:-1], marks[1:],
                                                             strict=True)}
    by_phase = dict.fromkeys(PHASES[1:], 0.0)
    by_package: dict[str, float] = {}
    for package, start, seconds in clock["imports"]:
        phase = PHASES[1 + sum(start >= m for m in marks[1:-1])]
        by_phase[phase] += seconds
        by_package[package] = by_package.get(package, 0.0) + seconds
    listed = {k: round(v, 3) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])
              if v >= PACKAGE_FLOOR_S}
    return {"process_s": process_s, **split, "imports_s": sum(by_package.values()),
            "cuda_thread_s": clock["cuda_thread_s"] or 0.0, "cpu_s": clock["cpu_s"],
            "python_s": python_s, "exit_s": split["interpreter_exit_s"] - python_s,
            "run_s": timings["total"], "imports_by_phase": {k: round(v, 3)
                                                            for k, v in by_phase.items()},
            "imports_by_package": listed}


def in_process(tree: Path, src: Path, dst: Path, device: str, caches: Path) -> dict:
    """The command's in-process wall and CPU seconds: its second run in one process."""
    c = run_child([sys.executable, PHASES_SCRIPT, "inprocess",
                   *conversion_args(src, dst, device)],
                  env=child_env(tree, **kernel_caches(caches)), cwd=tree)
    if c.rc != 0 or not c.result:
        raise SystemExit(f"kconvert failed in process ({c.rc}):\n{c.output[-3000:]}")
    return {"inprocess_s": c.result["runs_s"][1], "inprocess_cpu_s": c.result["cpu_s"][1],
            "first_run_s": c.result["runs_s"][0]}


def p48_check(tree: Path, p48: Path, keep_page_cache: bool) -> dict:
    cold = drop_page_cache(keep_page_cache) is None
    c = run_child([sys.executable, "-c", P48, p48], env=child_env(tree), cwd=tree)
    if c.rc != 0:
        raise SystemExit(f"the p48 check failed ({c.rc}):\n{c.output[-3000:]}")
    r = c.result
    return {**r, "cache": "cold" if cold else "hot", "read_gbps": r["bytes"] / r["read_s"] / 1e9,
            "check_gbps": r["bytes"] / r["check_s"] / 1e9,
            "check_over_read": r["check_s"] / r["read_s"]}


def medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]
            if isinstance(runs[0][k], float | int)}


def run_line(label: str, got: dict) -> str:
    """One timed process as a log line: its wall, phase by phase, and its imports."""
    phases = ", ".join(f"{k[:-2].replace('_', ' ')} {got[k]:.2f}" for k in PHASES)
    packages = ", ".join(f"{k} {v:.2f}" for k, v in list(got["imports_by_package"].items())[:6])
    return (f"{label}: process {got['process_s']:.2f} s ({got['cpu_s']:.2f} s CPU) = {phases}; "
            f"imports {got['imports_s']:.2f} ({packages}); CUDA thread "
            f"{got['cuda_thread_s']:.2f}")


def measure(a, trees: dict[str, Path], scratch: Path) -> dict:
    """Every tree's in-process runs, then its timed processes with warm caches, then with fresh
    ones (a.reps each, the trees interleaved so that a busy moment hits them alike; the warm
    runs before any page-cache drop), with their medians and the goal's figure."""
    src = a.src.resolve()
    inproc: dict[str, list[dict]] = {t: [] for t in trees}
    runs: dict[str, dict[str, list[dict]]] = {t: {c: [] for c in a.caches} for t in trees}
    for rep in range(a.reps):  # the first fills each tree's warm caches
        for name, tree in trees.items():
            got = in_process(tree, src, scratch / f"out-{name}", a.device,
                             scratch / f"warm-{name}")
            inproc[name].append(got)
            log(f"{name} in process {rep + 1}: {got['inprocess_s']:.2f} s "
                f"({got['inprocess_cpu_s']:.2f} s CPU; its first run {got['first_run_s']:.2f} s)")
    for cache in sorted(a.caches, key=CACHES.index, reverse=True):  # warm, then fresh
        for rep in range(a.reps):
            for name, tree in trees.items():
                folder = scratch / (f"warm-{name}" if cache == "warm" else
                                    f"fresh-{name}-{rep}")
                dropped = cache == "fresh" and drop_page_cache(a.keep_page_cache) is None
                got = conversion(tree, src, scratch / f"out-{name}", a.device, folder)
                runs[name][cache].append({**got, "page_cache_dropped": dropped})
                log(run_line(f"{name} {cache} {rep + 1}", got))
    out = {}
    for name in trees:
        base = medians(inproc[name])
        out[name] = {"inprocess": {"median": base, "runs": inproc[name]}}
        for cache, got in runs[name].items():
            med = medians(got)
            med["overhead_s"] = round(med["process_s"] - base["inprocess_s"], 3)
            med["overhead_cpu_s"] = round(med["cpu_s"] - base["inprocess_cpu_s"], 3)
            out[name][cache] = {"median": med, "runs": got}
            log(f"{name} {cache}: process {med['process_s']:.2f} s - in process "
                f"{base['inprocess_s']:.2f} s = overhead {med['overhead_s']:.2f} s (goal <= 5; "
                f"CPU {med['overhead_cpu_s']:.2f} s)")
    return out


def main(argv: list[str]) -> None:
    ap = arguments("overhead", __doc__, results=True, page_cache=True)
    ap.add_argument("src", type=Path, nargs="?", default=BUNDLED,
                    help="an INT4 checkpoint (default: the bundled tiny one)")
    ap.add_argument("--p48", type=Path, help="a p48 output: time its check against its read")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--caches", type=comma_list, default=list(CACHES),
                    help="kernel caches to time: fresh, warm or both (default: fresh,warm)")
    ap.add_argument("--tree", type=Path, help="also measure this kconvert tree")
    ap.add_argument("--tiny", action="store_true",
                    help="the bundled checkpoint on the CPU, its p48 made here")
    ap.add_argument("--out", help="the result file (default: its name in --out-dir)")
    ap.add_argument("--root", type=Path,
                    help="where its scratch directory is made (default: the system's temp)")
    a = ap.parse_args(argv)
    if set(a.caches) - set(CACHES):
        ap.error(f"--caches: {sorted(set(a.caches) - set(CACHES))}; give fresh and/or warm")
    scratch = Path(tempfile.mkdtemp(prefix="kbench-overhead-", dir=a.root))
    if a.tiny:
        a.src, a.device = BUNDLED, "cpu"
        if a.p48 is None:
            a.p48 = scratch / "p48"
            made = run_child([sys.executable, "-m", "kconvert.cli", "sparsify", a.src, a.p48,
                              "--device", "cpu", "--quiet"], env=child_env(REPO))
            if made.rc != 0:
                raise SystemExit(made.output[-3000:])
    trees = {"this": REPO, **({"tree": a.tree.resolve()} if a.tree else {})}
    rec = record("overhead", gpu=a.device != "cpu", scratch=scratch)
    res: dict = {"src": str(a.src), "device": a.device, "trees": {k: str(v)
                                                                  for k, v in trees.items()}}
    res["conversion"] = measure(a, trees, scratch)
    if a.p48 is not None:
        res["p48"] = {name: p48_check(tree, a.p48.resolve(), a.keep_page_cache)
                      for name, tree in trees.items()}
        for name, got in res["p48"].items():
            log(f"{name} p48: read {got['read_gbps']:.2f} GB/s ({got['cache']}), check "
                f"{got['check_gbps']:.2f} GB/s: {got['check_over_read']:.2f}x the read")
    print(json.dumps({k: v for k, v in res.items() if k != "conversion"} | {"conversion": {
        t: {c: v["median"] for c, v in got.items()} for t, got in res["conversion"].items()}}))
    save({"record": rec, **res}, result_path(rec, a.out, out_dir=a.out_dir))
