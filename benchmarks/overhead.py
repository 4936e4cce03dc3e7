"""What a conversion process spends outside its pipeline (start-up and exit), and the p48
audit check against a bare read of the bytes it checks.

    python -m benchmarks overhead SRC [--p48 DIR] [--device DEV] [--reps N] [--tree T] [--out F]
    python -m benchmarks overhead --tiny [--out F]   # the bundled checkpoint on the CPU

Start-up and exit: `kconvert int4-to-nvfp4 SRC DST --json` run N times (--reps, default 3),
each in its own process, as a user runs it (the program `kconvert`: its exit included). Per run,
from the process's own clock and its --json timings:
  process_s      the process wall (the launcher's)
  python_s       a bare `python -c pass` (interpreter start and exit), measured beside it
  imports_s      from the script's first line to `kconvert.cli` imported
  cli_s          after that, until the run starts and once it ended (click, the API's imports,
                 the summary), less run_s
  run_s          the conversion (the --json `total`: opening SRC to the manifest written)
  execute_s      its pipeline (the --json `execute` phase); planning and finishing are the rest
                 of run_s
  exit_s         process_s - python_s - (end of the exit handlers - first line): the
                 interpreter's teardown kconvert.cli.exit_now skips, and the OS's
  outside_s      process_s - execute_s: what the issue's "outside its pipeline" counts
The goal: start-up plus exit under 5 s, the same on a larger SRC.

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

from benchmarks.harness import (
    REPO,
    arguments,
    child_env,
    drop_page_cache,
    log,
    record,
    result_path,
    run_child,
    save,
)

BUNDLED = REPO / "tests" / "fixtures" / "tiny-k2-thinking-int4"
# The program as `kconvert` runs it (kconvert.cli.run: exit_now), with the script's clock at
# its first line, once kconvert.cli is imported, and when the exit handlers end (registered
# first, so run last).
PROGRAM = r"""
import time
first = time.monotonic()
import atexit, json, sys
import kconvert.cli
imported = time.monotonic()
atexit.register(lambda: print("RESULT " + json.dumps(
    {"first": first, "imported": imported, "ended": time.monotonic()}), flush=True))
sys.argv = ["kconvert", *sys.argv[1:]]
kconvert.cli.run()
"""
# The p48 check against a bare read of the same bytes, in one process.
P48 = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
from benchmarks.harness import report
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


def conversion(tree: Path, src: Path, dst: Path, device: str) -> dict:
    """One `kconvert int4-to-nvfp4` process: its seconds, split as the module docstring says."""
    bare = run_child([sys.executable, "-c", "pass"], env=child_env(tree)).wall_s
    c = run_child([sys.executable, "-c", PROGRAM, "int4-to-nvfp4", src, dst, "--overwrite",
                   "--json", "--quiet", "--device", device], env=child_env(tree), cwd=tree)
    if c.rc != 0:
        raise SystemExit(f"kconvert failed ({c.rc}):\n{c.output[-3000:]}")
    summary = json.loads(next(ln for ln in reversed(c.stdout.splitlines())
                              if ln.startswith("{")))
    clock, timings = c.result, summary["timings"]
    script_s = clock["ended"] - clock["first"]
    run_s, execute_s = timings["total"], timings.get("execute", 0.0)
    return {"process_s": c.wall_s, "python_s": bare,
            "imports_s": clock["imported"] - clock["first"],
            "cli_s": clock["ended"] - clock["imported"] - run_s, "run_s": run_s,
            "execute_s": execute_s, "run_phases": timings,
            "exit_s": c.wall_s - bare - script_s, "outside_s": c.wall_s - execute_s,
            "startup_exit_s": c.wall_s - run_s}


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


def main(argv: list[str]) -> None:
    ap = arguments("overhead", __doc__, results=True, page_cache=True)
    ap.add_argument("src", type=Path, nargs="?")
    ap.add_argument("--p48", type=Path, help="a p48 output: time its check against its read")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tree", type=Path, help="also measure this kconvert tree")
    ap.add_argument("--tiny", action="store_true",
                    help="the bundled checkpoint on the CPU, its p48 made here")
    ap.add_argument("--out", help="the result file (default: its name in --out-dir)")
    ap.add_argument("--root", type=Path,
                    help="where its scratch directory is made (default: the system's temp)")
    a = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="kbench-overhead-", dir=a.root))
    if a.tiny:
        a.src, a.device = a.src or BUNDLED, "cpu"
        if a.p48 is None:
            a.p48 = scratch / "p48"
            made = run_child([sys.executable, "-m", "kconvert.cli", "sparsify", a.src, a.p48,
                              "--device", "cpu", "--quiet"], env=child_env(REPO))
            if made.rc != 0:
                raise SystemExit(made.output[-3000:])
    if a.src is None:
        ap.error("give SRC (an INT4 checkpoint) or --tiny")
    trees = {"this": REPO, **({"tree": a.tree.resolve()} if a.tree else {})}
    rec = record("overhead", gpu=a.device != "cpu", scratch=scratch)
    res: dict = {"src": str(a.src), "device": a.device, "trees": {k: str(v)
                                                                  for k, v in trees.items()}}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for rep in range(a.reps):  # interleaved, so that a busy moment hits both trees alike
        for name, tree in trees.items():
            got = conversion(tree, a.src.resolve(), scratch / f"out-{name}", a.device)
            runs[name].append(got)
            log(f"{name} run {rep + 1}: process {got['process_s']:.2f} s, start-up+exit "
                f"{got['startup_exit_s']:.2f} s (imports {got['imports_s']:.2f}, exit "
                f"{got['exit_s']:.2f}), run {got['run_s']:.2f} s, execute "
                f"{got['execute_s']:.2f} s")
    res["conversion"] = {name: {"median": medians(r), "runs": r} for name, r in runs.items()}
    if a.p48 is not None:
        res["p48"] = {name: p48_check(tree, a.p48.resolve(), a.keep_page_cache)
                      for name, tree in trees.items()}
        for name, got in res["p48"].items():
            log(f"{name} p48: read {got['read_gbps']:.2f} GB/s ({got['cache']}), check "
                f"{got['check_gbps']:.2f} GB/s: {got['check_over_read']:.2f}x the read")
    print(json.dumps({k: v for k, v in res.items() if k != "conversion"}
                     | {"conversion": {k: v["median"] for k, v in res["conversion"].items()}}))
    save({"record": rec, **res}, result_path(rec, a.out, out_dir=a.out_dir))
