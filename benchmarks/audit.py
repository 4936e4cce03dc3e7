"""`kconvert audit` against a bare read of the bytes it must read.

    python -m benchmarks audit DIR [--source SRC] [--device DEV] [--readers N] [--tree T]

DIR is a kconvert output (e.g. the full-size set `python -m benchmarks convert full` writes);
SRC defaults to the source its manifest records. Timed, each in its own process:
  read_s          every *.safetensors file of DIR read once with N threads of 16 MiB preads
  audit_s         `kconvert audit DIR` (run_audit after imports; the process wall beside it)
  read_source_s   the same bare read over DIR and SRC
  audit_source_s  `kconvert audit DIR --source SRC`
Run as root where /proc/sys/vm/drop_caches is writable, the page cache is dropped before
each timed run (`cache: cold`); elsewhere, or with --hot, every file is read once first and
all runs are hot.
--tree times the audit of another kconvert tree (its root, e.g. the tree before a change,
`git archive REV kconvert pipelines | tar -x -C T`), side by side with this one's in one run.
Prints one JSON line with the times and the ratios audit_s / read_s and
audit_source_s / read_source_s (and writes it, with its record, to --out-dir).
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import REPO, arguments, drop_page_cache, record, result_path, save

PIECE = 16 << 20
READ = r"""
import os, sys, time
from concurrent.futures import ThreadPoolExecutor
piece, threads, files = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
jobs = [(f, off) for f in files for off in range(0, os.path.getsize(f), piece)]
def read(job):
    fd = os.open(job[0], os.O_RDONLY)
    try:
        return len(os.pread(fd, piece, job[1]))
    finally:
        os.close(fd)
t = time.perf_counter()
with ThreadPoolExecutor(threads) as pool:
    n = sum(pool.map(read, jobs))
print(time.perf_counter() - t, n)
"""
AUDIT = r"""
import sys, time
from kconvert.audit import run_audit
ckpt, source, device = sys.argv[1], sys.argv[2] or None, sys.argv[3]
t = time.perf_counter()
report = run_audit(ckpt, source, device=device)
print(time.perf_counter() - t, int(report.passed))
"""


def shards(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.safetensors"))


def warm(files: list[str]) -> None:
    def read(path: str) -> None:
        with open(path, "rb") as fh:
            while fh.read(PIECE):
                pass

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(read, files))


def timed(args: list[str], cold: bool, tree: Path = REPO) -> tuple[float, float, str]:
    """(seconds the child reports, process wall seconds, its report); the child imports
    kconvert from `tree`."""
    if cold:
        drop_page_cache()
    c = run_child([sys.executable, "-c", *args], env=child_env(tree), cwd=tree)
    if c.rc:
        raise SystemExit(f"{args[1:]} failed:\n{c.stderr[-3000:]}")
    inner, extra = c.stdout.split()[-2:]
    return float(inner), c.wall_s, extra


def main(argv: list[str]) -> None:
    ap = arguments("audit", __doc__, results=True)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--source", type=Path)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--readers", type=int, default=8, help="threads of the bare read")
    ap.add_argument("--hot", action="store_true", help="never drop the page cache")
    ap.add_argument("--tree", type=Path, help="also time the audit of this kconvert tree")
    a = ap.parse_args(argv)
    a.dir = a.dir.resolve()
    source = a.source
    if source is None:
        manifest = json.loads((a.dir / "kconvert-manifest.json").read_text())
        source = Path(manifest["source"]["path"])
    source = source.resolve()
    out_files, src_files = shards(a.dir), shards(source)
    cold = not a.hot and drop_page_cache() is None
    if not cold:
        warm(out_files + src_files)
    rec = record("audit", gpu=a.device != "cpu")
    res: dict = {"dir": str(a.dir), "source": str(source), "cache": "cold" if cold else "hot",
                 "bytes": sum(os.path.getsize(f) for f in out_files),
                 "source_bytes": sum(os.path.getsize(f) for f in src_files)}
    read = [READ, str(PIECE), str(a.readers)]
    res["read_s"] = timed([*read, *out_files], cold)[0]
    res["audit_s"], res["audit_wall_s"], passed = timed([AUDIT, str(a.dir), "", a.device], cold)
    res["audit_passed"] = passed == "1"
    res["read_source_s"] = timed([*read, *out_files, *src_files], cold)[0]
    res["audit_source_s"], res["audit_source_wall_s"], passed = timed(
        [AUDIT, str(a.dir), str(source), a.device], cold)
    res["audit_source_passed"] = passed == "1"
    if a.tree is not None:
        tree = a.tree.resolve()
        res["tree_audit_s"] = timed([AUDIT, str(a.dir), "", a.device], cold, tree)[0]
        res["tree_audit_source_s"] = timed([AUDIT, str(a.dir), str(source), a.device], cold,
                                           tree)[0]
    res["ratio"] = round(res["audit_s"] / res["read_s"], 3)
    res["ratio_source"] = round(res["audit_source_s"] / res["read_source_s"], 3)
    print(json.dumps(res))
    save({"record": rec, **res}, result_path(rec, out_dir=a.out_dir))
