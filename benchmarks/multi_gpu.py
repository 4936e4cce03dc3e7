"""The data-driven commands and a conversion on 1, 2 and 4 ranks of one multi-GPU host (issue 38).

On a 4-GPU kind (nvidia-h100-x4), in two calls (one call's 10 minutes do not hold every part;
the second builds a two-MoE-layer set, ~30 s, so that GPTQ's second layer is a steady one):
    python3 -m benchmarks multi_gpu $OUT/multi_gpu_calibrate.json --root /tmp/kbench \\
        --ranks 1,2,4 --parts calibrate
    python3 -m benchmarks multi_gpu $OUT/multi_gpu_gptq.json --root /tmp/kbench \\
        --ranks 1,2,4 --parts gptq,reap,eval --moe-layers 2
CPU check (tiny dims, gloo, 1 and 2 ranks; a few minutes here):
    python -m benchmarks multi_gpu --tiny /tmp/multi_gpu_tiny.json

Each run is a `python -m kconvert` process (plain for 1 rank, torchrun for N: one rank per GPU,
NCCL), timed whole, with -v; rank 0's per-layer lines give the MoE layer's seconds. Parts, on
synthetic.kimi_set's full-size set (MLA, 384 INT4 experts; --moe-layers, default 1),
page cache warm:
- calibrate at each --tokens (default 0.5M and 2M: 256 and 1024 x 2048 input_ids): process wall,
  MoE-layer seconds, scaling efficiency t1 / (N tN) of the MoE layer and of the process, and
  the statistics of N ranks against 1 (largest relative difference, and how many tensors are
  bit-equal). `faster_than_one` says whether N ranks beat one: the crossover the -v note of an
  expert-parallel calibration is about (calibrate.expert_ranks.MIN_TOKENS_PER_RANK).
- gptq: `quantize --method gptq` on --gptq-seqs sequences (default 128 x 2048): process wall,
  MoE-layer seconds (rank 0's -v "OBS layer" line of the last MoE layer: the calibration
  forward its engine waited for, then the OBS solve of the rank's experts; with --moe-layers 2
  the second layer is a steady-state one), efficiency, output bytes against 1 rank.
- reap: `reap --data` on the first --tokens entry: wall, efficiency, same kept experts.
- eval: the set against its `int4-to-nvfp4` conversion (made once, 1 rank) on --eval-seqs
  sequences (default 128): wall, efficiency, every metric equal to 1 rank's.
- convert: int4-to-nvfp4 of synthetic.expert_set's full-size routed experts split in --shards
  (needs ../shared/bench/anchor_convert.py as .bench/, like `convert`), page cache dropped
  before each run, bytes compared.
NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, inherited and set here).
Past --deadline-s later runs are skipped (the JSON says which).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.calibrate import LAYER_LINE
from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    REPO,
    Timer,
    arguments,
    comma_ints,
    comma_list,
    drop_page_cache,
    parse,
    record,
    result_path,
    save,
)
from benchmarks.outputs import compare_dirs, same_output
from benchmarks.synthetic import (
    TINY,
    Dims,
    add_dims,
    kimi_set,
    random_ids,
    sharded_expert_set,
    write_ids,
)

# A -v line of kconvert.methods.hessians: where a MoE layer's seconds went in GPTQ/SparseGPT.
OBS_LINE = re.compile(r"INFO: OBS layer (?P<layer>\d+): (?P<waited>[\d.]+) s waiting for its "
                      r"calibration forward, (?P<solving>[\d.]+) s solving it")
# NCCL's NVLink multicast off for every rank, as the device machines require.
PARTS = ("calibrate", "gptq", "reap", "eval")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Bench:
    root: Path
    ranks: list[int]
    dev: str
    dims: Dims
    seq: int
    batch: int
    tokens: dict[str, int]  # label -> sequences
    gptq_seqs: int
    eval_seqs: int
    n_experts: int  # the convert part's set
    shards: int
    eval_repeat: bool
    keep_page_cache: bool
    timer: Timer
    out: Path
    res: dict

    def save(self) -> None:
        save(self.res, self.out)

    def past_deadline(self, what: str) -> bool:
        """True (and `what` recorded as skipped) once --deadline-s has passed."""
        if not self.timer.late():
            return False
        self.res.setdefault("skipped", []).append(what)
        return True

    def run(self, ranks: int, args: list[str], drop: bool = False) -> dict:
        """One command on `ranks` ranks: wall seconds, exit status, the -v layer lines of
        rank 0 and the MoE layers' seconds."""
        if drop:
            drop_page_cache(self.keep_page_cache)
        c = run_child([*launcher(ranks), *args], env=child_env(**NO_MULTICAST), cwd=REPO)
        res: dict = {"ranks": ranks, "rc": c.rc, "wall_s": round(c.wall_s, 2),
                     "peak_rss_gb": c.peak_rss_gb}
        layers = [{"layer": m["label"], "wall": float(m["wall"]), "read": float(m["read"]),
                   "compute": float(m["compute"])} for m in LAYER_LINE.finditer(c.stderr)]
        if layers:
            res["layers"] = layers
            res["moe_layer_s"] = round(sum(lay["wall"] for lay in layers
                                           if not lay["layer"].endswith("layer 0")), 2)
        obs = [{"layer": int(m["layer"]), "waited": float(m["waited"]),
                "solving": float(m["solving"])} for m in OBS_LINE.finditer(c.stderr)]
        if obs:
            # the last MoE layer's: the forward its engine waited for and its solve (with one
            # MoE layer the wait holds the start-up and layer 0 too: --moe-layers 2 for GPTQ)
            res["obs_layers"] = obs
            res["moe_layer_s"] = round(obs[-1]["waited"] + obs[-1]["solving"], 2)
        notes = [ln.strip() for ln in c.stderr.splitlines() if "one process may be as fast" in ln]
        if notes:
            res["note"] = notes[0]
        if c.rc:
            res["errors"] = [ln.strip() for ln in c.stderr.splitlines()
                             if "error" in ln.lower() and "elastic" not in ln][:6]
            res["tail"] = (c.stdout[-1500:] + c.stderr[-2500:]).strip()
        return res

    def each_rank_count(self, what: str, run) -> dict[int, dict]:
        """`run(ranks)` for every rank count not past the deadline -> its result."""
        out = {}
        for ranks in self.ranks:
            if not self.past_deadline(f"{what} {ranks} ranks"):
                out[ranks] = run(ranks)
        return out


def launcher(ranks: int) -> list[str]:
    """Rank 0's output only: every rank logs its own -v lines."""
    if ranks == 1:
        return [sys.executable, "-m", "kconvert"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "--local-ranks-filter=0", "-m", "kconvert"]


def stats_difference(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    one, many = load_file(str(a / "stats.safetensors")), load_file(str(b / "stats.safetensors"))
    if sorted(one) != sorted(many):
        return {"same_names": False}
    worst, equal = 0.0, 0
    for name, t in one.items():
        equal += bool(t.equal(many[name]))
        t, u = t.double(), many[name].double()
        worst = max(worst, float(((t - u).abs() / t.abs().clamp_min(1e-30)).max()))
    return {"same_names": True, "max_rel_diff": worst, "bit_equal": equal, "tensors": len(one)}


def differences(a: Path, b: Path) -> dict:
    """Which files of two outputs differ: the manifest's differing keys, per shard how many
    tensors differ and one of them."""
    found = compare_dirs(a, b)
    brief = {}
    for name, what in found["different"].items():
        if isinstance(what, dict):
            first = next(iter(what))
            what = {"tensors_differ": len(what), "first": first, "detail": what[first]}
        brief[name] = what
    return {"files": found["files"], "identical": found["identical"], "different": brief}


def largest_difference(one: object, many: object) -> float:
    """The largest relative difference between the numbers of two reports of the same shape."""
    if isinstance(one, dict):
        return max((largest_difference(one[k], many[k]) for k in one if k in many), default=0.0)
    if isinstance(one, (list, tuple)):
        return max((largest_difference(a, b) for a, b in zip(one, many, strict=True)), default=0.0)
    if isinstance(one, (int, float)) and isinstance(many, (int, float)) and one != many:
        return abs(one - many) / max(abs(one), abs(many), 1e-30)
    return 0.0


def scaling(runs: dict[int, dict]) -> None:
    """Per run of N > 1 ranks: efficiency t1 / (N tN) of the MoE layer and of the process, and
    whether it beat one rank."""
    one = runs.get(1)
    for ranks, r in runs.items():
        if ranks == 1 or one is None or r["rc"] or one["rc"]:
            continue
        for key in ("moe_layer_s", "wall_s"):
            if one.get(key) and r.get(key):
                r[f"efficiency_{key.removesuffix('_s')}"] = round(one[key] / (ranks * r[key]), 3)
        r["faster_than_one"] = r["wall_s"] < one["wall_s"]


def data_file(b: Bench, seqs: int) -> Path:
    data = b.root / f"ids-{seqs}x{b.seq}.jsonl"
    if not data.exists():
        write_ids(data, random_ids(seqs, b.seq, b.dims.vocab))
    return data


def calib_args(b: Bench, seqs: int) -> list[str]:
    return ["--data", str(data_file(b, seqs)), "--samples", str(seqs), "--seq-len", str(b.seq),
            "--batch-size", str(b.batch), "--device", b.dev, "-v"]


def part_calibrate(b: Bench, src: Path) -> None:
    for label, seqs in b.tokens.items():
        runs = b.each_rank_count(f"calibrate {label}", lambda ranks, label=label, seqs=seqs: b.run(
            ranks, ["calibrate", str(src), "-o", str(b.root / f"stats-{label}-{ranks}"),
                    "--overwrite", *calib_args(b, seqs)]))
        scaling(runs)
        for ranks, r in runs.items():
            if ranks > 1 and r["rc"] == 0 and runs.get(1, {}).get("rc") == 0:
                r["statistics"] = stats_difference(b.root / f"stats-{label}-1",
                                                   b.root / f"stats-{label}-{ranks}")
        b.res["calibrate"][label] = {"tokens": seqs * b.seq, "runs": list(runs.values())}
        b.save()


def part_gptq(b: Bench, src: Path) -> None:
    outs = {}

    def run(ranks: int) -> dict:
        dst = outs[ranks] = b.root / f"gptq-{ranks}"
        shutil.rmtree(dst, ignore_errors=True)
        return b.run(ranks, ["quantize", "--method", "gptq", str(src), str(dst), "--quiet",
                             *calib_args(b, b.gptq_seqs)])

    runs = b.each_rank_count("gptq", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and r["rc"] == 0 and runs.get(1, {}).get("rc") == 0:
            r["same_bytes"] = same_output(outs[1], outs[ranks])
            if r["same_bytes"] is not True:
                r["differences"] = differences(outs[1], outs[ranks])
    for dst in outs.values():
        shutil.rmtree(dst, ignore_errors=True)
    b.res["gptq"] = {"tokens": b.gptq_seqs * b.seq, "runs": list(runs.values())}
    b.save()


def part_reap(b: Bench, src: Path) -> None:
    seqs = next(iter(b.tokens.values()))
    plans = {}

    def run(ranks: int) -> dict:
        dst = b.root / f"reap-{ranks}"
        r = b.run(ranks, ["reap", str(src), str(dst), "--keep", str(b.dims.experts // 2),
                          "--overwrite", "--quiet", *calib_args(b, seqs)])
        if r["rc"] == 0:
            plan = json.loads((dst / "reap-plan.json").read_text())
            plans[ranks] = {layer: entry["keep"] for layer, entry in plan["layers"].items()}
        shutil.rmtree(dst, ignore_errors=True)
        return r

    runs = b.each_rank_count("reap", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and ranks in plans and 1 in plans:
            r["same_kept_experts"] = plans[ranks] == plans[1]
    b.res["reap"] = {"tokens": seqs * b.seq, "runs": list(runs.values())}
    b.save()


def part_eval(b: Bench, src: Path) -> None:
    candidate = b.root / "eval-candidate"
    if not (candidate / "kconvert-manifest.json").exists():
        shutil.rmtree(candidate, ignore_errors=True)
        made = b.run(1, ["int4-to-nvfp4", str(src), str(candidate), "--device", b.dev,
                         "--quiet"])
        b.res["eval_candidate"] = made
    reports = {}

    def run(ranks: int) -> dict:
        out = b.root / f"eval-{ranks}"
        r = b.run(ranks, ["eval", str(src), str(candidate), "-o", str(out), "--quiet",
                          *calib_args(b, b.eval_seqs)])
        if r["rc"] == 0:
            report = json.loads((out / "eval.json").read_text())
            reports[ranks] = [(c["logits"], c["layers"]) for c in report["candidates"]]
        return r

    runs = b.each_rank_count("eval", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and ranks in reports and 1 in reports:
            r["same_metrics"] = reports[ranks] == reports[1]
            r["metrics_max_rel_diff"] = largest_difference(reports[1], reports[ranks])
    if 1 in reports and b.eval_repeat:
        # the same 1-rank run again: a difference here is the device's, not the ranks'
        first = reports[1]
        runs[1]["repeat_max_rel_diff"] = (largest_difference(first, reports[1])
                                          if run(1)["rc"] == 0 else None)
    b.res["eval"] = {"tokens": b.eval_seqs * b.seq, "runs": list(runs.values())}
    b.save()


def part_convert(b: Bench) -> None:
    n, shards = b.n_experts, b.shards
    src = sharded_expert_set(b.root, n, shards)
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    outs = {}

    def run(ranks: int) -> dict:
        dst = outs[ranks] = b.root / f"convert-{ranks}"
        shutil.rmtree(dst, ignore_errors=True)
        return b.run(ranks, ["int4-to-nvfp4", str(src), str(dst), "--device", b.dev,
                             "--quiet"], drop=True)

    runs = b.each_rank_count("int4-to-nvfp4", run)
    scaling(runs)
    for ranks, r in runs.items():
        if ranks > 1 and 1 in outs and r["rc"] == 0:
            r["same_bytes"] = same_output(outs[1], outs[ranks])
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
    b.res["convert"] = {"experts": n, "shards": shards, "source_bytes": src_bytes,
                        "runs": list(runs.values())}
    b.save()


def rank_counts(given: list[int] | None, gpus: int) -> list[int]:
    """`given` (--ranks), else 1, 2, 4 up to the GPU count (at least 1 and 2: gloo on a CPU)."""
    return given or [n for n in (1, 2, 4) if n <= max(gpus, 2)]


def main(argv: list[str]) -> None:
    ap = arguments("multi_gpu", __doc__, root="/tmp/kbench", results=True, page_cache=True,
                   deadline_s=540)
    ap.add_argument("out", nargs="?", help="JSON results file (default: in --out-dir)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU, gloo, 1 and 2 "
                    "ranks, in /tmp/kbench-multi-tiny")
    add_dims(ap)
    ap.add_argument("--ranks", type=comma_ints,
                    help="rank counts (default: 1,2,4 up to the GPU count, at least 1,2)")
    ap.add_argument("--parts", type=comma_list, default=list(PARTS),
                    help=f"of {','.join(PARTS)}, convert (default: {','.join(PARTS)})")
    ap.add_argument("--tokens", type=tokens_option, default={"0.5M": 256, "2M": 1024},
                    help="calibration sizes as label:sequences,... (default: 0.5M:256,2M:1024)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default: %(default)s)")
    ap.add_argument("--gptq-seqs", type=int, default=128,
                    help="gptq's sequences (default: %(default)s)")
    ap.add_argument("--eval-seqs", type=int, default=128,
                    help="eval's sequences (default: %(default)s)")
    ap.add_argument("--eval-repeat", action="store_true",
                    help="run eval on 1 rank twice (the device's own difference)")
    ap.add_argument("--n-experts", type=int, default=192,
                    help="routed experts of the convert part's set (default: %(default)s)")
    ap.add_argument("--shards", type=int, default=8,
                    help="shards of the convert part's set (default: %(default)s)")
    a = parse(ap, argv, tiny={"root": Path("/tmp/kbench-multi-tiny"), "ranks": [1, 2],
                              "dims": TINY, "seq": 32, "batch": 2,
                              "tokens": {"small": 4, "large": 16}, "gptq_seqs": 8,
                              "eval_seqs": 6})
    import torch

    timer = Timer(deadline_s=a.deadline_s)
    root = a.root
    root.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = rank_counts(a.ranks, torch.cuda.device_count())
    parts = a.parts
    rec = record("multi_gpu", gpu=dev == "cuda", scratch=root)
    b = Bench(root=root, ranks=ranks, dev=dev, dims=a.dims, seq=a.seq, batch=a.batch,
              tokens=a.tokens, gptq_seqs=a.gptq_seqs, eval_seqs=a.eval_seqs,
              n_experts=a.n_experts, shards=a.shards, eval_repeat=a.eval_repeat,
              keep_page_cache=a.keep_page_cache, timer=timer,
              out=result_path(rec, a.out, out_dir=a.out_dir),
              res={"record": rec, "device": rec["device"]["name"],
                   "gpus": rec["device"]["count"], "ranks": ranks, "calibrate": {}})
    src = None
    if {"calibrate", "gptq", "reap", "eval"} & set(parts):
        src = kimi_set(root, b.dims, a.moe_layers)
        run_child(["sh", "-c", f"cat {src}/*.safetensors > /dev/null"])  # page cache warm
        b.res["make_s"] = round(timer.elapsed(), 1)
    steps = {"calibrate": lambda: part_calibrate(b, src), "gptq": lambda: part_gptq(b, src),
             "reap": lambda: part_reap(b, src), "eval": lambda: part_eval(b, src),
             "convert": lambda: part_convert(b)}
    for part in parts:
        steps[part]()
    b.res["script_s"] = round(timer.elapsed(), 1)
    b.save()
    summarize(b.res)
    print("wrote", b.out)


def tokens_option(text: str) -> dict[str, int]:
    """An argparse type: `0.5M:256,2M:1024` as {"0.5M": 256, "2M": 1024}."""
    return {label: int(n) for label, n in (item.split(":") for item in comma_list(text))}


def summarize(res: dict) -> None:
    """One line per part: each rank count's wall and MoE-layer seconds, and the checks."""
    entries = [(f"calibrate {label}", e) for label, e in res["calibrate"].items()]
    entries += [(name, res[name]) for name in ("gptq", "reap", "eval", "convert") if name in res]
    for name, entry in entries:
        cells = []
        for r in entry["runs"]:
            checks = {k: r[k] for k in ("efficiency_moe_layer", "efficiency_wall", "same_bytes",
                                        "same_kept_experts", "same_metrics", "metrics_max_rel_diff",
                                        "repeat_max_rel_diff", "statistics", "errors")
                      if k in r}
            cells.append(f"{r['ranks']} rank(s): rc {r['rc']} wall {r['wall_s']} s MoE "
                         f"{r.get('moe_layer_s')} s {checks}")
        print(f"{name}: " + "; ".join(cells))
