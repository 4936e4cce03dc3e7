"""A conversion and GPTQ as a plain run, under `torchrun --nproc-per-node 1`, and as 2 ranks
sharing one GPU: every output byte equal, times reported.

On the device machine (one GPU; ~5 minutes, most of it building the sources):
    python3 -m benchmarks torchrun --root /tmp/kbench 2>&1 | tail -1 > $OUT/bench_torchrun.json
Here, on a CPU (the bundled fixture, gloo, about a minute):
    python -m benchmarks torchrun --tiny

Commands (--commands, default both):
- int4-to-nvfp4 of --n-experts (default 96) full-size INT4 Kimi experts, built with
  synthetic.sharded_expert_set (needs anchor_convert.py, as `convert` does): --shards (default
  4) shards of whole experts (about 2.1 GB in all); whole shards per rank.
- gptq: `quantize --method gptq` of synthetic.kimi_set's full-size one-MoE-layer set on
  --gptq-seqs (default 32) sequences of 2048 random tokens: the expert-parallel calibration and
  a MoE layer's shard written by both ranks (docs/many-gpus.md).
Each run is a process of its own, timed whole (start-up included) with the page cache
dropped first where allowed. 1 rank under torchrun uses NCCL (the real collectives, world
size 1); 2 ranks on one GPU use gloo, because NCCL refuses two ranks on one device
(kconvert.common.distributed picks it): the exchange then moves the GPU's rows through host memory.
Prints one JSON line: per command and run its seconds, peak RSS and exit status, and whether
every file equals the plain run's (the manifest but for its world_size); the same, with its
record, goes to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from benchmarks.child_process import child_env, run_child
from benchmarks.harness import (
    REPO,
    arguments,
    comma_list,
    drop_page_cache,
    record,
    result_path,
    save,
)
from benchmarks.outputs import MANIFEST, same_output
from benchmarks.synthetic import (
    FIXTURE,
    add_dims,
    kimi_set,
    random_ids,
    sharded_expert_set,
    write_ids,
)


def timed(cmd: list[str], keep_page_cache: bool) -> dict:
    drop_page_cache(keep_page_cache)
    c = run_child(cmd, env=child_env(), cwd=REPO)
    out = {"seconds": round(c.wall_s, 2), "rc": c.rc, "peak_rss_gb": c.peak_rss_gb}
    if c.rc:
        out["stderr"] = c.stderr[-2000:]
    return out


def commands(a: argparse.Namespace, device: str) -> dict[str, list[str | None]]:
    """Name -> its argument list, None where DST goes."""
    root, tiny = a.root, a.tiny
    out: dict[str, list[str | None]] = {}
    if "int4-to-nvfp4" in a.commands:
        src = FIXTURE if tiny else sharded_expert_set(root, a.n_experts, a.shards)
        out["int4-to-nvfp4"] = ["int4-to-nvfp4", str(src), None, "--device", device, "--quiet"]
    if "gptq" in a.commands:
        src = FIXTURE if tiny else kimi_set(root, a.dims)
        seqs, seq = (6, 16) if tiny else (a.gptq_seqs, 2048)
        vocab = 500 if tiny else a.dims.vocab
        data = write_ids(root / f"torchrun-ids-{seqs}x{seq}.jsonl",
                         random_ids(seqs, seq, vocab))
        out["gptq"] = ["quantize", "--method", "gptq", str(src), None, "--data", str(data),
                       "--samples", str(seqs), "--seq-len", str(seq), "--batch-size", "2",
                       "--device", device, "--quiet"]
    return out


def main(argv: list[str]) -> None:
    ap = arguments("torchrun", __doc__, root="/tmp/kbench", results=True, page_cache=True)
    ap.add_argument("--tiny", action="store_true", help="the bundled fixture on the CPU")
    ap.add_argument("--commands", type=comma_list, default=["int4-to-nvfp4", "gptq"],
                    help="of int4-to-nvfp4, gptq (default: both)")
    ap.add_argument("--n-experts", type=int, default=96,
                    help="routed experts of int4-to-nvfp4's set (default: %(default)s)")
    ap.add_argument("--shards", type=int, default=4,
                    help="shards of int4-to-nvfp4's set (default: %(default)s)")
    ap.add_argument("--gptq-seqs", type=int, default=32,
                    help="gptq's sequences of 2048 tokens (default: %(default)s)")
    add_dims(ap, moe_layers=None)
    a = ap.parse_args(argv)
    tiny, root = a.tiny, a.root
    root.mkdir(parents=True, exist_ok=True)
    device = "cpu" if tiny else "cuda"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    runs = {"plain": [sys.executable, "-m", "kconvert"],
            "torchrun_1": [*launch, "--nproc-per-node=1", "-m", "kconvert"],
            "torchrun_2_shared": [*launch, "--nproc-per-node=2", "-m", "kconvert"]}
    rec = record("torchrun", gpu=not tiny, scratch=root)
    result: dict = {"device": device}
    for command, args in commands(a, device).items():
        out = root / "torchrun-out" / command
        shutil.rmtree(out, ignore_errors=True)
        entry: dict = {}
        for name, prefix in runs.items():
            dst = out / name
            entry[name] = timed([*prefix, *[str(dst) if x is None else x for x in args]],
                                a.keep_page_cache)
            if name != "plain" and entry[name]["rc"] == 0:
                entry[name]["same_as_plain"] = same_output(out / "plain", dst)
            manifest = dst / MANIFEST
            if manifest.is_file():
                entry[name]["world_size"] = json.loads(manifest.read_text())["summary"].get(
                    "world_size")
        result[command] = entry
    print(json.dumps(result))
    save({"record": rec, **result}, result_path(rec, out_dir=a.out_dir))
