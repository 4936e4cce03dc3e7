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

import json
import sys

from benchmarks import convert_children, inprocess, io_floor
from benchmarks.child_process import child_env, run_child
from benchmarks.convert_floors import cast, full
from benchmarks.convert_runs import Run, child, cpu_comparison, kc_args, timed_kc
from benchmarks.harness import Timer, arguments, comma_ints, log, record, result_path
from benchmarks.outputs import compare_dirs
from benchmarks.synthetic import FIXTURE, add_anchor_dims, anchor_script


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
