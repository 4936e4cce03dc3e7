"""One GPU memory budget for every GPU command (issue 26 item 3, docs/gpu-memory.md) on the
full-size one-MoE-layer set, in one device call.

Device (one H100 80 GB; --deadline-s (510 s) ends a call within 9 minutes, the set included;
the whole list is estimated at 9-11 minutes, so a second call with the same line on the same
held machine may be needed for the last runs):
    python3 -m benchmarks gpu_memory $OUT/bench_gpu_memory.json --root /tmp/kbench
CPU smoke test (tiny dims, --device cpu, a few minutes):
    python -m benchmarks gpu_memory --tiny /tmp/bench_gpu_memory_tiny.json

Builds (or reuses) synthetic.kimi_set in ROOT/calib-src (layer 0 dense, layer 1 MoE with 384
INT4 experts, Kimi-K2 shapes, a 16k vocabulary) and --seqs (128) random sequences of --seq
(2048) tokens, then runs each command in its own process through the command line, at its
default options (but the data, and --obs-samples (16) calibration sequences for sparsegpt and
gptq), once at the default budget and once under --gpu-memory 40GiB (--budgets):
  sparsify --pattern p48 --method sparsegpt, int4-to-nvfp4 --method gptq, calibrate,
  eval (SRC against itself), reap --data --prune-ratio 0.5;
and two induced out-of-memory cases of sparsify --method sparsegpt, each expecting one
`kconvert: error:` line (run with --quiet), exit 1 and no manifest:
  oom-refused  --gpu-memory just below the least plan (one sequence per forward step, one
               expert per OBS batch; computed here by kconvert.gpu.plan): refused up front
  oom-runtime  --gpu-memory 40GiB with --hog-gib (36) GiB taken in the process before the
               command starts (memory the plan does not know of): the allocator runs out
               mid-run (GPU only)
Per run: exit code, wall seconds, peak RSS, the budget (resolved in the command's process, as
the command resolves it), torch.cuda.max_memory_reserved() and max_memory_allocated() of the
command's own process and whether the peak reserved is within the budget (the wrapper: this
bench run as `--child HOG_BYTES -- ARGS` imports kconvert's command line and runs ARGS in its
own process; an atexit hook reports the figures when the command exits), the `-v` log's own
"GPU memory: peak" line, nvidia-smi's peak memory.used of the card (the CUDA context and
memory outside torch's allocator included), the command's notes and last lines, and for
conversions whether DST holds a manifest. The JSON is rewritten after every run; a run that
would start too close to --deadline-s (510 s after the start) is skipped and recorded, and the
same command line on the same (still held) machine runs only what is missing (the set and
ROOT/bench_gpu_memory.state.json are still there), writing every run to the JSON.
`--commands gptq-linears` runs int4-to-nvfp4 --method gptq --targets experts,attention,dense_mlp
(the attention and dense-MLP Hessians from forward hooks), only when named; likewise
`learned-p48` (sparsify --method learned), `learned-nvfp4` (int4-to-nvfp4 --method learned),
each at default options with its -v per-layer phase lines kept, and `calibrate-only` (their
calibration alone: 128 sequences, what they run before training).
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import sys
from pathlib import Path

from benchmarks.child_process import child_env, report, run_child
from benchmarks.gpu_sampler import GpuSampler
from benchmarks.harness import GIB, Timer, arguments, comma_list, parse, record, result_path, save
from benchmarks.synthetic import TINY, add_dims, kimi_set, random_ids, write_ids

# Rough seconds of each run on one H100 (a run is skipped when less than this is left).
EXPECT_S = {"calibrate": 35, "eval": 40, "reap": 45, "sparsify": 90, "gptq": 110,
            "gptq-linears": 120, "oom-refused": 20, "oom-runtime": 30, "learned-p48": 200,
            "learned-nvfp4": 200, "calibrate-only": 35}


def child(hog_bytes: int, argv: list[str]) -> None:
    """Run `kconvert ARGV` in this process (after taking `hog_bytes` of GPU memory); at exit
    report the budget it resolves and torch's peak reserved/allocated GPU memory."""
    import torch

    info: dict = {}
    hog = None
    if torch.cuda.is_available() and "cpu" not in argv:
        from kconvert.gpu.budget import GpuRequest, size_option

        dev = torch.device("cuda")
        spec = argv[argv.index("--gpu-memory") + 1] if "--gpu-memory" in argv else None
        # before the hog: what the command resolves
        info["budget"] = GpuRequest(dev, size_option(spec)).context.budget
        info["card_bytes"] = torch.cuda.get_device_properties(dev).total_memory
        info["hog_bytes"] = hog_bytes
        if hog_bytes:
            hog = torch.empty(hog_bytes, dtype=torch.uint8, device=dev)

    def at_exit() -> None:
        nonlocal hog
        hog = None
        report(info)

    atexit.register(at_exit)
    from kconvert.cli import exit_now, main

    try:  # as the kconvert program runs it (kconvert.cli.run): exit handlers, then the exit
        main(argv, prog_name="kconvert")
    except SystemExit as exc:
        exit_now(exc.code)


def run(name: str, argv: list[str], timeout: float, hog_bytes: int = 0,
        dst: Path | None = None) -> dict:
    with GpuSampler() as gpu:
        c = run_child([sys.executable, "-m", "benchmarks", "gpu_memory", "--child",
                       str(hog_bytes), "--", *argv], env=child_env(), timeout=timeout)
    code = "timeout" if c.timed_out else c.rc
    out = c.stdout + c.stderr
    peak = c.result
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("RESULT ")]
    got: dict = {"run": name, "argv": argv, "exit_code": code, "wall_s": round(c.wall_s, 1),
                 "peak_rss_gb": c.peak_rss_gb, **peak,
                 "notes": [ln for ln in lines if ln.startswith("note:")][-4:],
                 "peak_log": [ln for ln in lines if "GPU memory: peak" in ln][-1:],
                 # the learned method's seconds per phase and its choices (`-v`)
                 "learned_log": [ln for ln in lines if "learned written for" in ln][-3:],
                 "learned_phases_s": learned_phases(lines),
                 "errors": [ln for ln in lines if ln.startswith("kconvert: error")
                            or "internal error" in ln or "Traceback" in ln][-3:],
                 **gpu.summary()}
    reserved = c.peak_gpu_reserved_bytes
    if "budget" in peak and reserved is not None:
        got["within_budget"] = reserved <= peak["budget"]
        got["peak_reserved_gib"] = round(reserved / GIB, 2)
        got["budget_gib"] = round(peak["budget"] / GIB, 2)
    if dst is not None:
        got["manifest"] = (dst / "kconvert-manifest.json").is_file()
        shutil.rmtree(dst, ignore_errors=True)
    if name.startswith("oom-"):
        got["one_line_error"] = len(lines) == 1 and lines[0].startswith("kconvert: error:")
        got["expected"] = code == 1 and got["one_line_error"] and not got.get("manifest")
    if code != 0 and not name.startswith("oom-"):
        got["output_tail"] = out[-2000:]
    return got


def learned_phases(lines: list[str]) -> dict[str, float]:
    """The learned method's seconds per phase summed over its -v lines (one per work item:
    "one-shot 0.39 s, routing 0.00 s, data 0.06 s, train 1.01 s, guard 0.00 s"), and the
    items."""
    total: dict[str, float] = {}
    items = [ln for ln in lines if "learned written for" in ln]
    for ln in items:
        for name, seconds in re.findall(r"([a-z-]+) ([0-9.]+) s", ln.split(": ", 2)[-1]):
            total[name] = round(total.get(name, 0.0) + float(seconds), 2)
    return {**total, "items": len(items)} if items else {}


def least_budget(src: Path, samples: int, seq: int) -> int:
    """The smallest budget whose SparseGPT plan fits on this set (kconvert.gpu.plan), found
    by bisection: one sequence per forward step, one expert per OBS batch at the least."""
    from kconvert.calibrate.plan import forward
    from kconvert.common.options import BATCH_SIZE
    from kconvert.engine.execute import gpu_encode
    from kconvert.gpu.plan import GpuMemoryError, plan_conversion
    from kconvert.gpu.shapes import Shapes
    from kconvert.methods import obs_memory

    s = Shapes.from_config(json.loads((src / "config.json").read_text()))
    work = obs_memory.gpu_work(s, forward(s, samples, seq, BATCH_SIZE, capture=True), shared=False,
                        against_rtn=False)
    lo, hi = 1 << 20, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_conversion(s, mid, "sparsify", s.expert_set(), work, encode=gpu_encode())
            hi = mid
        except GpuMemoryError:
            lo = mid + 1
    return lo


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        child(int(argv[1]), argv[3:])
        return
    ap = arguments("gpu_memory", __doc__, root="/tmp/kbench", results=True, deadline_s=510)
    ap.add_argument("out", nargs="?", help="JSON results file (default: in --out-dir)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims and data on the CPU (a check), in /tmp/kbench-tiny")
    add_dims(ap, moe_layers=None)
    ap.add_argument("--seqs", type=int, default=128, help="sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--obs-samples", type=int,
                    help="calibration sequences of sparsegpt and gptq (default: 16, at most "
                         "--seqs)")
    ap.add_argument("--budgets", type=comma_list, default=["default", "40GiB"],
                    help="the --gpu-memory of each run, `default` for none "
                         "(default: default,40GiB)")
    ap.add_argument("--commands", type=comma_list,
                    help="the runs by name (default: sparsify,gptq,calibrate,eval,reap)")
    ap.add_argument("--no-oom", action="store_true", help="without the two induced failures")
    ap.add_argument("--hog-gib", type=float, default=36,
                    help="GiB taken before oom-runtime's command starts (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds each run may take (default: %(default)s)")
    args = parse(ap, argv, tiny={"dims": TINY, "seqs": 4, "seq": 32,
                                 "root": Path("/tmp/kbench-tiny")})
    timer = Timer(deadline_s=args.deadline_s)
    import torch

    root = args.root
    root.mkdir(parents=True, exist_ok=True)
    dims = args.dims
    src = kimi_set(root, dims)
    make_s = round(timer.elapsed(), 1)
    seqs, seq = args.seqs, args.seq
    obs_samples = args.obs_samples or min(16, seqs)
    data = write_ids(root / f"gpu-memory-{seqs}x{seq}.jsonl", random_ids(seqs, seq, dims.vocab))
    gpu = torch.cuda.is_available() and not args.tiny
    device = [] if gpu else ["--device", "cpu"]
    d = ["--data", str(data), "--seq-len", str(seq)]
    obs_d = [*d, "--samples", str(obs_samples)]
    out_dir = root / "gpu-memory-out"
    dsts = {name: out_dir / name for name in ("reap", "sparsify", "gptq", "gptq-linears", "oom",
                                              "learned-p48", "learned-nvfp4")}
    # the OBS commands first: the longest runs, and the ones an 80 GB card ran out of before
    commands = {
        "sparsify": ["sparsify", str(src), str(dsts["sparsify"]), "--pattern", "p48",
                     "--method", "sparsegpt", *obs_d, "--quiet"],
        "gptq": ["int4-to-nvfp4", str(src), str(dsts["gptq"]), "--method", "gptq", *obs_d,
                 "--quiet"],
        # GPTQ of every targeted Linear: attention and dense-MLP Hessians from forward hooks
        "gptq-linears": ["int4-to-nvfp4", str(src), str(dsts["gptq-linears"]), "--method",
                         "gptq", "--targets", "experts,attention,dense_mlp", *obs_d, "--quiet"],
        "calibrate": ["calibrate", str(src), *d, "-o", str(out_dir / "stats"), "--overwrite"],
        "eval": ["eval", str(src), str(src), *d, "--quiet"],
        "reap": ["reap", str(src), str(dsts["reap"]), *d, "--prune-ratio", "0.5", "--quiet"],
        # the learned methods at their default options and --samples (issue 36); their
        # calibration alone is `calibrate-only` (the same forward, statistics written)
        "learned-p48": ["sparsify", str(src), str(dsts["learned-p48"]), "--method", "learned",
                        *d],
        "learned-nvfp4": ["int4-to-nvfp4", str(src), str(dsts["learned-nvfp4"]), "--method",
                          "learned", *d],
        "calibrate-only": ["calibrate", str(src), *d, "--samples", "128", "-o",
                           str(out_dir / "stats-128"), "--overwrite"],
    }
    if args.commands:
        commands = {k: v for k, v in commands.items() if k in args.commands}
    else:  # beyond issue 26's five: asked for by name
        for name in ("gptq-linears", "learned-p48", "learned-nvfp4", "calibrate-only"):
            del commands[name]
    budgets = args.budgets
    least = least_budget(src, obs_samples, seq)
    oom = ["sparsify", str(src), str(dsts["oom"]), "--pattern", "p48", "--method", "sparsegpt",
           *obs_d, "--quiet"]
    # (name, argv, hog bytes, DST); on the CPU a budget is planned only for a dry run
    runs = [("oom-refused", [*oom, "--gpu-memory", str(least - (64 << 20)),
                             *([] if gpu else ["--dry-run"])], 0, dsts["oom"])]
    if args.no_oom:
        runs = []
    elif gpu:
        runs.append(("oom-runtime", [*oom, "--gpu-memory", "40GiB"],
                     int(args.hog_gib * GIB), dsts["oom"]))
    for name, argv_ in commands.items():
        for budget in budgets:
            extra = [] if budget == "default" else ["--gpu-memory", budget]
            runs.append((f"{name}@{budget}", [*argv_, *extra, "-v"], 0, dsts.get(name)))
    rec = record("gpu_memory", gpu=gpu, scratch=root)
    result: dict = {"record": rec, "device": rec["device"]["name"], "make_s": make_s,
                    "seqs": seqs, "seq_len": seq, "obs_samples": obs_samples,
                    "least_sparsify_budget": least, "runs": []}
    out = result_path(rec, args.out, out_dir=args.out_dir)
    # What an earlier call on this machine measured (--root survives while the machine is
    # held): the same command line goes on where --deadline-s stopped it.
    state = root / "bench_gpu_memory.state.json"
    earlier: dict = {}
    if state.is_file():
        before = json.loads(state.read_text())
        if all(before.get(k) == result[k] for k in ("device", "seqs", "seq_len", "obs_samples")):
            earlier = {r["run"]: r for r in before["runs"] if "skipped" not in r}
            result["calls"] = before.get("calls", 1) + 1
    for name, argv_, hog, dst in runs:
        if name in earlier:
            got = {**earlier[name], "earlier_call": True}
        elif gpu and timer.late(EXPECT_S[name.split("@")[0]]):
            got = {"run": name, "skipped": f"{timer.left():.0f} s left of --deadline-s "
                                           f"{timer.deadline_s:.0f}"}
        else:
            got = run(name, [*argv_, *device],
                      min(args.timeout, max(timer.left(), 30)), hog,
                      dst)
        result["runs"].append(got)
        for path in (out, state):
            save(result, path)
        print(f"{name:<22} exit {got.get('exit_code', '-')!s:<7} {got.get('wall_s', '-'):>7} s"
              f"  peak reserved {got.get('peak_reserved_gib', '-')} of "
              f"{got.get('budget_gib', '-')} GiB  nvidia-smi "
              f"{got.get('gpu_mem_used_peak_gib', '-')}"
              f"{'  ' + got['skipped'] if 'skipped' in got else ''}"
              f"{'  as expected' if got.get('expected') else ''}"
              f"{'  (an earlier call)' if got.get('earlier_call') else ''}", flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    done = [r for r in result["runs"] if "skipped" not in r]
    result["all_passed"] = len(done) == len(result["runs"]) and all(
        r["expected"] if r["run"].startswith("oom-")
        else r["exit_code"] == 0 and r.get("within_budget", True) for r in done)
    result["total_s"] = round(timer.elapsed(), 1)
    for path in (out, state):
        save(result, path)
    print(f"wrote {out} after {result['total_s']} s: "
          f"{'every run as expected' if result['all_passed'] else 'NOT ALL AS EXPECTED'}")
