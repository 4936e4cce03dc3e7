"""The first visible GPU's utilisation and memory, sampled by nvidia-smi while something runs
(a watcher for child_process.run_child, or a with block around in-process work)."""

from __future__ import annotations

import contextlib
import subprocess
import threading

from benchmarks.harness import gpus


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
