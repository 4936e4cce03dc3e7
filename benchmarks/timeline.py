"""A child process's timeline: its RSS, I/O bytes and CPU seconds, and the disks' bytes, sampled
every 0.25 s, with the GPU's utilisation beside it (a `watch` for child_process.run_child)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from benchmarks.gpu_sampler import GpuSampler

GB = 1e9


def _lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def disk_sectors() -> tuple[int, int]:
    """(sectors read, sectors written) summed over whole disks (/sys/block, no loop/ram)."""
    rd = wr = 0
    with contextlib.suppress(OSError):
        disks = {d for d in os.listdir("/sys/block") if not d.startswith(("loop", "ram", "zram"))}
        for ln in _lines("/proc/diskstats"):
            f = ln.split()
            if f[2] in disks:
                rd, wr = rd + int(f[5]), wr + int(f[9])
    return rd, wr


def process_sample(pid: int) -> tuple[int, int, int, float] | None:
    """(VmRSS kB, read_bytes, write_bytes, cpu seconds) of a live process, or None."""
    try:
        rss = int(next(ln.split()[1] for ln in _lines(f"/proc/{pid}/status")
                       if ln.startswith("VmRSS")))
        io = dict(ln.split(": ") for ln in _lines(f"/proc/{pid}/io"))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        return rss, int(io["read_bytes"]), int(io["write_bytes"]), cpu
    except (OSError, StopIteration, KeyError, ValueError, IndexError):
        return None


class Monitor:
    """Samples a child process and the disks every `period` s; nvidia-smi alongside when
    `gpu`."""

    def __init__(self, pid: int, period: float = 0.25, gpu: bool = True) -> None:
        self.pid, self.period, self.rows = pid, period, []
        self.t0 = time.perf_counter()
        self.d0 = disk_sectors()
        self.stop = threading.Event()
        self.gpu = GpuSampler() if gpu else None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            p = process_sample(self.pid)
            d = disk_sectors()
            if p:
                self.rows.append((round(time.perf_counter() - self.t0, 2), p[0], p[1], p[2],
                                  p[3], d[0] - self.d0[0], d[1] - self.d0[1]))
            self.stop.wait(self.period)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        gpu = self.gpu.finish() if self.gpu is not None else {}
        # Timeline every ~0.5 s: t, rss GB, proc read GB, proc write GB, cpu s, disk rd, disk wr
        tl = [(r[0], round(r[1] * 1024 / GB, 2), round(r[2] / GB, 2), round(r[3] / GB, 2),
               round(r[4], 1), round(r[5] * 512 / GB, 2), round(r[6] * 512 / GB, 2))
              for r in self.rows[::2]]
        out = {"timeline_cols": ["t_s", "rss_gb", "proc_read_gb", "proc_write_gb", "cpu_s",
                                 "disk_read_gb", "disk_write_gb"], "timeline": tl, "gpu": gpu}
        if self.rows:
            last = self.rows[-1]
            out.update(cpu_s=round(last[4], 1), proc_read_gb=round(last[2] / GB, 2),
                       disk_read_gb=round(last[5] * 512 / GB, 2),
                       disk_write_gb=round(last[6] * 512 / GB, 2),
                       rss_sampled_max_gb=round(max(r[1] for r in self.rows) * 1024 / GB, 2))
        return out
