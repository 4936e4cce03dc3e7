"""kconvert int4-to-nvfp4 (and int4-to-mxfp4) against llm-compressor's model_free_ptq (the
anchor) and the I/O floor.

    python scripts/bench_convert.py smoke   # correctness + CPU per-matrix comparison (short)
    python scripts/bench_convert.py full    # the acceptance benchmark on the full-size set
    python scripts/bench_convert.py cpu     # only the CPU per-matrix comparison

On the device machine (wheels of compressed-tensors, llmcompressor, loguru, pydantic* in .whl/,
anchor_convert.py + stub/ copied to .bench/):
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
    ROOT=/tmp/kbench python3 scripts/bench_convert.py full 2>&1 | tee $OUT/log_full.txt

`full` runs `anchor_convert.py` (shared/bench; it builds ROOT/src, a full-size synthetic
Kimi-K2-Thinking shard set, and times the anchor, the cold read floor and the write floor),
then, in the same run and on the same disk, a concurrent read+write floor and kconvert
(`--device cuda` with `--block-scale mse` and `amax`, then `int4-to-mxfp4 --device cuda` (AMD
Quark's layout) with its default `amax` and with `mse` unless MXFP4=0, then `--device cpu` mse
on the same set),
each in its own process with the page cache dropped first, and last the CPU per-matrix
comparison of `smoke` step 3 (the CUDA runs are left out on a machine without a GPU). Every
kconvert run is timed in-process (after imports, like the anchor; on the CPU also after
numba's cached kernels are loaded) and as a whole process, with its peak RSS, a timeline
(RSS, disk bytes, CPU, GPU utilisation) and, under `stages`, each engine stage's count, busy
and union seconds, first start and duration, last end, from the engine's timing events
(kconvert.events, subscribed in the child; kconvert is not modified): read_copy / read_xform
(reader threads), compute_copy / compute_xform, main_wait_read (compute waiting for a read),
main_wait_put (compute waiting on the full result queue), hash_item (hasher thread),
writer_item (writer busy), writer_wait_get (writer idle), writer_wait_hash, pwrite, fsync,
and the phases phase_read_shape_values, phase_build_work_plan, phase_execute, plus, from when
the run events came, phase_until_plan, phase__finish and phase_write_manifest (`run_phases`).
DIMS=tiny makes `full` build and convert a tiny set (MOE_LAYERS=1: seconds), a check of the
script and of the event plumbing rather than a benchmark.

`smoke` converts the bundled fixture on CPU and CUDA (int4-to-nvfp4, and int4-to-mxfp4 with
the routers) and compares every output byte, does the
same on a shard of full-size experts, times kconvert's compute per expert matrix on the GPU
and the CPU in-process, times a DIMS=tiny anchor set, and measures CPU throughput per expert
matrix of both tools (CUDA hidden), end to end on shards of 8 and 64 full-size INT4 experts
(per matrix = the slope between the two, which removes start-up costs) and in-process.

Earlier rounds emulated engine changes in this script before they landed (modes `tune` and
`tune2` at commit 55ee068 and before; their results are in scripts/results/README.md).
Peak RSS of a child is its VmHWM: ru_maxrss is not used for that, because Linux carries the
parent's RSS into a child across fork+exec (a parent that built the 15 GB set reads 20 GB).

Env: ROOT (scratch, default /tmp/kbench), OUT (result folder, default ROOT/out),
ANCHOR_SCRIPT (default .bench/anchor_convert.py, else ../shared/bench/anchor_convert.py),
DEADLINE_S (skip optional steps after this many seconds; default 540), CPU_SIZES (expert
counts of the two CPU shards, default 8,64).

The fused CPU kernels are compiled by numba on first use and cached next to the module (11.5 s
on the H200 machine, once per install); before any timed CPU run, `warm_cpu_kernels` converts
the bundled fixture on the CPU once and records that first run's time, so no timing includes
the compile.
Results: OUT/bench_<mode>.json (everything, plus ratios) and the anchor's anchor.json.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
OUT = Path(os.environ.get("OUT") or ROOT / "out")
DEADLINE_S = float(os.environ.get("DEADLINE_S", "540"))
T_START = time.perf_counter()
FIXTURE = REPO / "tests" / "fixtures" / "tiny-k2-thinking-int4"
H, I_MOE = 7168, 2048  # Kimi-K2 hidden size and expert intermediate size
RES: dict = {}


def anchor_script() -> Path:
    env = os.environ.get("ANCHOR_SCRIPT")
    for cand in (env, REPO / ".bench" / "anchor_convert.py",
                 REPO.parent / "shared" / "bench" / "anchor_convert.py"):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise SystemExit("anchor_convert.py not found: set ANCHOR_SCRIPT or copy it to .bench/")


def log(*a) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s]", *a, flush=True)


def save(mode: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = OUT / f".bench_{mode}.json.tmp"
    tmp.write_text(json.dumps(RES, indent=1, default=str))
    os.replace(tmp, OUT / f"bench_{mode}.json")


def late() -> bool:
    return time.perf_counter() - T_START > DEADLINE_S


def env_with(**kw) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in kw.items()})
    return env


def drop_caches() -> bool:
    return subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True,
                          capture_output=True).returncode == 0


def rm(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ------------------------------------------------------------------ machine

def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "kernel": platform.release()}
    try:
        info["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in _lines("/proc/cpuinfo")
                                 if ln.startswith("model name"))
        info["mem_total_gb"] = round(int(next(
            ln.split()[1] for ln in _lines("/proc/meminfo") if ln.startswith("MemTotal"))) / 1e6, 1)
    except (OSError, StopIteration):
        pass
    info["gpu"] = None
    if shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True)
        info["gpu"] = p.stdout.strip() if p.returncode == 0 else None
    ROOT.mkdir(parents=True, exist_ok=True)
    st = shutil.disk_usage(ROOT)
    info["disk_free_gb"], info["disk_total_gb"] = round(st.free / 1e9, 1), round(st.total / 1e9, 1)
    p = subprocess.run([sys.executable, "-c", "import torch, safetensors; print(torch.__version__,"
                        " torch.version.cuda, safetensors.__version__)"],
                       capture_output=True, text=True, env=env_with())
    info["torch_cuda_safetensors"] = p.stdout.strip()
    info["kconvert_sources_sha256"] = sources_sha()
    for mod in ("compressed_tensors", "llmcompressor", "numba"):
        p = subprocess.run([sys.executable, "-c", f"import importlib.metadata as m; "
                            f"print(m.version('{mod.replace('_', '-')}'))"],
                           capture_output=True, text=True, env=env_with())
        info[mod] = p.stdout.strip() or p.stderr.strip()[-200:]
    return info


def sources_sha() -> str:
    """Which kconvert was measured: sha256 over kconvert/**/*.py (paths and bytes, sorted)."""
    import hashlib

    h = hashlib.sha256()
    pkg = REPO / "kconvert"
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def gpu_name() -> str:
    g = RES.get("machine", {}).get("gpu") or "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", g.split(",")[0]).strip("-")


# ------------------------------------------------------------------ monitoring

def _lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def vmhwm_gb() -> float:
    """This process's peak RSS (VmHWM). Unlike ru_maxrss it does not inherit the RSS the
    parent had when it forked this process (Linux carries that across fork+exec)."""
    kb = next(int(ln.split()[1]) for ln in _lines("/proc/self/status")
              if ln.startswith("VmHWM"))
    return round(kb * 1024 / 1e9, 3)

def _disk_sectors() -> tuple[int, int]:
    """(sectors read, sectors written) summed over whole disks (/sys/block, no loop/ram)."""
    rd = wr = 0
    try:
        disks = {d for d in os.listdir("/sys/block") if not d.startswith(("loop", "ram", "zram"))}
        for ln in _lines("/proc/diskstats"):
            f = ln.split()
            if f[2] in disks:
                rd, wr = rd + int(f[5]), wr + int(f[9])
    except OSError:
        pass
    return rd, wr


def _proc(pid: int) -> tuple[int, int, int, float] | None:
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
    """Samples a child process and the disks every `period` s; nvidia-smi alongside."""

    def __init__(self, pid: int, period: float = 0.25, gpu: bool = True):
        self.pid, self.period, self.rows = pid, period, []
        self.t0 = time.perf_counter()
        self.d0 = _disk_sectors()
        self.stop = threading.Event()
        self.smi = None
        self.smi_file = ROOT / f"smi_{pid}.csv"
        if gpu and shutil.which("nvidia-smi"):
            self.smi_fh = self.smi_file.open("w")
            self.smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=self.smi_fh, stderr=subprocess.DEVNULL)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            p = _proc(self.pid)
            d = _disk_sectors()
            if p:
                self.rows.append((round(time.perf_counter() - self.t0, 2), p[0], p[1], p[2],
                                  p[3], d[0] - self.d0[0], d[1] - self.d0[1]))
            self.stop.wait(self.period)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        gpu = {}
        if self.smi is not None:
            self.smi.terminate()
            self.smi.wait()
            self.smi_fh.close()
            util, mem = [], []
            for ln in self.smi_file.read_text().splitlines():
                try:
                    u, m = (float(x) for x in ln.split(","))
                    util.append(u)
                    mem.append(m)
                except ValueError:
                    continue
            self.smi_file.unlink(missing_ok=True)
            if util:
                gpu = {"util_mean_pct": round(statistics.mean(util), 1), "util_max_pct": max(util),
                       "busy_frac": round(sum(u > 0 for u in util) / len(util), 3),
                       "mem_max_mib": max(mem), "samples": len(util),
                       "util_series_pct": util[::2]}
        gb = 1e9
        # Timeline every ~0.5 s: t, rss GB, proc read GB, proc write GB, cpu s, disk rd, disk wr
        tl = [(r[0], round(r[1] * 1024 / gb, 2), round(r[2] / gb, 2), round(r[3] / gb, 2),
               round(r[4], 1), round(r[5] * 512 / gb, 2), round(r[6] * 512 / gb, 2))
              for r in self.rows[::2]]
        out = {"timeline_cols": ["t_s", "rss_gb", "proc_read_gb", "proc_write_gb", "cpu_s",
                                 "disk_read_gb", "disk_write_gb"], "timeline": tl, "gpu": gpu}
        if self.rows:
            last = self.rows[-1]
            out.update(cpu_s=round(last[4], 1), proc_read_gb=round(last[2] / gb, 2),
                       disk_read_gb=round(last[5] * 512 / gb, 2),
                       disk_write_gb=round(last[6] * 512 / gb, 2),
                       rss_sampled_max_gb=round(max(r[1] for r in self.rows) * 1024 / gb, 2))
        return out


def run_child(args: list[str], env: dict | None = None, monitor: bool = True,
              gpu: bool = True, timeout: float = 600) -> dict:
    """`python scripts/bench_convert.py <child args>`: its RESULT json + wall + timeline."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env or env_with())
    mon = Monitor(p.pid, gpu=gpu) if monitor else None
    lines = []
    for ln in p.stdout:
        lines.append(ln)
        if not ln.startswith("RESULT "):
            print("    |", ln.rstrip()[:300], flush=True)
    rc = p.wait(timeout=timeout)
    wall = time.perf_counter() - t0
    res = {"rc": rc, "wall_process_s": round(wall, 2)}
    res.update(mon.finish() if mon else {})
    got = [ln for ln in lines if ln.startswith("RESULT ")]
    if got:
        res.update(json.loads(got[-1][len("RESULT "):]))
    if rc != 0 or not got:
        res["error_tail"] = "".join(lines)[-3000:]
    return res


# ------------------------------------------------------------------ children

def _intervals_union(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(iv):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# Stage keys of a kconvert child's result, from the engine's timing events (kconvert.events).
STAGE_KEYS = {"read": "read_{kind}", "compute": "compute_{kind}", "hash": "hash_item",
              "write": "writer_item", "pwrite": "pwrite", "fsync": "fsync",
              "wait-read": "main_wait_read", "wait-put": "main_wait_put",
              "wait-get": "writer_wait_get", "wait-hash": "writer_wait_hash",
              "phase": "phase_{name}"}


def stage_key(event: str, info: dict) -> str | None:
    """The result key of a timing event: read_copy, read_xform, writer_item, phase_execute..."""
    key = STAGE_KEYS.get(event)
    if key is None:
        return None
    kind = {"transform": "xform"}.get(info.get("kind"), info.get("kind"))
    return key.format(kind=kind, name=info.get("name"))


def child_kc(argv: list[str]) -> None:
    """In-process kconvert CLI with every engine stage timed by its timing events."""
    import kconvert.cli as cli
    from kconvert import events

    ev: list[tuple[str, float, float]] = []
    marks: dict[str, float] = {}  # run event -> when it came (last one of each name)

    def listen(event: str, info: dict) -> None:
        if event in events.TIMING_EVENTS:
            key = stage_key(event, info)
            if key is not None:
                ev.append((key, info["start"], info["end"]))
        else:
            marks[event] = time.perf_counter()

    if argv[argv.index("--device") + 1] == "cpu":
        load_cpu_kernels()
    # Imported before the timer, as the anchor's imports are (kconvert imports it only when
    # it writes the output's config, at the end of a run).
    import compressed_tensors.quantization  # noqa: F401
    unsubscribe = events.subscribe(listen, timings=True)
    t0 = time.perf_counter()
    rc = 0
    try:
        cli.main(argv, standalone_mode=False)
    except SystemExit as exc:
        rc = exc.code or 0
    os.sync()
    wall = time.perf_counter() - t0
    unsubscribe()
    ev.extend(run_phases(ev, marks, t0))
    stages: dict[str, dict] = {}
    for lab in sorted({e[0] for e in ev}):
        iv = [(a - t0, b - t0) for x, a, b in ev if x == lab]
        stages[lab] = {"n": len(iv), "busy_s": round(sum(b - a for a, b in iv), 3),
                       "union_s": round(_intervals_union(iv), 3),
                       "first_s": round(min(a for a, _ in iv), 3),
                       "first_dur_s": round(min(iv)[1] - min(iv)[0], 3),
                       "last_s": round(max(b for _, b in iv), 3)}
    out = {"wall_main_s": round(wall, 2), "rc_main": rc, "stages": stages,
           "vmhwm_gb": vmhwm_gb(),
           "maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}
    print("RESULT " + json.dumps(out), flush=True)


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


def load_cpu_kernels() -> None:
    """Load the CPU kernels from numba's cache (0.6-1.2 s, varying run to run) before a timed
    CPU run, as the anchor's imports come before its timer: that start-up cost, left in, made
    the per-matrix slope between two runs swing by +-4 ms. It is in wall_process_s. Works with
    trees before kconvert's packages (kconvert.nvfp4) too, for bench_ab.py."""
    import torch

    try:
        from kconvert.formats import nvfp4
    except ImportError:
        from kconvert import nvfp4
    nvfp4.warm_cpu_kernels()  # as a run loads them (the mse rule), then the amax rule
    packed = torch.zeros(1, 1, 4, dtype=torch.int32)
    scale = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    nvfp4.quantize_int4(packed, scale, nvfp4.int4_amax(packed, scale), "amax")


def child_anchor(argv: list[str]) -> None:
    """The anchor's model_free_ptq as anchor_convert.py runs it (same snippet), plus RSS."""
    src, dst, workers, stub = argv
    sys.path.insert(0, stub)
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free import model_free_ptq

    scheme = preset_name_to_scheme("NVFP4A16", [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model_free_ptq(src, dst, scheme=scheme, converter=CompressedTensorsDequantizer(src),
                   device=dev, max_workers=int(workers))
    os.sync()
    print("RESULT " + json.dumps({
        "wall_main_s": round(time.perf_counter() - t0, 3), "device": dev,
        "threads": torch.get_num_threads(), "vmhwm_gb": vmhwm_gb(),
        "maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3)}))


def child_anchor_compute(argv: list[str]) -> None:
    """The anchor's compute alone (dequantizer + model_free converter) on tensors in memory."""
    src, stub, reps = argv[0], argv[1], int(argv[2])
    sys.path.insert(0, stub)
    import torch
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter
    from llmcompressor.entrypoints.model_free.validate import validate_config
    from safetensors.torch import load_file

    scheme = preset_name_to_scheme("NVFP4A16", [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"])
    config = validate_config(None, scheme, ())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    base = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        base.update(load_file(f, device=dev))
    n_mat = sum(k.endswith(".weight_packed") for k in base)
    times = []
    for _ in range(reps):
        tensors = dict(base)
        t = time.perf_counter()
        tensors = CompressedTensorsDequantizer(src).process(tensors)
        tensors = ModelFreePtqConverter(config).process(tensors)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"device": dev, "threads": torch.get_num_threads(),
                                  "matrices": n_mat, "times_s": [round(x, 3) for x in times],
                                  "per_matrix_ms": round(min(times) / n_mat * 1e3, 2)}))


def child_kc_compute(argv: list[str]) -> None:
    """kconvert's INT4 -> NVFP4 per expert matrix, in memory, as the engine does it on this
    device (CPU: the fused kernel; CUDA: decode, then quantize)."""
    dev_name, batch, reps = argv[0], int(argv[1]), int(argv[2])
    import torch

    from kconvert.formats import nvfp4
    from kconvert.formats.int4 import Int4Codec

    dev = torch.device(dev_name)
    chunk = 1 << 27 if dev.type == "cuda" else 1 << 22  # as kconvert.engine.execute picks
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict = {"device": dev_name, "threads": torch.get_num_threads(), "batch": batch}
    for shape in ((I_MOE, H), (H, I_MOE)):
        m, k = shape
        packed = torch.randint(-2**31, 2**31 - 1, (batch, m, k // 8), dtype=torch.int32,
                               device=dev, generator=gen)
        scale = (torch.rand(batch, m, k // 32, device=dev, generator=gen) * 0.004 + 0.001
                 ).to(torch.bfloat16)
        for bs in ("amax", "mse"):
            times = []
            for _ in range(reps):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                if dev.type == "cpu":  # the fused kernel, as the engine computes on a CPU
                    amax = nvfp4.int4_amax(packed, scale)
                    q = nvfp4.quantize_int4(packed, scale, amax, bs, chunk_elems=chunk)
                else:
                    w = Int4Codec.decode({"weight_packed": packed, "weight_scale": scale}, shape)
                    q = nvfp4.quantize(w, w.abs().amax(dim=(1, 2)), bs, chunk)
                    del w
                q.packed.view(-1)[:1].cpu()  # sync
                times.append(time.perf_counter() - t)
                del q
            key = f"{bs}_{m}x{k}"
            out[key + "_ms_per_matrix"] = round(statistics.median(times[1:] or times)
                                                / batch * 1e3, 3)
    print("RESULT " + json.dumps(out))


def child_ioprobe(argv: list[str]) -> None:
    """How this disk reads and writes with more I/O in flight, and without the page cache:
    buffered vs O_DIRECT reads of every source byte (THREADS threads, 16 MiB requests), and
    O_DIRECT writes of `nbytes` (each 1 GiB file rounded up to 16 MiB) alone and at the same
    time as O_DIRECT reads. The page cache is dropped before each phase (needs root)."""
    import mmap

    src, dst, nbytes = Path(argv[0]), Path(argv[1]), int(argv[2])
    threads, chunk = int(os.environ.get("PROBE_THREADS", "4")), 16 << 20
    files = sorted(src.glob("*.safetensors"))
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    res: dict = {"threads": threads, "chunk_mib": chunk >> 20,
                 "read_gb": round(sum(f.stat().st_size for f in files) / 1e9, 2)}

    def together(*fns) -> None:
        ts = [threading.Thread(target=fn) for fn in fns]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def drain(todo: list, io) -> None:
        """`threads` workers take jobs in order; io(job, buf) with a page-aligned buffer of
        the worker's own (as O_DIRECT needs)."""
        pending, lock = iter(todo), threading.Lock()

        def work():
            buf = mmap.mmap(-1, chunk)
            while True:
                with lock:
                    job = next(pending, None)
                if job is None:
                    return
                io(job, buf)

        together(*[work] * threads)

    def reads(direct: bool) -> None:
        fds = {f: os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for f in files}
        drain(jobs, lambda job, buf: os.preadv(fds[job[0]], [buf], job[1]))
        for fd in fds.values():
            os.close(fd)

    def writes() -> None:
        rm(dst)
        dst.mkdir(parents=True)
        data = mmap.mmap(-1, chunk)
        data.write(os.urandom(chunk))
        per_file = 1 << 30
        jobs_w = [(i, off) for i in range(-(-nbytes // per_file))
                  for off in range(0, min(per_file, nbytes - i * per_file), chunk)]
        fds = {i: os.open(dst / f"w{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
               for i in {j[0] for j in jobs_w}}
        drain(jobs_w, lambda job, _: os.pwritev(fds[job[0]], [data], job[1]))
        for fd in fds.values():
            os.fsync(fd)
            os.close(fd)

    def timed(label: str, *fns) -> None:
        drop_caches()
        t = time.perf_counter()
        together(*fns)
        res[label] = round(time.perf_counter() - t, 2)

    timed("read_buffered_s", lambda: reads(False))
    timed("read_direct_s", lambda: reads(True))
    timed("write_direct_s", writes)
    timed("read_write_direct_s", lambda: reads(True), writes)
    rm(dst)
    print("RESULT " + json.dumps(res))


def child_iofloor(argv: list[str]) -> None:
    """Cold read of every source byte AND writing `nbytes` (fsync per 1 GiB file), at once."""
    src, dst, nbytes = Path(argv[0]), Path(argv[1]), int(argv[2])
    rm(dst)
    dst.mkdir(parents=True)
    res: dict = {}
    chunk = 64 << 20

    def reader():
        buf = bytearray(chunk)
        view = memoryview(buf)
        t = time.perf_counter()
        total = 0
        for f in sorted(src.glob("*.safetensors")):
            fd = os.open(f, os.O_RDONLY)
            pos = 0
            while n := os.preadv(fd, [view], pos):
                pos += n
            total += pos
            os.close(fd)
        res["read_s"], res["read_gb"] = round(time.perf_counter() - t, 2), round(total / 1e9, 2)

    def writer():
        buf = memoryview(os.urandom(chunk))
        t = time.perf_counter()
        for i, off in enumerate(range(0, nbytes, 1 << 30)):
            fd = os.open(dst / f"w{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            n = min(1 << 30, nbytes - off)
            pos = 0
            while pos < n:
                pos += os.pwrite(fd, buf[: min(chunk, n - pos)], pos)
            os.fsync(fd)
            os.close(fd)
        res["write_s"] = round(time.perf_counter() - t, 2)

    t = time.perf_counter()
    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    res["both_s"] = round(time.perf_counter() - t, 2)
    rm(dst)
    print("RESULT " + json.dumps(res))


# ------------------------------------------------------------------ helpers

def load_anchor_ns() -> dict:
    """anchor_convert.py's functions (int4_expert, make_src, ANCHOR, ...) without running main."""
    text = anchor_script().read_text()
    text = re.sub(r"\nmain\(\)\s*$", "\n", text)
    ns: dict = {"__name__": "anchor_convert", "__file__": str(anchor_script())}
    exec(compile(text, str(anchor_script()), "exec"), ns)
    return ns


def make_expert_set(dst: Path, n_experts: int, seed: int = 0) -> int:
    """One shard with a MoE layer of n full-size experts (INT4 as anchor_convert makes them)
    and its router + the anchor's config (DIMS=full, n_routed_experts=n): a small set for CPU
    timing. The layer is layer 0 of a one-layer model, so that the source passes kconvert's
    structure checks (no missing dense layer 0, a router, top-k within n)."""
    import torch
    from safetensors.torch import save_file

    os.environ["DIMS"] = "full"
    ns = load_anchor_ns()
    torch.manual_seed(seed)
    rm(dst)
    dst.mkdir(parents=True)
    t = {"model.layers.0.mlp.gate.weight": ns["bf16"](n_experts, H),
         "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(n_experts)}
    for e in range(n_experts):
        for pj, shp in (("gate_proj", (I_MOE, H)), ("up_proj", (I_MOE, H)),
                        ("down_proj", (H, I_MOE))):
            pk, sc, sh = ns["int4_expert"](*shp)
            b = f"model.layers.0.mlp.experts.{e}.{pj}"
            t[f"{b}.weight_packed"], t[f"{b}.weight_scale"], t[f"{b}.weight_shape"] = pk, sc, sh
    name = "model-00001-of-000001.safetensors"
    save_file(t, dst / name, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": (dst / name).stat().st_size},
         "weight_map": dict.fromkeys(t, name)}, indent=2))
    # The anchor's config, from a throwaway DIMS=full make_src config block.
    cfg = anchor_config(ns)
    cfg.update(n_routed_experts=n_experts, num_experts_per_tok=min(8, n_experts),
               num_hidden_layers=1, first_k_dense_replace=0)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return 3 * n_experts


def anchor_config(ns: dict) -> dict:
    """The config.json that anchor_convert.make_src writes (read from its source text)."""
    text = anchor_script().read_text()
    start = text.index("    cfg = {")
    end = text.index("json.dump(cfg", start)
    block = "\n".join(ln[4:] for ln in text[start:end].splitlines())
    env = {k: ns[k] for k in ("H", "I_DENSE", "I_MOE", "E", "V", "QL", "KVL", "NH")}
    env["MOE_LAYERS"] = 1
    exec(compile(block, "anchor_cfg", "exec"), {}, env)
    return env["cfg"]


def compare_dirs(a: Path, b: Path) -> dict:
    """Byte comparison of every file; tensor-level detail for differing .safetensors."""
    from safetensors import safe_open

    files = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    out = {"files": len(files), "identical": [], "different": {}}
    for f in files:
        pa, pb = a / f, b / f
        if not (pa.is_file() and pb.is_file()):
            out["different"][f] = "missing in " + (str(b) if pa.is_file() else str(a))
            continue
        if pa.read_bytes() == pb.read_bytes():
            out["identical"].append(f)
            continue
        if f.endswith(".safetensors"):
            detail = {}
            with safe_open(pa, "pt") as ha, safe_open(pb, "pt") as hb:
                for k in sorted(set(ha.keys()) | set(hb.keys())):
                    if k not in ha.keys() or k not in hb.keys():
                        detail[k] = "missing on one side"
                        continue
                    ta, tb = ha.get_tensor(k), hb.get_tensor(k)
                    if ta.dtype != tb.dtype or ta.shape != tb.shape:
                        detail[k] = f"{ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}"
                        continue
                    ua = ta.contiguous().view(-1).view(__import__("torch").uint8)
                    ub = tb.contiguous().view(-1).view(__import__("torch").uint8)
                    diff = (ua != ub).nonzero().flatten()
                    if len(diff):
                        idx = diff[:5].tolist()
                        detail[k] = {"dtype": str(ta.dtype), "shape": list(ta.shape),
                                     "bytes_differing": len(diff), "bytes": ua.numel(),
                                     "first_byte_idx": idx,
                                     "a": [hex(int(ua[i])) for i in idx],
                                     "b": [hex(int(ub[i])) for i in idx]}
            out["different"][f] = detail or "header/metadata differs"
        elif f.endswith(".json"):
            ja, jb = json.loads(pa.read_text()), json.loads(pb.read_text())
            out["different"][f] = _json_diff(ja, jb)[:20]
        else:
            out["different"][f] = "bytes differ"
    out["identical"] = len(out["identical"])
    return out


def _json_diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        d = []
        for k in sorted(set(a) | set(b)):
            d += _json_diff(a.get(k), b.get(k), f"{path}.{k}")
        return d
    return [] if a == b else [f"{path}: {str(a)[:80]} != {str(b)[:80]}"]


def kc_args(src: Path, dst: Path, device: str, bs: str | None, extra=(),
            command: str = "int4-to-nvfp4") -> list[str]:
    a = ["_kc", command, str(src), str(dst), "--device", device, "--quiet",
         "--overwrite", *extra]
    return a + (["--block-scale", bs] if bs else [])


def timed_kc(src: Path, dst: Path, device: str, bs: str | None, env=None, extra=(),
             command: str = "int4-to-nvfp4") -> dict:
    """A cold-cache kconvert run into a fresh `dst`."""
    rm(dst)
    cold = drop_caches()
    r = run_child(kc_args(src, dst, device, bs, extra, command), env=env, gpu=device != "cpu")
    r["drop_caches_ok"] = cold
    r["out_bytes"] = du(dst) if dst.exists() else None
    return r


def stub_dir() -> str:
    return str(anchor_script().parent / "stub")


# ------------------------------------------------------------------ modes

def warm_cpu_kernels() -> None:
    """Compile (or load) numba's cache of the CPU kernels before any timed CPU run."""
    if "cpu_kernels_warmup" in RES:
        return
    r = run_child(kc_args(FIXTURE, ROOT / "warm", "cpu", None), monitor=False,
                  env=env_with(CUDA_VISIBLE_DEVICES=""))
    RES["cpu_kernels_warmup"] = {k: r.get(k) for k in ("rc", "wall_main_s", "wall_process_s")}
    log("cpu kernels warm-up (first CPU run: numba compiles and caches)",
        RES["cpu_kernels_warmup"])
    rm(ROOT / "warm")


def cpu_comparison() -> dict:
    """CPU per-matrix throughput of both tools, CUDA hidden, on two sets of full-size experts."""
    warm_cpu_kernels()
    cpu_env = env_with(CUDA_VISIBLE_DEVICES="")
    sizes = tuple(int(x) for x in os.environ.get("CPU_SIZES", "8,64").split(","))
    res: dict = {"sets": {}, "sizes": sizes}
    for n in sizes:
        res["sets"][n] = make_expert_set(ROOT / f"cpu{n}", n)
    runs: dict = {}
    for n in sizes:
        src = ROOT / f"cpu{n}"
        runs[f"anchor_{n}"] = run_child(["_anchor", str(src), str(ROOT / f"cpu{n}_anchor"), "1",
                                         stub_dir()], env=cpu_env, gpu=False)
        log(f"anchor cpu n={n}", runs[f"anchor_{n}"].get("wall_main_s"))
        for bs in ("mse", "amax"):
            k = f"kc_{bs}_{n}"
            runs[k] = run_child(kc_args(src, ROOT / f"cpu{n}_kc_{bs}", "cpu", bs), env=cpu_env,
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
    res["anchor_compute"] = run_child(
        ["_anchor_compute", str(ROOT / f"cpu{sizes[0]}"), stub_dir(), "2"], env=cpu_env,
        monitor=False)
    res["kc_compute"] = run_child(["_kc_compute", "cpu", "3", "2"], env=cpu_env, monitor=False)
    if "anchor" in per:
        for bs in ("mse", "amax"):
            if f"kc_{bs}" in per:
                res[f"speedup_{bs}_vs_anchor_slope"] = round(
                    per["anchor"]["slope_ms_per_matrix"]
                    / max(per[f"kc_{bs}"]["slope_ms_per_matrix"], 1e-9), 2)
    return res


def smoke() -> None:
    RES["mode"] = "smoke"
    RES["machine"] = machine()
    log("machine", RES["machine"])
    save("smoke")
    import torch

    has_cuda = torch.cuda.is_available()
    # 1. fixture: CPU vs CUDA bytes, both block-scale rules, NVFP4 and MXFP4 (AMD's recipe:
    # experts and routers).
    fx: dict = {}
    for bs, command, extra in (("amax", "int4-to-nvfp4", ()), ("mse", "int4-to-nvfp4", ()),
                               ("amax", "int4-to-mxfp4", ("--targets", "experts,routers")),
                               ("mse", "int4-to-mxfp4", ("--targets", "experts,routers"))):
        key = bs if command == "int4-to-nvfp4" else f"mxfp4_{bs}"
        dirs = {}
        for dev in ("cpu",) + (("cuda",) if has_cuda else ()):
            d = ROOT / f"fx_{dev}_{key}"
            r = run_child(kc_args(FIXTURE, d, dev, bs, extra, command), monitor=False)
            fx[f"{dev}_{key}"] = {k: r.get(k) for k in ("rc", "rc_main", "wall_process_s",
                                                         "wall_main_s", "error_tail")}
            dirs[dev] = d
            log(f"fixture {dev} {key}", fx[f"{dev}_{key}"])
        if has_cuda and all(fx[f"{d}_{key}"]["rc"] == 0 for d in ("cpu", "cuda")):
            fx[f"compare_{key}"] = compare_dirs(dirs["cpu"], dirs["cuda"])
            log(f"fixture compare {key}", fx[f"compare_{key}"])
    RES["fixture_cpu_vs_cuda"] = fx
    save("smoke")
    # 2. GPU compute per matrix in-process.
    if has_cuda:
        RES["kc_compute_cuda"] = {b: run_child(["_kc_compute", "cuda", str(b), "4"],
                                               monitor=False) for b in (3, 24)}
        log("kc compute cuda", RES["kc_compute_cuda"])
        save("smoke")
    # 3. CPU comparison (CUDA hidden for both) on two sets of full-size experts.
    RES["cpu"] = cpu_comparison()
    log("cpu per matrix", RES["cpu"].get("per_matrix"))
    save("smoke")
    # 4. The same 8-expert set on CUDA: bytes must equal the CPU output.
    if has_cuda:
        full8: dict = {}
        n = RES["cpu"]["sizes"][-1]
        for bs in ("mse", "amax"):
            d = ROOT / f"cpu{n}_kc_cuda_{bs}"
            r = run_child(kc_args(ROOT / f"cpu{n}", d, "cuda", bs))
            r.pop("timeline", None)
            full8[bs] = r
            if r["rc"] == 0:
                full8[f"compare_{bs}"] = compare_dirs(ROOT / f"cpu{n}_kc_{bs}", d)
            log(f"{n} full-size experts cuda {bs}", r.get("wall_main_s"),
                full8.get(f"compare_{bs}"))
        RES["full_experts_cpu_vs_cuda"] = full8
        save("smoke")
    # 5. DIMS=tiny anchor set: anchor + floors (anchor_convert) and kconvert on the same src.
    if not late() and os.environ.get("SMOKE_TINY", "1") == "1":
        tiny = ROOT / "tiny"
        p = subprocess.run([sys.executable, str(anchor_script())], env=env_with(
            DIMS="tiny", MOE_LAYERS="1", WORKERS="1", ROOT=tiny, OUT=tiny / "out"),
            capture_output=True, text=True)
        RES["tiny_anchor"] = (json.loads((tiny / "out" / "anchor.json").read_text())
                              if (tiny / "out" / "anchor.json").is_file() else p.stderr[-2000:])
        dev = "cuda" if has_cuda else "cpu"
        RES["tiny_kc"] = {bs: timed_kc(tiny / "src", tiny / "kc", dev, bs) for bs in ("mse",
                                                                                    "amax")}
        for r in RES["tiny_kc"].values():
            r.pop("timeline", None)
        log("tiny anchor", RES["tiny_anchor"])
        log("tiny kc", {k: (v.get("wall_main_s"), v.get("wall_process_s"))
                        for k, v in RES["tiny_kc"].items()})
    RES["elapsed_s"] = round(time.perf_counter() - T_START, 1)
    save("smoke")


def cpu_only() -> None:
    """Just the CPU per-matrix comparison (both tools, CUDA hidden)."""
    RES["mode"] = "cpu"
    RES["machine"] = machine()
    RES["cpu"] = cpu_comparison()
    log("cpu per matrix", RES["cpu"].get("per_matrix"))
    RES["elapsed_s"] = round(time.perf_counter() - T_START, 1)
    save("cpu")


def full() -> None:
    RES["mode"] = "full"
    RES["machine"] = machine()
    log("machine", RES["machine"])
    save("full")
    src = ROOT / "src"
    # 1. anchor_convert.py: builds ROOT/src, times the anchor (cold) and the floors.
    a_out = ROOT / "anchor_out"
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, str(anchor_script())], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env_with(
                             DIMS=os.environ.get("DIMS", "full"),
                             MOE_LAYERS=os.environ.get("MOE_LAYERS", "1"),
                             WORKERS=os.environ.get("WORKERS", "1"), ROOT=ROOT, OUT=a_out))
    tail = []
    for ln in p.stdout:
        tail = [*tail, ln][-40:]
        print("    |", ln.rstrip()[:300], flush=True)
    p.wait()
    anchor = json.loads((a_out / "anchor.json").read_text()) if (a_out / "anchor.json"
                                                                ).is_file() else {}
    anchor["script_wall_s"] = round(time.perf_counter() - t, 1)
    if p.returncode:
        anchor["error_tail"] = "".join(tail)[-3000:]
    RES["anchor"] = anchor
    if (a_out / "anchor.json").is_file():
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copy(a_out / "anchor.json", OUT / "anchor.json")
    rm(ROOT / "dst_floor")
    save("full")
    dst_bytes = anchor.get("dst_bytes") or anchor.get("src_bytes")
    # 2. Concurrent floor: read every source byte while writing the output's bytes.
    if dst_bytes and src.is_dir():
        cold = drop_caches()
        r = run_child(["_iofloor", str(src), str(ROOT / "floor_conc"), str(dst_bytes)], gpu=False)
        r["drop_caches_ok"] = cold
        RES["io_floor_concurrent"] = r
        log("concurrent floor", {k: r.get(k) for k in ("read_s", "write_s", "both_s")})
        save("full")
    # 2b. What the disk does with more requests in flight and O_DIRECT (not a floor).
    if dst_bytes and src.is_dir() and os.environ.get("IO_PROBE", "1") == "1":
        r = run_child(["_ioprobe", str(src), str(ROOT / "probe"), str(dst_bytes)], gpu=False)
        r.pop("timeline", None)
        RES["io_probe"] = r
        log("io probe", {k: v for k, v in r.items() if k.endswith("_s")})
        save("full")
    # 3. kconvert on the same src, cold, its own process each.
    if shutil.disk_usage(ROOT).free < 1.3 * (dst_bytes or 0):
        rm(ROOT / "dst")
    RES["kc"] = {}
    nv, mx = "int4-to-nvfp4", "int4-to-mxfp4"
    variants = [("mse", None, "cuda", nv), ("amax", "amax", "cuda", nv)]
    if os.environ.get("MXFP4", "1") == "1":
        variants += [("mxfp4_amax", None, "cuda", mx), ("mxfp4_mse", "mse", "cuda", mx)]
    variants.append(("mse_cpu", None, "cpu", nv))
    if not RES["machine"]["gpu"]:
        variants = [v for v in variants if v[2] != "cuda"]
    for label, bs, device, command in variants:
        if device == "cpu" and late():
            continue
        env = None
        if device == "cpu":
            warm_cpu_kernels()
            env = env_with(CUDA_VISIBLE_DEVICES="")
        r = timed_kc(src, ROOT / "kc", device, bs, env=env, command=command)
        r["device"], r["command"] = device, command
        RES["kc"][label] = r
        log(f"kconvert {label}", {k: r.get(k) for k in (
            "rc", "wall_main_s", "wall_process_s", "vmhwm_gb", "maxrss_gb", "gpu")}
            | {"stages": r.get("stages")})
        if label == "amax" and (ROOT / "dst").is_dir() and r["rc"] == 0:
            RES["anchor_vs_kc_amax_sample"] = sample_vs_anchor(ROOT / "dst", ROOT / "kc")
        save("full")
    rm(ROOT / "kc")
    # 4. Ratios.
    floor = anchor.get("io_floor_s")
    conc = RES.get("io_floor_concurrent", {}).get("both_s")
    ratios = {}
    for label, r in RES["kc"].items():
        if r.get("rc") == 0 and r.get("rc_main") == 0 and floor:
            ratios[label] = {
                "wall_main_over_floor": round(r["wall_main_s"] / floor, 2),
                "wall_main_over_concurrent_floor": round(r["wall_main_s"] / conc, 2)
                if conc else None,
                "wall_process_over_floor": round(r["wall_process_s"] / floor, 2),
                "anchor_over_wall_main": round(anchor["anchor_w1_s"] / r["wall_main_s"], 2)
                if anchor.get("anchor_w1_s") else None,
                "peak_rss_gb": r.get("vmhwm_gb") or r.get("maxrss_gb"),
                "target_wall_ok": r["wall_main_s"] <= 1.3 * floor,
                "target_rss_ok": (r.get("vmhwm_gb") or r.get("maxrss_gb") or 99) <= 4.0}
    if conc:
        ratios["concurrent_floor_over_io_floor"] = round(conc / floor, 2) if floor else None
    RES["ratios"] = ratios
    save("full")
    log("ratios", ratios)
    # 5. CPU per expert matrix, both tools, same machine (skipped when short of time).
    if not late():
        rm(src)
        RES["cpu"] = cpu_comparison()
        log("cpu per matrix", RES["cpu"].get("per_matrix"))
    RES["elapsed_s"] = round(time.perf_counter() - T_START, 1)
    save("full")


def sample_vs_anchor(anchor_dst: Path, kc_dst: Path, n: int = 4) -> dict:
    """down_proj (no fused partner: same global scale rule) bytes, kconvert amax vs anchor."""
    import torch
    from safetensors import safe_open

    def find(d: Path, name: str):
        idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(d / idx[name], "pt") as h:
            return h.get_tensor(name)

    out = {}
    for e in range(n):
        for p in ("weight_packed", "weight_scale", "weight_global_scale"):
            name = f"model.layers.1.mlp.experts.{e}.down_proj.{p}"
            try:
                a, b = find(anchor_dst, name), find(kc_dst, name)
            except (KeyError, OSError) as exc:
                out[name] = f"missing: {exc}"
                continue
            ua, ub = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(
                torch.uint8)
            out[name] = (round(float((ua == ub).float().mean()), 5) if ua.shape == ub.shape
                         else f"shape {list(a.shape)} vs {list(b.shape)}")
    return out


CHILDREN = {"_kc": child_kc, "_anchor": child_anchor, "_anchor_compute": child_anchor_compute,
            "_kc_compute": child_kc_compute, "_iofloor": child_iofloor,
            "_ioprobe": child_ioprobe}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in {"smoke", "full", "cpu", *CHILDREN}:
        raise SystemExit(__doc__)
    mode = sys.argv[1]
    if mode in CHILDREN:
        sys.path.insert(0, str(REPO))
        CHILDREN[mode](sys.argv[2:])
        return
    ROOT.mkdir(parents=True, exist_ok=True)
    {"smoke": smoke, "full": full, "cpu": cpu_only}[mode]()
    log("done", OUT)


if __name__ == "__main__":
    main()
