"""The runs `python -m benchmarks convert` is made of: its state (`Run`), one child process
(`python -m benchmarks convert CHILD ...`) timed and watched, a cold kconvert run into a fresh
output, the CPU kernels' warm-up, and the CPU per-matrix comparison of kconvert and the anchor
that the modes `smoke`, `cpu` and `full` share."""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import REPO, Timer, drop_page_cache, log, save
from benchmarks.synthetic import FIXTURE, anchor_stub, expert_set
from benchmarks.timeline import Monitor


@dataclass
class Run:
    mode: str
    root: Path
    timer: Timer
    args: argparse.Namespace
    res: dict = field(default_factory=dict)
    path: Path | None = None

    def save(self) -> None:
        save(self.res, self.path)


def rm(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def echo(line: str) -> None:
    print("    |", line.rstrip()[:300], flush=True)


def child(args: list[str], env: dict | None = None, monitor: bool = True,
          gpu: bool = True) -> dict:
    """`python -m benchmarks convert <child args>`: its RESULT json + walls + timeline."""
    c = run_child([sys.executable, "-m", "benchmarks", "convert", *args],
                  env=env or child_env(), merge=True, echo=echo,
                  watch=(lambda pid: Monitor(pid, gpu=gpu)) if monitor else None)
    res = {"rc": c.rc, "wall_process_s": round(c.wall_s, 2), "peak_rss_gb": c.peak_rss_gb,
           **c.watched, **c.result}
    if c.rc != 0 or not c.result:
        res["error_tail"] = c.output[-3000:]
    return res


def kc_args(src: Path, dst: Path, device: str, bs: str | None, extra=(),
            command: str = "int4-to-nvfp4") -> list[str]:
    a = ["_kc", command, str(src), str(dst), "--device", device, "--quiet",
         "--overwrite", *extra]
    return a + (["--block-scale", bs] if bs else [])


def timed_kc(src: Path, dst: Path, device: str, bs: str | None, keep_cache: bool, env=None,
             extra=(), command: str = "int4-to-nvfp4") -> dict:
    """A cold-cache (unless `keep_cache`) kconvert run into a fresh `dst`."""
    rm(dst)
    cold = drop_page_cache(keep_cache) is None
    r = child(kc_args(src, dst, device, bs, extra, command), env=env, gpu=device != "cpu")
    r["drop_caches_ok"] = cold
    r["out_bytes"] = du(dst) if dst.exists() else None
    return r


def cpu_env() -> dict:
    return child_env(CUDA_VISIBLE_DEVICES="")


def warm_cpu_kernels(run: Run) -> None:
    """Compile (or load) numba's cache of the CPU kernels before any timed CPU run."""
    if "cpu_kernels_warmup" in run.res:
        return
    r = child(kc_args(FIXTURE, run.root / "warm", "cpu", None), monitor=False, env=cpu_env())
    run.res["cpu_kernels_warmup"] = {k: r.get(k) for k in ("rc", "wall_main_s",
                                                           "wall_process_s")}
    log("cpu kernels warm-up (first CPU run: numba compiles and caches)",
        run.res["cpu_kernels_warmup"])
    rm(run.root / "warm")


def cpu_comparison(run: Run) -> dict:
    """CPU per-matrix throughput of both tools, CUDA hidden, on two sets of full-size experts."""
    warm_cpu_kernels(run)
    root = run.root
    anchor_env = child_env(REPO, anchor_stub(), CUDA_VISIBLE_DEVICES="")
    sizes = tuple(run.args.cpu_sizes)
    res: dict = {"sets": {}, "sizes": sizes}
    for n in sizes:
        res["sets"][n] = expert_set(root / f"cpu{n}", n)
    runs: dict = {}
    for n in sizes:
        src = root / f"cpu{n}"
        runs[f"anchor_{n}"] = child(["_anchor", str(src), str(root / f"cpu{n}_anchor"), "1"],
                                    env=anchor_env, gpu=False)
        log(f"anchor cpu n={n}", runs[f"anchor_{n}"].get("wall_main_s"))
        for bs in ("mse", "amax"):
            k = f"kc_{bs}_{n}"
            runs[k] = child(kc_args(src, root / f"cpu{n}_kc_{bs}", "cpu", bs), env=cpu_env(),
                            gpu=False)
            log(f"kconvert cpu {bs} n={n}", runs[k].get("wall_main_s"))
    for r in runs.values():
        r.pop("timeline", None)
    res["runs"] = runs
    m1, m2 = 3 * sizes[0], 3 * sizes[1]
    per = {}
    for tool in ("anchor", "kc_mse", "kc_amax"):
        a, b = runs[f"{tool}_{sizes[0]}"], runs[f"{tool}_{sizes[1]}"]
        if "wall_main_s" in a and "wall_main_s" in b:
            per[tool] = {
                "slope_ms_per_matrix": round((b["wall_main_s"] - a["wall_main_s"]) / (m2 - m1)
                                             * 1e3, 1),
                f"naive_ms_per_matrix_{sizes[1]}": round(b["wall_main_s"] / m2 * 1e3, 1),
                "process_slope_ms_per_matrix": round(
                    (b["wall_process_s"] - a["wall_process_s"]) / (m2 - m1) * 1e3, 1)}
    res["per_matrix"] = per
    # In-process compute alone (no I/O, no start-up).
    res["anchor_compute"] = child(["_anchor_compute", str(root / f"cpu{sizes[0]}"), "2"],
                                  env=anchor_env, monitor=False)
    res["kc_compute"] = child(["_kc_compute", "cpu", "3", "2"], env=cpu_env(), monitor=False)
    if "anchor" in per:
        for bs in ("mse", "amax"):
            if f"kc_{bs}" in per:
                res[f"speedup_{bs}_vs_anchor_slope"] = round(
                    per["anchor"]["slope_ms_per_matrix"]
                    / max(per[f"kc_{bs}"]["slope_ms_per_matrix"], 1e-9), 2)
    return res
