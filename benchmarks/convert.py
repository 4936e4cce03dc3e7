"""kconvert int4-to-nvfp4 (and int4-to-mxfp4) against llm-compressor's model_free_ptq (the
anchor) and the I/O floor.

    python -m benchmarks convert smoke   # correctness + CPU per-matrix comparison (short)
    python -m benchmarks convert full    # the acceptance benchmark on the full-size set
    python -m benchmarks convert cpu     # only the CPU per-matrix comparison
    python -m benchmarks convert cast    # the exact MXFP4 -> NVFP4 cast against the copy

On the device machine (wheels of compressed-tensors, llmcompressor, loguru, pydantic* in .whl/,
anchor_convert.py + stub/ copied to .bench/):
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
    python3 -m benchmarks convert full --root /tmp/kbench --out-dir $OUT 2>&1 \\
        | tee $OUT/log_full.txt

`full` runs `anchor_convert.py` (shared/bench; it builds ROOT/src, a full-size synthetic
Kimi-K2-Thinking shard set, and times the anchor, the cold read floor and the write floor),
then, in the same run and on the same disk, a concurrent read+write floor and kconvert
(`--device cuda` with `--block-scale mse` and `amax`, then `int4-to-mxfp4 --device cuda` (AMD
Quark's layout) with its default `amax` and with `mse` unless --no-mxfp4, then `--device cpu`
mse on the same set),
each in its own process with the page cache dropped first, and last the CPU per-matrix
comparison of `smoke` step 3 (the CUDA runs are left out on a machine without a GPU). Every
kconvert run is timed in-process (after imports, like the anchor; on the CPU also after
numba's cached kernels are loaded) and as a whole process, with its peak RSS, a timeline
(RSS, disk bytes, CPU, GPU utilisation) and, under `stages`, each engine stage's count, busy
and union seconds, first start and duration, last end, from the engine's timing events
(kconvert.common.events, subscribed in the child; kconvert is not modified): read_copy / read_xform
(reader threads), compute_copy / compute_xform, main_wait_read (compute waiting for a read),
main_wait_put (compute waiting on the full result queue), hash_item (hasher thread),
writer_item (writer busy), writer_wait_get (writer idle), writer_wait_hash, pwrite, fsync,
and the phases phase_read_shape_values, phase_build_work_plan, phase_execute, plus, from when
the run events came, phase_until_plan, phase__finish and phase_write_manifest (`run_phases`).
--dims tiny makes `full` build and convert a tiny set (--moe-layers 1: seconds), a check of
the script and of the event plumbing rather than a benchmark.

`smoke` converts the bundled fixture on CPU and CUDA (int4-to-nvfp4, and int4-to-mxfp4 with
the routers) and compares every output byte, does the
same on a shard of full-size experts, times kconvert's compute per expert matrix on the GPU
and the CPU in-process, times a tiny anchor set (unless --no-smoke-tiny), and measures CPU
throughput per expert matrix of both tools (CUDA hidden), end to end on shards of 8 and 64
(--cpu-sizes) full-size INT4 experts
(per matrix = the slope between the two, which removes start-up costs) and in-process.

`cast` builds the anchor's INT4 set (--dims full, tiny or small; --moe-layers) in ROOT/src
unless it is there, its MXFP4 twin ROOT/mx-src (benchmarks.synthetic.mxfp4_set: compressed-tensors'
mxfp4-pack-quantized experts, Kimi-K3's format), then times `kconvert mxfp4-to-nvfp4` (the
exact cast, `quantize --cast exact`) cold, each in its own process: `--device cuda` in both
NVFP4 formats where there is a GPU, then `--device cpu` (unless --no-cpu); and the concurrent
copy of the same bytes (read ROOT/mx-src while writing the cast's output size), with each
run's wall over it (issue 37 asks for at most 1.1x on the device). --dims tiny runs it on a
CPU in seconds.

Earlier rounds emulated engine changes before they landed (modes `tune` and `tune2` at commit
55ee068 and before; their results are in benchmarks/results/README.md). A child's peak RSS is
its VmHWM (`vmhwm_gb`, its own figure) and the harness's `peak_rss_gb` (its launcher's wait4).

anchor_convert.py is .bench/anchor_convert.py, else shared/bench/anchor_convert.py in or
beside this repository (ANCHOR_SCRIPT names another: benchmarks.synthetic.anchor_script).

The fused CPU kernels are compiled by numba on first use and cached next to the module (11.5 s
on the H200 machine, once per install); before any timed CPU run, `warm_cpu_kernels` converts
the bundled fixture on the CPU once and records that first run's time, so no timing includes
the compile.
Results: OUT_DIR/convert_<device>_<date>_<code>_<mode>.json (everything, plus ratios) and the
anchor's anchor.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import convert_children, inprocess, io_floor
from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    REPO,
    Timer,
    arguments,
    comma_ints,
    drop_page_cache,
    log,
    record,
    result_path,
    save,
)
from benchmarks.outputs import compare_dirs
from benchmarks.synthetic import (
    FIXTURE,
    add_anchor_dims,
    anchor_script,
    anchor_set,
    anchor_stub,
    expert_set,
    mxfp4_set,
)
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


def smoke(run: Run) -> None:
    import torch

    res, root = run.res, run.root
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
            d = root / f"fx_{dev}_{key}"
            r = child(kc_args(FIXTURE, d, dev, bs, extra, command), monitor=False)
            fx[f"{dev}_{key}"] = {k: r.get(k) for k in ("rc", "rc_main", "wall_process_s",
                                                         "wall_main_s", "error_tail")}
            dirs[dev] = d
            log(f"fixture {dev} {key}", fx[f"{dev}_{key}"])
        if has_cuda and all(fx[f"{d}_{key}"]["rc"] == 0 for d in ("cpu", "cuda")):
            fx[f"compare_{key}"] = compare_dirs(dirs["cpu"], dirs["cuda"])
            log(f"fixture compare {key}", fx[f"compare_{key}"])
    res["fixture_cpu_vs_cuda"] = fx
    run.save()
    # 2. GPU compute per matrix in-process.
    if has_cuda:
        res["kc_compute_cuda"] = {b: child(["_kc_compute", "cuda", str(b), "4"], monitor=False)
                                  for b in (3, 24)}
        log("kc compute cuda", res["kc_compute_cuda"])
        run.save()
    # 3. CPU comparison (CUDA hidden for both) on two sets of full-size experts.
    res["cpu"] = cpu_comparison(run)
    log("cpu per matrix", res["cpu"].get("per_matrix"))
    run.save()
    # 4. The same full-size expert set on CUDA: bytes must equal the CPU output.
    if has_cuda:
        full8: dict = {}
        n = res["cpu"]["sizes"][-1]
        for bs in ("mse", "amax"):
            d = root / f"cpu{n}_kc_cuda_{bs}"
            r = child(kc_args(root / f"cpu{n}", d, "cuda", bs))
            r.pop("timeline", None)
            full8[bs] = r
            if r["rc"] == 0:
                full8[f"compare_{bs}"] = compare_dirs(root / f"cpu{n}_kc_{bs}", d)
            log(f"{n} full-size experts cuda {bs}", r.get("wall_main_s"),
                full8.get(f"compare_{bs}"))
        res["full_experts_cpu_vs_cuda"] = full8
        run.save()
    # 5. A tiny anchor set: anchor + floors (anchor_convert) and kconvert on the same src.
    if not run.timer.late() and not run.args.no_smoke_tiny:
        tiny = root / "tiny"
        p = run_child([sys.executable, anchor_script()], merge=True, env=child_env(
            DIMS="tiny", MOE_LAYERS="1", WORKERS="1", ROOT=tiny, OUT=tiny / "out"))
        res["tiny_anchor"] = (json.loads((tiny / "out" / "anchor.json").read_text())
                              if (tiny / "out" / "anchor.json").is_file()
                              else p.output[-2000:])
        dev = "cuda" if has_cuda else "cpu"
        res["tiny_kc"] = {bs: timed_kc(tiny / "src", tiny / "kc", dev, bs,
                                       run.args.keep_page_cache) for bs in ("mse", "amax")}
        for r in res["tiny_kc"].values():
            r.pop("timeline", None)
        log("tiny anchor", res["tiny_anchor"])
        log("tiny kc", {k: (v.get("wall_main_s"), v.get("wall_process_s"))
                        for k, v in res["tiny_kc"].items()})


def cpu_only(run: Run) -> None:
    """Just the CPU per-matrix comparison (both tools, CUDA hidden)."""
    run.res["cpu"] = cpu_comparison(run)
    log("cpu per matrix", run.res["cpu"].get("per_matrix"))


def full(run: Run) -> None:
    res, root = run.res, run.root
    src = root / "src"
    # 1. anchor_convert.py: builds ROOT/src, times the anchor (cold) and the floors.
    a_out = root / "anchor_out"
    p = run_child([sys.executable, anchor_script()], merge=True, echo=echo, env=child_env(
        DIMS=run.args.dims, MOE_LAYERS=str(run.args.moe_layers),
        WORKERS=str(run.args.workers), ROOT=root, OUT=a_out))
    anchor = json.loads((a_out / "anchor.json").read_text()) if (a_out / "anchor.json"
                                                                ).is_file() else {}
    anchor["script_wall_s"] = round(p.wall_s, 1)
    if p.rc:
        anchor["error_tail"] = p.output[-3000:]
    res["anchor"] = anchor
    if (a_out / "anchor.json").is_file():
        run.path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(a_out / "anchor.json", run.path.parent / "anchor.json")
    rm(root / "dst_floor")
    run.save()
    dst_bytes = anchor.get("dst_bytes") or anchor.get("src_bytes")
    # 2. Concurrent floor: read every source byte while writing the output's bytes.
    if dst_bytes and src.is_dir():
        cold = drop_page_cache(run.args.keep_page_cache) is None
        r = child(["_iofloor", str(src), str(root / "floor_conc"), str(dst_bytes)], gpu=False)
        r["drop_caches_ok"] = cold
        res["io_floor_concurrent"] = r
        log("concurrent floor", {k: r.get(k) for k in ("read_s", "write_s", "both_s")})
        run.save()
    # 2b. What the disk does with more requests in flight and O_DIRECT (not a floor).
    if dst_bytes and src.is_dir() and not run.args.no_io_probe:
        r = child(["_ioprobe", str(src), str(root / "probe"), str(dst_bytes),
                   str(run.args.probe_threads), str(int(run.args.keep_page_cache))], gpu=False)
        r.pop("timeline", None)
        res["io_probe"] = r
        log("io probe", {k: v for k, v in r.items() if k.endswith("_s")})
        run.save()
    # 3. kconvert on the same src, cold, its own process each.
    if shutil.disk_usage(root).free < 1.3 * (dst_bytes or 0):
        rm(root / "dst")
    res["kc"] = {}
    nv, mx = "int4-to-nvfp4", "int4-to-mxfp4"
    variants = [("mse", None, "cuda", nv), ("amax", "amax", "cuda", nv)]
    if not run.args.no_mxfp4:
        variants += [("mxfp4_amax", None, "cuda", mx), ("mxfp4_mse", "mse", "cuda", mx)]
    variants.append(("mse_cpu", None, "cpu", nv))
    if res["record"]["device"]["kind"] == "cpu":
        variants = [v for v in variants if v[2] != "cuda"]
    for label, bs, device, command in variants:
        if device == "cpu" and run.timer.late():
            continue
        env = None
        if device == "cpu":
            warm_cpu_kernels(run)
            env = cpu_env()
        r = timed_kc(src, root / "kc", device, bs, run.args.keep_page_cache, env=env,
                     command=command)
        r["device"], r["command"] = device, command
        res["kc"][label] = r
        log(f"kconvert {label}", {k: r.get(k) for k in (
            "rc", "wall_main_s", "wall_process_s", "vmhwm_gb", "maxrss_gb", "gpu")}
            | {"stages": r.get("stages")})
        if label == "amax" and (root / "dst").is_dir() and r["rc"] == 0:
            res["anchor_vs_kc_amax_sample"] = sample_vs_anchor(root / "dst", root / "kc")
        run.save()
    rm(root / "kc")
    res["ratios"] = ratios(res, anchor)
    run.save()
    log("ratios", res["ratios"])
    # 5. CPU per expert matrix, both tools, same machine (skipped when short of time).
    if not run.timer.late():
        rm(src)
        res["cpu"] = cpu_comparison(run)
        log("cpu per matrix", res["cpu"].get("per_matrix"))


def ratios(res: dict, anchor: dict) -> dict:
    """Each kconvert run against the floors and the anchor, and the targets."""
    floor = anchor.get("io_floor_s")
    conc = res.get("io_floor_concurrent", {}).get("both_s")
    out = {}
    for label, r in res["kc"].items():
        if r.get("rc") == 0 and r.get("rc_main") == 0 and floor:
            out[label] = {
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
        out["concurrent_floor_over_io_floor"] = round(conc / floor, 2) if floor else None
    return out


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


def cast(run: Run) -> None:
    """The exact cast on the MXFP4 twin of the anchor's set, against the concurrent copy."""
    res, root = run.res, run.root
    src = root / "src"
    if not (src / "config.json").is_file():
        res["src_bytes"] = anchor_set(src, run.args.dims, run.args.moe_layers)
    gpu = res["record"]["device"]["kind"] != "cpu"
    made = Timer()
    mx = mxfp4_set(src, root / "mx-src", "cuda" if gpu else "cpu")
    res["mx_src"] = {"bytes": du(mx), "build_s": round(made.elapsed(), 1)}
    run.save()
    res["kc"] = {}
    variants = [("exact_cuda", "cuda", ()), ("exact_modelopt_cuda", "cuda",
                                             ("--format", "modelopt")), ("exact_cpu", "cpu", ())]
    for label, device, extra in variants:
        if (device == "cuda" and not gpu) or (device == "cpu" and run.args.no_cpu):
            continue
        env = None
        if device == "cpu":
            warm_cpu_kernels(run)
            env = cpu_env()
        r = timed_kc(mx, root / "kc", device, None, run.args.keep_page_cache, env=env,
                     extra=extra, command="mxfp4-to-nvfp4")
        r["device"] = device
        res["kc"][label] = r
        log(f"kconvert {label}", {k: r.get(k) for k in (
            "rc", "wall_main_s", "wall_process_s", "vmhwm_gb", "out_bytes")})
        run.save()
    made_bytes = next((r["out_bytes"] for r in res["kc"].values() if r.get("out_bytes")), None)
    rm(root / "kc")
    if made_bytes:
        cold = drop_page_cache(run.args.keep_page_cache) is None
        floor = child(["_iofloor", str(mx), str(root / "floor_conc"), str(made_bytes)],
                      gpu=False)
        floor["drop_caches_ok"] = cold
        res["io_floor_concurrent"] = floor
        conc = floor.get("both_s")
        res["ratios"] = {label: round(r["wall_main_s"] / conc, 2)
                         for label, r in res["kc"].items()
                         if conc and r.get("rc") == 0 and r.get("wall_main_s")}
        log("concurrent copy", conc, "wall_main / it", res["ratios"])


MODES = {"smoke": smoke, "full": full, "cpu": cpu_only, "cast": cast}
CHILDREN = {"_kc": inprocess.timed_kconvert, "_anchor": convert_children.anchor,
            "_anchor_compute": convert_children.anchor_compute,
            "_kc_compute": convert_children.kc_compute, "_iofloor": io_floor.iofloor,
            "_ioprobe": io_floor.ioprobe}


def main(argv: list[str]) -> None:
    if argv and argv[0] in CHILDREN:
        CHILDREN[argv[0]](argv[1:])
        return
    ap = arguments("convert", __doc__, root="/tmp/kbench", results=True, page_cache=True,
                   deadline_s=540)
    ap.add_argument("mode", choices=MODES)
    add_anchor_dims(ap)
    ap.add_argument("--workers", type=int, default=1,
                    help="the anchor's WORKERS in `full` (default: %(default)s)")
    ap.add_argument("--cpu-sizes", type=comma_ints, default=[8, 64],
                    help="experts of the two CPU shards (default: 8,64)")
    ap.add_argument("--no-mxfp4", action="store_true", help="`full` without int4-to-mxfp4")
    ap.add_argument("--no-io-probe", action="store_true", help="`full` without the I/O probe")
    ap.add_argument("--probe-threads", type=int, default=4,
                    help="the I/O probe's threads (default: %(default)s)")
    ap.add_argument("--no-smoke-tiny", action="store_true",
                    help="`smoke` without the tiny anchor set")
    ap.add_argument("--no-cpu", action="store_true", help="`cast` without the CPU run")
    a = ap.parse_args(argv)
    root, mode = a.root, a.mode
    root.mkdir(parents=True, exist_ok=True)
    run = Run(mode, root, Timer(deadline_s=a.deadline_s), a)
    rec = record("convert", scratch=root)
    run.res.update(record=rec, mode=mode)
    run.path = result_path(rec, label=mode, out_dir=a.out_dir)
    log("record", rec)
    run.save()
    MODES[mode](run)
    run.res["elapsed_s"] = round(run.timer.elapsed(), 1)
    run.save()
    log("done", run.path)
