"""One command run in its own process and measured: its exit status, wall seconds, peak RSS,
output lines as they came and the RESULT line it reported (`report`, in the child), with a
watcher sampling it meanwhile; and the peak RSS of this process (VmHWM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.harness import REPO

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
