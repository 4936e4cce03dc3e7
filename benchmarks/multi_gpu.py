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
- reap-learned: `reap --repair router --compensate learned` on --repair-seqs sequences: rank
  0's learned compensation per MoE layer, its efficiency, output bytes against 1 rank.
- learned: `sparsify --method learned` (p48) on --gptq-seqs sequences: as gptq (rank 0's "OBS
  layer" line holds the one-shot start and the training of its experts).
- eval: the set against its `int4-to-nvfp4` conversion (made once, 1 rank) on --eval-seqs
  sequences (default 128): wall, efficiency, every metric equal to 1 rank's.
- convert: int4-to-nvfp4 of synthetic.expert_set's full-size routed experts split in --shards
  (needs ../shared/bench/anchor_convert.py as .bench/, like `convert`), page cache dropped
  before each run, bytes compared.
NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, inherited and set here).
Past --deadline-s later runs are skipped (the JSON says which).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.child_process import run_child
from benchmarks.harness import Timer, arguments, comma_ints, comma_list, parse, record, result_path
from benchmarks.multi_gpu_parts import (
    part_calibrate,
    part_convert,
    part_eval,
    part_gptq,
    part_learned,
    part_reap,
    part_reap_learned,
)
from benchmarks.multi_gpu_ranks import Bench
from benchmarks.synthetic import TINY, add_dims, kimi_set

PARTS = ("calibrate", "gptq", "learned", "reap", "reap-learned", "eval")


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
    ap.add_argument("--repair-seqs", type=int, default=16,
                    help="reap-learned's sequences (default: %(default)s: the repair stream's "
                    "32,768 tokens at --seq 2048)")
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
                              "repair_seqs": 8, "eval_seqs": 6})
    import torch

    timer = Timer(deadline_s=a.deadline_s)
    root = a.root
    root.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = rank_counts(a.ranks, torch.cuda.device_count())
    parts = a.parts
    rec = record("multi_gpu", gpu=dev == "cuda", scratch=root)
    b = Bench(root=root, ranks=ranks, dev=dev, dims=a.dims, seq=a.seq, batch=a.batch,
              tokens=a.tokens, gptq_seqs=a.gptq_seqs, repair_seqs=a.repair_seqs,
              eval_seqs=a.eval_seqs,
              n_experts=a.n_experts, shards=a.shards, eval_repeat=a.eval_repeat,
              keep_page_cache=a.keep_page_cache, timer=timer,
              out=result_path(rec, a.out, out_dir=a.out_dir),
              res={"record": rec, "device": rec["device"]["name"],
                   "gpus": rec["device"]["count"], "ranks": ranks, "calibrate": {}})
    src = None
    if set(PARTS) & set(parts):
        src = kimi_set(root, b.dims, a.moe_layers)
        run_child(["sh", "-c", f"cat {src}/*.safetensors > /dev/null"])  # page cache warm
        b.res["make_s"] = round(timer.elapsed(), 1)
    steps = {"calibrate": lambda: part_calibrate(b, src), "gptq": lambda: part_gptq(b, src),
             "learned": lambda: part_learned(b, src), "reap": lambda: part_reap(b, src),
             "reap-learned": lambda: part_reap_learned(b, src),
             "eval": lambda: part_eval(b, src), "convert": lambda: part_convert(b)}
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
    entries += [(name, res[name]) for name in (*PARTS[1:], "convert") if name in res]
    for name, entry in entries:
        cells = []
        for r in entry["runs"]:
            checks = {k: r[k] for k in ("efficiency_moe_layer", "efficiency_wall",
                                        "efficiency_learned", "same_bytes",
                                        "same_kept_experts", "same_metrics", "metrics_max_rel_diff",
                                        "repeat_max_rel_diff", "statistics", "errors")
                      if k in r}
            cells.append(f"{r['ranks']} rank(s): rc {r['rc']} wall {r['wall_s']} s MoE "
                         f"{r.get('moe_layer_s')} s {checks}")
        print(f"{name}: " + "; ".join(cells))
