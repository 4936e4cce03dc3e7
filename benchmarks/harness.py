"""What every benchmark shares: the record a result carries, its file name, one timer, one
page-cache drop and the options of its command line. A command run in its own process is
benchmarks.child_process's, the GPU sampled beside it benchmarks.gpu_sampler's.

A result is a JSON object with a `record`: when it ran, its command line, the machine, the
device (the GPUs nvidia-smi lists, or the CPU) and the code measured (git commit and whether
the tree was dirty, and always a content hash of kconvert/, the only one on a machine without
git). Its file is named by bench, device, date and code: `calibrate_H100_2026-11-27_3f2a1c9.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STARTED = time.perf_counter()
# Versions a result records (read from the installed metadata: nothing is imported).
PACKAGES = ("torch", "safetensors", "compressed-tensors", "llmcompressor", "numba",
            "transformers", "triton", "huggingface-hub")
# What `git status` looks at for the dirty flag: the code, not the results written beside it.
CODE_PATHS = ("kconvert", "benchmarks", "pipelines", "manifests", "pyproject.toml",
              ":(exclude)benchmarks/results")
GIB = 1 << 30
OUT_DIR = Path("/tmp/kbench-out")  # where results go unless a bench is given a file


def log(*args: object) -> None:
    """A line stamped with the seconds since this process imported the harness."""
    print(f"[{time.perf_counter() - STARTED:7.1f}s]", *args, flush=True)


# ------------------------------------------------------------------ the record


def record(bench: str, *, gpu: bool = True, tree: Path = REPO,
           scratch: Path | None = None) -> dict:
    """What a result of `bench` records: the date, the command line, the machine (with the
    free space of `scratch`), the device it ran on (the visible GPUs, or the CPU where `gpu`
    is False or none is present) and the code measured (`tree`'s kconvert)."""
    return {"bench": bench, "date": time.strftime("%Y-%m-%d"), "argv": list(sys.orig_argv),
            "machine": machine(scratch), "device": device(gpu), "source": source(tree)}


def machine(scratch: Path | None = None) -> dict:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(),
                            "cpu_affinity": len(os.sched_getaffinity(0)),
                            "python": platform.python_version(), "kernel": platform.release()}
    with contextlib.suppress(OSError, StopIteration):
        info["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in
                                 Path("/proc/cpuinfo").read_text().splitlines()
                                 if ln.startswith("model name"))
        info["mem_total_gb"] = round(int(next(
            ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal"))) * 1024 / 1e9, 1)
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
        usage = os.statvfs(scratch)
        info["disk_free_gb"] = round(usage.f_bavail * usage.f_frsize / 1e9, 1)
        info["disk_total_gb"] = round(usage.f_blocks * usage.f_frsize / 1e9, 1)
    info["packages"] = {name: _version(name) for name in PACKAGES}
    return info


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> list[dict]:
    """The GPUs nvidia-smi lists that CUDA_VISIBLE_DEVICES leaves visible (by index; none
    where it is empty or nvidia-smi is missing). CUDA is not started in this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.stdout.strip().splitlines() if out.returncode == 0 else []:
        index, name, memory, driver = (x.strip() for x in line.split(","))
        found.append({"index": int(index), "name": name, "memory_mib": int(memory),
                      "driver": driver})
    if visible is not None and all(x.strip().isdigit() for x in visible.split(",")):
        order = [int(x) for x in visible.split(",")]
        found = [g for i in order for g in found if g["index"] == i]
    return found


def device(gpu: bool = True) -> dict:
    """{"kind": "cuda", "name", "count", "gpus"} for the visible GPUs, else {"kind": "cpu"}."""
    found = gpus() if gpu else []
    if not found:
        return {"kind": "cpu", "name": "cpu", "count": 0}
    return {"kind": "cuda", "name": found[0]["name"], "count": len(found), "gpus": found}


def kconvert_sha(tree: Path = REPO) -> str:
    """sha256 over `tree`/kconvert/**/*.py (paths and bytes, sorted), first 16 hex digits:
    what earlier results call kconvert_sources_sha256."""
    digest = hashlib.sha256()
    package = tree / "kconvert"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def tree_run(spec: str) -> tuple[str, Path, str]:
    """(name, tree, device) of a run given as NAME=TREE,DEVICE (`ab`, `trace`)."""
    name, rest = spec.split("=", 1)
    tree, device = rest.rsplit(",", 1)
    return name, Path(tree).resolve(), device


def source(tree: Path = REPO) -> dict:
    """Which code: `tree`'s git commit and whether its code differs from it (where git
    knows the tree), and always the content hash of its kconvert/."""
    out: dict[str, Any] = {"tree": str(tree), "kconvert_sha256": kconvert_sha(tree)}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                              text=True, timeout=30)
        status = subprocess.run(["git", "status", "--porcelain", "--", *CODE_PATHS], cwd=tree,
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return out
    if head.returncode == 0 and status.returncode == 0:
        out.update(git_commit=head.stdout.strip(), git_dirty=bool(status.stdout.strip()))
    return out


def device_tag(dev: dict) -> str:
    """H100, H200x2, cpu: the GPU's model (its first word with a digit) and the count."""
    if dev["kind"] == "cpu":
        return "cpu"
    words = [w for w in re.split(r"[^A-Za-z0-9]+", dev["name"]) if w and w != "NVIDIA"]
    model = next((w for w in words if re.search(r"\d", w)), words[0] if words else "gpu")
    return model + (f"x{dev['count']}" if dev["count"] > 1 else "")


def code_tag(src: dict) -> str:
    """The commit's first 7 hex digits (-dirty when the code differs from it), else src and
    the content hash's first 8."""
    if "git_commit" in src:
        return src["git_commit"][:7] + ("-dirty" if src["git_dirty"] else "")
    return "src" + src["kconvert_sha256"][:8]


def result_name(rec: dict, label: str | None = None) -> str:
    """BENCH_DEVICE_DATE_CODE[_LABEL].json"""
    parts = [rec["bench"], device_tag(rec["device"]), rec["date"], code_tag(rec["source"])]
    return "_".join([*parts, *([label] if label else [])]) + ".json"


def result_path(rec: dict, given: str | Path | None = None, label: str | None = None,
                out_dir: Path = OUT_DIR) -> Path:
    """`given` when the command line names a file, else out_dir / result_name(rec, label)."""
    return Path(given) if given else out_dir / result_name(rec, label)


def save(result: dict, path: Path) -> Path:
    """Write `result` as JSON, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------ the timer


def sync(dev: Any = None) -> None:
    """Wait for `dev`'s queued work where it is a CUDA device (a name or torch.device)."""
    if dev is not None and str(dev).startswith("cuda"):
        import torch

        torch.cuda.synchronize(dev)


def now(dev: Any = None) -> float:
    """perf_counter() once `dev`'s queued work is done."""
    sync(dev)
    return time.perf_counter()


class Timer:
    """Seconds since it was made, and of named spans summed per name. Given a CUDA device it
    synchronises that device at each span's ends, so a span holds the GPU work it launched.
    With `deadline_s`, `late()` says when optional work should be skipped."""

    def __init__(self, dev: Any = None, deadline_s: float | None = None) -> None:
        self.dev, self.deadline_s = dev, deadline_s
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return float("inf") if self.deadline_s is None else self.deadline_s - self.elapsed()

    def late(self, need_s: float = 0.0) -> bool:
        """True when less than `need_s` seconds are left before the deadline."""
        return self.left() < need_s

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        sync(self.dev)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.dev)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def __call__(self, name: str, fn: Callable, *args: Any, **kw: Any) -> Any:
        """fn(*args, **kw) timed as span `name`; its result."""
        with self.span(name):
            return fn(*args, **kw)

    def each(self, n: int, fn: Callable, *args: Any, **kw: Any) -> tuple[list[float], Any]:
        """The seconds of each of `n` synchronised calls, and the last call's result."""
        times, out = [], None
        for _ in range(n):
            sync(self.dev)
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            sync(self.dev)
            times.append(time.perf_counter() - t0)
        return times, out

    def rounded(self, digits: int = 2) -> dict[str, float]:
        return {k: round(v, digits) for k, v in self.seconds.items()}


# ------------------------------------------------------------------ the page cache


def drop_page_cache(keep: bool = False) -> str | None:
    """Write dirty pages out and empty the page cache (root only): None when done, else why
    not. `keep` (--keep-page-cache) keeps the cache (a check on a shared machine, where
    dropping it slows everyone)."""
    if keep:
        return "--keep-page-cache"
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------ the command line


def arguments(bench: str, doc: str | None, *, root: str | None = None, results: bool = False,
              page_cache: bool = False, deadline_s: float | None = None
              ) -> argparse.ArgumentParser:
    """The argument parser of `python -m benchmarks BENCH`, its docstring as the description,
    with the options benches share: --root (its scratch directory, default `root`),
    --out-dir (where `results` go unless a file is named), --keep-page-cache (a bench that
    drops the `page_cache`) and --deadline-s (skip later steps after `deadline_s`)."""
    # no abbreviations: `--out` would be taken for --out-dir and a file name for a folder
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {bench}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    if root is not None:
        ap.add_argument("--root", type=Path, default=Path(root),
                        help="scratch directory: synthetic sets, data, outputs "
                             "(default: %(default)s)")
    if results:
        ap.add_argument("--out-dir", type=Path, default=OUT_DIR,
                        help="where the result is written unless a file is named "
                             "(default: %(default)s)")
    if page_cache:
        ap.add_argument("--keep-page-cache", action="store_true",
                        help="never drop the page cache (a check on a shared machine, where "
                             "dropping it slows everyone)")
    if deadline_s is not None:
        ap.add_argument("--deadline-s", type=float, default=deadline_s,
                        help="skip later steps after this many seconds (default: %(default)s)")
    return ap


def parse(ap: argparse.ArgumentParser, argv: Sequence[str],
          tiny: dict[str, Any] | None = None) -> argparse.Namespace:
    """`argv` parsed by `ap`; with --tiny, the defaults `tiny` names are replaced by its values
    (a CPU check in seconds), and an option given on the command line still wins."""
    args = ap.parse_args(argv)
    if tiny and getattr(args, "tiny", False):
        ap.set_defaults(**tiny)
        args = ap.parse_args(argv)
    return args


def comma_list(text: str) -> list[str]:
    """An argparse type: `a,b,c` as ["a", "b", "c"]."""
    return [x for x in text.split(",") if x]


def comma_ints(text: str) -> list[int]:
    """An argparse type: `8,64` as [8, 64]."""
    return [int(x) for x in comma_list(text)]
