"""What every benchmark shares: the record a result carries, its file name, one timer, one
page-cache drop and one child-process runner.

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
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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


# ------------------------------------------------------------------ child processes

# Between a benchmark and the command it runs: the command is this launcher's only child, so
# wait4's peak RSS is the command's own (Linux carries a parent's peak RSS into a child across
# fork and exec: a benchmark that built a 15 GB set in memory would read 15 GB for any child).
# It writes the command's pid and start (time.monotonic: one clock for every process on Linux)
# as soon as it runs, then its exit status, wall seconds and peak RSS, one line each, on the
# descriptor it is given.
LAUNCHER = """\
import json, os, subprocess, sys, time
report = os.fdopen(int(sys.argv[1]), "w", buffering=1)
t0 = time.monotonic()
child = subprocess.Popen(sys.argv[2:])
report.write(f"{child.pid} {t0!r}\\n")
_, status, usage = os.wait4(child.pid, 0)
report.write(json.dumps({"rc": os.waitstatus_to_exitcode(status),
                         "wall_s": time.monotonic() - t0,
                         "maxrss_kib": usage.ru_maxrss}) + "\\n")
"""


class Watcher(Protocol):
    """Samples something while a child runs (its process, the GPU, a directory)."""

    def finish(self) -> dict: ...


@dataclass
class Child:
    """One command run in its own process."""

    cmd: list[str]
    rc: int | None  # None: killed at the timeout
    wall_s: float
    peak_rss_bytes: int | None  # None where the command did not end by itself
    stdout: str
    stderr: str  # empty when merged into stdout
    lines: list[tuple[float, str]]  # stdout's lines (merged: both), seconds from its start
    result: dict = field(default_factory=dict)  # the last `RESULT {json}` line it printed
    watched: dict = field(default_factory=dict)  # what the watcher gathered

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def peak_rss_gb(self) -> float | None:
        return None if self.peak_rss_bytes is None else round(self.peak_rss_bytes / 1e9, 3)

    @property
    def peak_gpu_reserved_bytes(self) -> int | None:
        """The peak the command reported (`report` in the child), where it did."""
        return self.result.get("max_memory_reserved")


def child_env(*trees: Path, **extra: object) -> dict[str, str]:
    """This environment for a child that imports kconvert from the first of `trees` (this
    repository when none is given) and benchmarks from this repository, ahead of any
    PYTHONPATH already set (where carried packages live on the device machine); its output
    unbuffered; `extra` set on top."""
    paths = dict.fromkeys(str(p) for p in (*trees, REPO))
    rest = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, *([rest] if rest else [])]),
           "PYTHONUNBUFFERED": "1"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_child(cmd: Sequence[str | Path], *, env: dict[str, str] | None = None,
              cwd: Path | None = None, timeout: float | None = None, merge: bool = False,
              echo: Callable[[str], None] | None = None,
              watch: Callable[[int], Watcher] | None = None) -> Child:
    """Run `cmd` in its own process (and process group): exit status, wall seconds, peak RSS,
    its output (stdout and stderr apart, or merged in order with `merge`) with each line's
    arrival time, the last `RESULT {json}` line it printed (`report`), and what
    `watch(pid)` gathered while it ran. `echo` gets every other line as it comes. Past
    `timeout` seconds the whole group is killed and rc is None."""
    cmd = [str(c) for c in cmd]
    read_fd, write_fd = os.pipe()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, str(write_fd), *cmd],
                            env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                            pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    streams: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}

    def drain(name: str, pipe: Any) -> None:
        for line in pipe:
            streams[name].append((time.monotonic(), line))
            if echo is not None and not line.startswith("RESULT "):
                echo(line)

    readers = [threading.Thread(target=drain, args=(name, pipe), daemon=True)
               for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)) if pipe]
    for reader in readers:
        reader.start()
    with os.fdopen(read_fd) as launcher:
        started = launcher.readline().split()
        if started:
            t0 = float(started[1])
        watcher = watch(int(started[0])) if watch is not None and started else None
        killed = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = True
        end = launcher.readline()
    wall = time.monotonic() - t0
    for reader in readers:
        reader.join()
    for lines in streams.values():
        lines[:] = [(t - t0, line) for t, line in lines]
    watched = watcher.finish() if watcher is not None else {}
    ended = json.loads(end) if end.strip() else None
    text = {name: "".join(line for _, line in lines) for name, lines in streams.items()}
    results = [ln for _, ln in streams["stdout"] if ln.startswith("RESULT ")]
    if ended is None and not killed:  # the launcher could not start the command
        ended = {"rc": proc.returncode or 127, "wall_s": wall, "maxrss_kib": None}
    return Child(
        cmd=cmd, rc=None if ended is None else ended["rc"],
        wall_s=round(wall if ended is None else ended["wall_s"], 3),
        peak_rss_bytes=None if ended is None or ended["maxrss_kib"] is None
        else ended["maxrss_kib"] * 1024,
        stdout=text["stdout"], stderr=text["stderr"], lines=streams["stdout"],
        result=json.loads(results[-1][len("RESULT "):]) if results else {}, watched=watched)


def report(result: dict) -> None:
    """In a child: print `result` as the `RESULT {json}` line run_child reads, with this
    process's peak RSS (VmHWM, GB) and, where it used CUDA, torch's peak GPU memory (bytes)."""
    out = {**result, "vmhwm_gb": vmhwm_gb()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out.update(max_memory_reserved=torch.cuda.max_memory_reserved(),
                   max_memory_allocated=torch.cuda.max_memory_allocated())
    print("RESULT " + json.dumps(out, default=str), flush=True)


def vmhwm_bytes() -> int:
    """This process's peak RSS since it started (or since `reset_vmhwm`)."""
    kib = next(int(ln.split()[1]) for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM"))
    return kib * 1024


def vmhwm_gb() -> float:
    return round(vmhwm_bytes() / 1e9, 3)


def reset_vmhwm() -> None:
    """Start a new peak RSS for this process (Linux: clear_refs 5 resets VmHWM)."""
    Path("/proc/self/clear_refs").write_text("5")


# ------------------------------------------------------------------ the GPU, sampled


class GpuSampler:
    """nvidia-smi's utilisation and memory.used of the first visible GPU every 200 ms, on a
    thread, from when it is made (or entered) until `finish` (or the end of the with block).
    Without a GPU it samples nothing and its summaries are empty."""

    def __init__(self, _pid: int | None = None) -> None:
        self.samples: list[tuple[float, float]] = []
        found = gpus()
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
             "--format=csv,noheader,nounits", "-lms", "200", "-i", str(found[0]["index"])],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) if found else None
        self._thread = threading.Thread(target=self._read, daemon=True)
        if self._proc is not None:
            self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError):
                util, mem = (float(x) for x in line.split(","))
                self.samples.append((util, mem))

    def finish(self) -> dict:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait()
            self._thread.join()
        return self.detail()

    def __enter__(self) -> GpuSampler:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.finish()

    def summary(self) -> dict:
        """Mean utilisation and the peak memory.used (GiB)."""
        if not self.samples:
            return {}
        util = [u for u, _ in self.samples]
        return {"gpu_util_mean_pct": round(sum(util) / len(util), 1),
                "gpu_mem_used_peak_gib": round(max(m for _, m in self.samples) / 1024, 1)}

    def detail(self) -> dict:
        """Mean and peak utilisation, the share of samples with the GPU busy, the peak
        memory.used (MiB) and every other utilisation sample."""
        if not self.samples:
            return {}
        util = [u for u, _ in self.samples]
        return {"util_mean_pct": round(sum(util) / len(util), 1), "util_max_pct": max(util),
                "busy_frac": round(sum(u > 0 for u in util) / len(util), 3),
                "mem_max_mib": max(m for _, m in self.samples), "samples": len(util),
                "util_series_pct": util[::2]}


def arguments(bench: str, doc: str | None, *, root: str | None = None, results: bool = False,
              page_cache: bool = False, deadline_s: float | None = None
              ) -> argparse.ArgumentParser:
    """The argument parser of `python -m benchmarks BENCH`, its docstring as the description,
    with the options benches share: --root (its scratch directory, default `root`),
    --out-dir (where `results` go unless a file is named), --keep-page-cache (a bench that
    drops the `page_cache`) and --deadline-s (skip later steps after `deadline_s`)."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {bench}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
