"""kconvert's command line run inside a benchmark's child process, timed by the engine's own
timing events (kconvert.common.events, `timings=True`; kconvert is not modified)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable

from benchmarks.child_process import report
from benchmarks.harness import Timer

# Stage keys of a kconvert child's result, from the engine's timing events (kconvert.common.events).
STAGE_KEYS = {"read": "read_{kind}", "compute": "compute_{kind}", "hash": "hash_item",
              "write": "writer_item", "pwrite": "pwrite", "fsync": "fsync",
              "wait-read": "main_wait_read", "wait-put": "main_wait_put",
              "wait-get": "writer_wait_get", "wait-hash": "writer_wait_hash",
              "phase": "phase_{name}"}


def load_cpu_kernels() -> None:
    """Load the CPU kernels from numba's cache (0.6-1.2 s, varying run to run) before a timed
    CPU run, as the anchor's imports come before its timer: that start-up cost, left in, made
    the per-matrix slope between two runs swing by +-4 ms. A child's process wall still holds
    it. Works with trees before kconvert's packages (kconvert.nvfp4) too, for `ab`."""
    import torch

    try:
        from kconvert.formats import nvfp4
    except ImportError:
        from kconvert import nvfp4
    nvfp4.warm_cpu_kernels()  # as a run loads them (the mse rule), then the amax rule
    packed = torch.zeros(1, 1, 4, dtype=torch.int32)
    scale = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    nvfp4.quantize_int4(packed, scale, nvfp4.int4_amax(packed, scale), "amax")


def run_cli(argv: list[str], listen: Callable[[str, dict], None] | None = None
            ) -> tuple[int, float, float]:
    """`kconvert ARGV` in this process (a CPU run after loading the CPU kernels), `listen`
    subscribed to every event, timing events included, while it runs: (exit status, the
    perf_counter at its start, its wall seconds)."""
    import kconvert.cli as cli
    from kconvert.common import events

    if "--device" in argv and argv[argv.index("--device") + 1] == "cpu":
        load_cpu_kernels()
    unsubscribe = events.subscribe(listen, timings=True) if listen is not None else None
    timer = Timer()
    rc = 0
    try:
        cli.main(argv, standalone_mode=False)
    except SystemExit as exc:
        rc = exc.code or 0
    finally:
        wall = timer.elapsed()
        if unsubscribe is not None:
            unsubscribe()
    return rc, timer.start, wall


def stage_key(event: str, info: dict) -> str | None:
    """The result key of a timing event: read_copy, read_xform, writer_item, phase_execute..."""
    key = STAGE_KEYS.get(event)
    if key is None:
        return None
    kind = {"transform": "xform"}.get(info.get("kind"), info.get("kind"))
    return key.format(kind=kind, name=info.get("name"))


def intervals_union(iv: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the intervals `iv` (start, end)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(iv):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def timed_kconvert(argv: list[str]) -> None:
    """Child `_kc`: the kconvert CLI with every engine stage timed by its timing events, to
    os.sync(); compressed-tensors imported before the timer, as the anchor's imports are
    (kconvert imports it only when it writes the output's config, at the end of a run)."""
    from kconvert.common import events

    ev: list[tuple[str, float, float]] = []
    marks: dict[str, float] = {}  # run event -> when it came (last one of each name)

    def listen(event: str, info: dict) -> None:
        if event in events.TIMING_EVENTS:
            key = stage_key(event, info)
            if key is not None:
                ev.append((key, info["start"], info["end"]))
        else:
            marks[event] = time.perf_counter()

    import compressed_tensors.quantization  # noqa: F401

    rc, t0, _ = run_cli(argv, listen)
    os.sync()
    wall = time.perf_counter() - t0
    ev.extend(run_phases(ev, marks, t0))
    stages: dict[str, dict] = {}
    for lab in sorted({e[0] for e in ev}):
        iv = [(a - t0, b - t0) for x, a, b in ev if x == lab]
        stages[lab] = {"n": len(iv), "busy_s": round(sum(b - a for a, b in iv), 3),
                       "union_s": round(intervals_union(iv), 3),
                       "first_s": round(min(a for a, _ in iv), 3),
                       "first_dur_s": round(min(iv)[1] - min(iv)[0], 3),
                       "last_s": round(max(b for _, b in iv), 3)}
    report({"wall_main_s": round(wall, 2), "rc_main": rc, "stages": stages,
            "maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)})


def run_phases(ev: list[tuple[str, float, float]], marks: dict[str, float], t0: float
               ) -> list[tuple[str, float, float]]:
    """The run's phases outside the engine, from when its run events came: phase_until_plan
    (t0 to the work plan: CLI, opening the source, output checks, device),
    phase__finish (end of execute to manifest-written: non-weight files, index, config,
    manifest) and phase_write_manifest (the step before manifest-staged to manifest-written:
    the manifest built, written, fsynced, renamed)."""
    spans = {key: (a, b) for key, a, b in ev if key.startswith("phase_")}
    out = []
    if "phase_build_work_plan" in spans:
        out.append(("phase_until_plan", t0, spans["phase_build_work_plan"][0]))
    done = marks.get("manifest-written")
    if done is not None and "phase_execute" in spans:
        out.append(("phase__finish", spans["phase_execute"][1], done))
    if done is not None and "manifest-staged" in marks:
        before = max((t for e, t in marks.items() if t < marks["manifest-staged"]),
                     default=spans.get("phase_execute", (0.0, t0))[1])
        out.append(("phase_write_manifest", before, done))
    return out
