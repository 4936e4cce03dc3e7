"""Learned compensation of one full-size synthetic Kimi MoE layer, kconvert trees side by side
(issue 47: at most 60 s per layer within `--gpu-memory 74GiB`, and fitting 40GiB).

    git archive 7a98966 kconvert pipelines | (mkdir -p /tmp/old && tar -x -C /tmp/old)
    python3 -m benchmarks learned_compensation new=.,74GiB new40=.,40GiB old=/tmp/old,74GiB \
        --root /tmp/kbench --out-dir $OUT
    python -m benchmarks learned_compensation new=. old=/tmp/old --tiny    # CPU check

Builds synthetic.kimi_set's checkpoint (layer 0 dense, then --moe-layers MoE layers of 384 INT4
experts, real Kimi-K2 shapes; with 2 the last is a steady layer, the update compiled in the
first) once in ROOT, then each variant NAME=TREE[,BUDGET] runs `kconvert reap --data
--keep K --repair router --compensate learned -v` (--gpu-memory BUDGET where given) from the
kconvert package in TREE, in its own process, on --seqs x --seq random tokens (default 16 x
2,048: the repair stream's 32,768, as from any larger --data). Read per variant `learned_s`:
the last MoE layer's "learned compensation" phase from the repair's own per-phase log line (the
training of every kept expert, its encode and write-back, the guard's two passes over the
block; in a fresh process also the first compilation of the Adam update), beside the layer's
other repair phases, the process's wall and its peak GPU memory (nvidia-smi, every 200 ms).
On these random weights the guard may refuse the training (the block's held-out error does
not fall) and then nothing trained is written: the seconds are the work all the same, and
the number to read. Writes OUT_DIR/learned_compensation_<device>_<date>_<code>.json.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import torch

from benchmarks.child_process import child_env, run_child
from benchmarks.gpu_sampler import GpuSampler
from benchmarks.harness import arguments, kconvert_sha, parse, record, result_path, save
from benchmarks.synthetic import TINY, add_dims, kimi_set, random_ids, write_ids

CLI = "import sys; from kconvert.cli import main; sys.argv[0] = 'kconvert'; main()"
# the repair's log line per layer: "layer L repair: target 1.20 s, router fit 3.54 s, ..."
PHASES = re.compile(r"layer (\d+) repair: (.*)")


def phases(output: str) -> dict[int, dict[str, float]]:
    """Each layer's repair phases (seconds) from a `-v` run's output."""
    found = {}
    for layer, rest in PHASES.findall(output):
        found[int(layer)] = {name: float(secs) for name, secs in
                             re.findall(r"([a-z][a-z ]*?) ([0-9.]+) s", rest)}
    return found


def main(argv: list[str]) -> None:
    ap = arguments("learned_compensation", __doc__, root="/tmp/kbench", results=True)
    ap.add_argument("variants", nargs="+", metavar="NAME=TREE[,BUDGET]",
                    help="the runs in order, e.g. new=.,74GiB old=/tmp/old,74GiB")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny dims (24 experts) on the CPU (a check), in /tmp/kbench-tiny")
    add_dims(ap)  # --moe-layers 2: the second is a steady layer (the update compiled)
    # 16 x 2,048 tokens fill the repair stream's 32,768 (more only lengthen the calibration)
    ap.add_argument("--seqs", type=int, default=16, help="sequences (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens each (default: %(default)s)")
    ap.add_argument("--keep", type=int, default=192,
                    help="experts kept per layer (default: %(default)s)")
    a = parse(ap, argv, tiny={"seqs": 8, "seq": 64, "keep": 12,
                              "dims": dataclasses.replace(TINY, experts=24),
                              "root": Path("/tmp/kbench-tiny")})
    dev = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    rec = record("learned_compensation", gpu=dev == "cuda", scratch=a.root)
    src = kimi_set(a.root, a.dims, a.moe_layers)
    data = write_ids(a.root / "learned-compensation-ids.jsonl",
                     random_ids(a.seqs, a.seq, a.dims.vocab))
    out = result_path(rec, out_dir=a.out_dir)
    results = []
    for spec in a.variants:
        name, rest = spec.split("=", 1)
        tree_name, *budget = rest.split(",")
        tree = Path(tree_name).resolve()
        dst = a.root / f"learned-compensation-{name}"
        shutil.rmtree(dst, ignore_errors=True)
        args = ["reap", src, dst, "--data", data, "--samples", a.seqs, "--seq-len", a.seq,
                "--keep", a.keep, "--repair", "router", "--compensate", "learned",
                "--device", dev, "-v", *(["--gpu-memory", budget[0]] if budget else [])]
        c = run_child([sys.executable, "-c", CLI, *args], env=child_env(tree), cwd=tree,
                      merge=True, echo=lambda line: print(line, end="", flush=True),
                      watch=GpuSampler)
        by_layer = phases(c.stdout)
        moe = by_layer[max(by_layer)] if by_layer else {}
        r = {"variant": name, "tree": str(tree), "kconvert_sha256": kconvert_sha(tree),
             "budget": budget[0] if budget else None, "rc": c.rc, "wall_s": c.wall_s,
             "learned_s": moe.get("learned compensation"), "moe_layer_phases": moe,
             "learned_s_by_layer": {layer: p.get("learned compensation")
                                    for layer, p in sorted(by_layer.items())},
             "projection": re.findall(r".*projection.*", c.stdout)[-1:],
             "peak_gpu_mib": c.watched.get("mem_max_mib"),
             "gpu_util_mean_pct": c.watched.get("util_mean_pct")}
        if c.rc != 0:
            r["error"] = c.stdout[-2000:]
        results.append(r)
        print(json.dumps(r), flush=True)
        save({"record": rec, "device": dev, "seqs": a.seqs, "seq_len": a.seq, "keep": a.keep,
              "experts": a.dims.experts, "moe_layers": a.moe_layers, "results": results}, out)
