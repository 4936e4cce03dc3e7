"""Planning a full-size conversion: `kconvert int4-to-nvfp4 --dry-run -v` of a header-only
Kimi-K2-Thinking (the 594 GB layout, 208,215 tensors, kconvert.testing.header_only) from an
old tree and this one, interleaved, each run in its own process. Recorded per run: the exit
status, the wall seconds, the peak RSS and the `-v` phases (open_source, read_shape_values,
build_work_plan, validate_source): what every conversion of a Kimi spends before its first
read. Planning is host work with no GPU in it, so any machine compares two trees; the record
names the machine.

    git archive REV kconvert pipelines | tar -x -C .bench/old
    python -m benchmarks plan --old .bench/old --reps 3 --out-dir benchmarks/results
CPU check (the fixtures' dims, seconds):
    python -m benchmarks plan --old . --tiny --reps 1 --out-dir /tmp/kplan
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import arguments, record, result_path, save, source
from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.header_only import KIMI_K2_THINKING, write_header_only

PHASE = re.compile(r"INFO: (\w+) took ([0-9.]+) s")


def phases(output: str) -> dict[str, float]:
    """The `-v` "NAME took S s" lines of one run, by name."""
    return {m[1]: float(m[2]) for m in PHASE.finditer(output)}


def main(argv: list[str]) -> None:
    ap = arguments("plan", __doc__, root="/tmp/kbench-plan", results=True)
    ap.add_argument("out", nargs="?", help="the result file (default: in --out-dir)")
    ap.add_argument("--old", required=True, metavar="TREE", help="the tree compared with")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the fixtures' dims")
    a = ap.parse_args(argv)
    dims = FixtureDims() if a.tiny else KIMI_K2_THINKING
    src = write_header_only(a.root / ("tiny" if a.tiny else "kimi-k2-thinking"), dims,
                            shape_values=True)
    trees = {"old": Path(a.old).resolve(), "new": Path(__file__).resolve().parent.parent}
    rec = record("plan", gpu=False)
    result = {"record": rec, "checkpoint": str(src), "runs": [],
              "trees": {k: source(v) for k, v in trees.items()}}
    path = result_path(rec, a.out, out_dir=a.out_dir)
    for rep in range(a.reps):
        for name, tree in trees.items():
            c = run_child([sys.executable, "-m", "kconvert", "int4-to-nvfp4", src,
                           a.root / "out", "--dry-run", "-v"], env=child_env(tree), cwd=tree,
                          merge=True, timeout=600)
            run = {"run": name, "rep": rep, "rc": c.rc, "wall_s": round(c.wall_s, 2),
                   "peak_rss_gb": c.peak_rss_gb, "phases_s": phases(c.stdout),
                   "last_lines": c.stdout.splitlines()[-2:]}
            result["runs"].append(run)
            save(result, path)
            print(run, flush=True)
            if c.rc != 0:  # a run that failed early would look fast
                raise SystemExit(f"{name} failed ({c.rc}):\n{c.output[-3000:]}")
    walls = {n: statistics.median(r["wall_s"] for r in result["runs"] if r["run"] == n)
             for n in trees}
    result["summary"] = {"median_wall_s": walls,
                         "new_over_old": round(walls["new"] / walls["old"], 3)}
    print(result["summary"])
    save(result, path)
