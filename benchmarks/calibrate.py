"""The data-driven commands through the CLI on one full-size synthetic Kimi MoE layer.

Builds (or reuses, when ROOT/calib-src holds it) synthetic.kimi_set's Kimi-K2-Thinking-shaped
checkpoint (layer 0 dense, layer 1 MoE with 384 INT4 experts, MLA attention, a reduced 16k
vocabulary since only the embedding lookup touches it) and SEQS x SEQ random `input_ids` as
JSONL, then runs, each as its own `python -m kconvert ... -v` process:
  calibrate cold  (page cache dropped first: `sync; echo 3 > /proc/sys/vm/drop_caches`, root)
  calibrate hot   (the same, the checkpoint now in the page cache)
  eval hot        (the source against itself: two models, each layer read and run twice)
  reap --data hot (REAP on the same tokens, keeping half the experts; output deleted after)
Per process: wall seconds, peak RSS, per decoder layer the read / compute / overlap / wall
seconds from the -v log (kconvert.calibrate.prefetch), the MoE layer's seconds and the process
wall minus the layers' time, and its breakdown (`startup`): the -v log's phases
(kconvert.calibrate.startup: imports, open checkpoint, data, model code, CUDA start,
embedding, write), the CUDA thread's seconds beside them, what ran before the first phase, the
exit (last output line to the process's end) and the rest. Targets (issue 30): MoE layer cold
<= 1.15 x hot, hot <= 6 s, process wall minus layers <= 6 s.
Before the commands (unless --no-floor; ~30 s), the floor no code of ours can cut: bare
processes that import torch and transformers' DeepSeek-V3 modules, start CUDA, and exit with
and without the interpreter's teardown, and one that pins 9.8 GB of host memory as a MoE
layer's first read does (`floor` in the JSON).

Device (H100/H200, ~3-4 min with the set to build, ~2.5 min when it exists; root for cold):
    python3 -m benchmarks calibrate $OUT/bench_calibrate_cli.json --root /tmp/kbench
CPU smoke test (tiny dims, seconds):
    python -m benchmarks calibrate --tiny /tmp/bench_calibrate_tiny.json

With --moe-layers 2 the second MoE layer shows the steady state of a whole model: its read
overlaps the first MoE layer's compute (the first's overlaps only the short dense layer 0).

--tree runs the commands of another checkout's kconvert (e.g. the previous code, for a
before/after comparison in one device run; its -v log may lack the per-layer lines and phases,
and then only process walls and exits compare). Without a file argument the result goes to
--out-dir (harness.result_path).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    REPO,
    Timer,
    arguments,
    comma_list,
    drop_page_cache,
    parse,
    record,
    result_path,
    save,
)
from benchmarks.synthetic import TINY, add_dims, kimi_set, random_ids, write_ids

# A -v line of kconvert.calibrate.prefetch:
# "<label>/<n>: read R s, compute C s, overlap O s, wall W s".
LAYER_LINE = re.compile(r"INFO: (?P<label>.+?)/\d+: read (?P<read>[\d.]+) s, compute "
                        r"(?P<compute>[\d.]+) s, overlap (?P<overlap>[\d.]+) s, wall "
                        r"(?P<wall>[\d.]+) s")
# A -v line of kconvert.calibrate.startup: "phase <name>: S s".
PHASE_LINE = re.compile(r"INFO: phase (?P<name>[\w ]+): (?P<s>[\d.]+) s")
CUDA_THREAD_LINE = re.compile(r"INFO: CUDA started on a thread in (?P<s>[\d.]+) s")
COMMANDS = ("calibrate", "eval", "reap")


def run_cli(name: str, args: list[str], tree: Path, moe_layers: int) -> dict:
    """One `python -m kconvert ARGS -v` process of `tree`: wall seconds, peak RSS, the
    per-layer lines and the start-up breakdown (each output line stamped with its arrival)."""
    # cwd=tree: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH.
    c = run_child([sys.executable, "-m", "kconvert", *args, "-v"], env=child_env(tree),
                  cwd=tree, merge=True)
    if c.rc:
        sys.stderr.write(c.output[-6000:])
        raise SystemExit(f"{name}: kconvert exited {c.rc}")
    layers = [{"layer": m["label"], **{k: float(m[k])
                                       for k in ("read", "compute", "overlap", "wall")}}
              for m in LAYER_LINE.finditer(c.output)]
    layers_s = sum(lay["wall"] for lay in layers)
    # per MoE layer (eval: the source's and the candidate's together)
    moe = [round(sum(lay["wall"] for lay in layers if lay["layer"].endswith(f"layer {L}")), 2)
           for L in range(1, moe_layers + 1)]
    return {"wall_s": round(c.wall_s, 2), "peak_rss_gb": c.peak_rss_gb, "layers": layers,
            "layers_s": round(layers_s, 2), "moe_layer_s": moe,
            "wall_minus_layers_s": round(c.wall_s - layers_s, 2),
            "startup": startup_breakdown(c.lines, c.wall_s, layers_s),
            "projection": [ln.strip() for _, ln in c.lines if "projection" in ln]}


def startup_breakdown(stamped: list[tuple[float, str]], wall: float, layers_s: float) -> dict:
    """Where the process wall outside the layers went: kconvert's logged phases (seconds on
    the main thread's path), the CUDA thread's seconds (beside it), the first phase line's
    arrival less the phases before it (interpreter, click, what ran before the command's
    first phase), the exit (last line to the process's end: the interpreter's and the CUDA
    driver's teardown) and what none of these covers."""
    phases: dict[str, float] = {}
    first_phase = None
    for t, line in stamped:
        if m := PHASE_LINE.search(line):
            phases[m["name"]] = round(phases.get(m["name"], 0.0) + float(m["s"]), 3)
            if first_phase is None:
                first_phase = t - float(m["s"])
    thread = [float(m["s"]) for _, line in stamped if (m := CUDA_THREAD_LINE.search(line))]
    exit_s = wall - stamped[-1][0] if stamped else 0.0
    return {"phases": phases, "cuda_thread_s": thread[0] if thread else None,
            "before_first_phase_s": None if first_phase is None else round(first_phase, 3),
            "exit_s": round(exit_s, 3),
            "unaccounted_s": round(wall - layers_s - sum(phases.values()) - exit_s
                                   - (first_phase or 0.0), 3)}


# The start-up floor: what torch, transformers' DeepSeek-V3 modules, CUDA and the interpreter's
# exit cost in bare processes (no kconvert), each timed from inside (perf_counter) and as a
# process wall.
FLOOR_CODE = """
import json, os, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
out = {"torch_import_s": t1 - t0}
if "model" in sys.argv:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    out["transformers_import_s"] = time.perf_counter() - t1
if "cuda" in sys.argv and torch.cuda.is_available():
    t2 = time.perf_counter()
    torch.cuda.init()
    t3 = time.perf_counter()
    torch.empty(0, device="cuda")
    t4 = time.perf_counter()
    a = torch.ones(256, 256, dtype=torch.bfloat16, device="cuda")
    float((a @ a)[0, 0])
    out.update(cuda_init_s=t3 - t2, cuda_context_s=t4 - t3,
               first_matmul_s=time.perf_counter() - t4)
if "pin" in sys.argv and torch.cuda.is_available():
    # pinned host memory the size of a full-size MoE layer's raw bytes (9.8 GB), allocated in
    # blocks as the layer reader asks for it: what the first MoE layer's read pays once
    t5 = time.perf_counter()
    blocks = [torch.empty(148 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(66)]
    out["pin_9.8GB_s"] = time.perf_counter() - t5
print(json.dumps(out), flush=True)
if "quick" in sys.argv:
    os._exit(0)
"""


def floor() -> list[dict]:
    rows = []
    for flags in (["model"], ["model", "quick"], ["model", "cuda"], ["model", "cuda", "quick"],
                  ["cuda", "pin"]):
        c = run_child([sys.executable, "-c", FLOOR_CODE, *flags])
        if c.rc:
            rows.append({"flags": flags, "error": c.stderr[-1000:]})
            continue
        inner = json.loads(c.stdout.strip().splitlines()[-1])
        rows.append({"flags": flags, "wall_s": round(c.wall_s, 3),
                     **{k: round(v, 3) for k, v in inner.items()},
                     "outside_s": round(c.wall_s - sum(inner.values()), 3)})
    return rows


def main(argv: list[str]) -> None:
    ap = arguments("calibrate", __doc__, root="/tmp/kbench", results=True)
    ap.add_argument("out", nargs="?", help="JSON results file")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims and data on the CPU (a check), in /tmp/kbench-tiny")
    add_dims(ap)
    ap.add_argument("--seqs", type=int, default=256, help="sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="--batch-size (default: %(default)s)")
    ap.add_argument("--commands", type=comma_list, default=list(COMMANDS),
                    help=f"which of {','.join(COMMANDS)} to run (default: all)")
    ap.add_argument("--hot-only", action="store_true",
                    help="no cold calibrate run (on a shared machine, where dropping the page "
                         "cache slows everyone)")
    ap.add_argument("--no-floor", action="store_true", help="skip the start-up floor")
    ap.add_argument("--tree", type=Path, default=REPO,
                    help="the checkout whose kconvert the commands run (default: this one)")
    a = parse(ap, argv, tiny={"dims": TINY, "seqs": 4, "seq": 32, "batch": 2,
                              "root": Path("/tmp/kbench-tiny")})
    import torch

    root, tree = a.root, a.tree.resolve()
    seqs, seq, batch = a.seqs, a.seq, a.batch
    dims, moe_layers = a.dims, a.moe_layers
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec = record("calibrate", gpu=dev == "cuda", tree=tree, scratch=root)
    out_json = result_path(rec, a.out, out_dir=a.out_dir)
    made = Timer()
    src = kimi_set(root, dims, moe_layers)
    data = root / f"ids-{seqs}x{seq}.jsonl"
    if not data.exists():
        write_ids(data, random_ids(seqs, seq, dims.vocab))
    res: dict = {"record": rec, "tree": str(tree), "make_s": round(made.elapsed(), 1),
                 "seqs": seqs, "seq_len": seq, "batch": batch, "tokens": seqs * seq,
                 "experts": dims.experts, "moe_layers": moe_layers,
                 "targets": {"cold_over_hot": 1.15, "moe_layer_hot_s": 6.0,
                             "wall_minus_layers_s": 6.0}}
    common = ["--data", str(data), "--samples", str(seqs), "--seq-len", str(seq),
              "--batch-size", str(batch), "--device", dev]
    calibrate = ["calibrate", str(src), "-o", str(root / "stats"), "--overwrite", *common]
    commands = a.commands
    if not a.no_floor:
        res["floor"] = floor()
    if "calibrate" in commands:
        if not a.hot_only:
            res["drop_caches_failed"] = drop_page_cache()
            res["calibrate_cold"] = run_cli("calibrate cold", calibrate, tree, moe_layers)
        res["calibrate_hot"] = run_cli("calibrate hot", calibrate, tree, moe_layers)
        if "calibrate_cold" in res:
            cold, hot = (res[k]["moe_layer_s"] for k in ("calibrate_cold", "calibrate_hot"))
            res["moe_cold_over_hot"] = [round(c / h, 3) if h else None
                                        for c, h in zip(cold, hot, strict=True)]
    if "eval" in commands:
        res["eval_hot"] = run_cli("eval", ["eval", str(src), str(src), *common], tree,
                                  moe_layers)
    if "reap" in commands:
        pruned = root / "reap-out"
        res["reap_hot"] = run_cli("reap", ["reap", str(src), str(pruned), "--keep",
                                           str(dims.experts // 2), "--overwrite", *common],
                                  tree, moe_layers)
        shutil.rmtree(pruned, ignore_errors=True)
    save(res, out_json)
    for key in ("calibrate_cold", "calibrate_hot", "eval_hot", "reap_hot"):
        if key in res:
            r = res[key]
            print(f"{key}: wall {r['wall_s']} s, layers {r['layers_s']} s, MoE layer "
                  f"{r['moe_layer_s']} s, wall - layers {r['wall_minus_layers_s']} s")
            st = r["startup"]
            print(f"  start-up: {st['phases']}, CUDA thread {st['cuda_thread_s']} s, before "
                  f"the first phase {st['before_first_phase_s']} s, exit {st['exit_s']} s, "
                  f"unaccounted {st['unaccounted_s']} s")
    for row in res.get("floor", []):
        print(f"floor {'+'.join(row['flags'])}: {row}")
    print(f"MoE layer cold/hot: {res.get('moe_cold_over_hot')}; wrote {out_json}")
