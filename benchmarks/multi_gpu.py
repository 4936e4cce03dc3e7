"""The distributed commands with 1 and N ranks on one multi-GPU host (issue 18).

One device call on a multi-GPU kind (e.g. nvidia-h100-x2), ~8-9 minutes with the sets to build:
    ROOT=/tmp/kbench python3 -m benchmarks multi_gpu $OUT/multi_gpu.json
CPU smoke test (tiny dims, gloo, 2 ranks; a minute):
    python -m benchmarks multi_gpu --tiny /tmp/multi_gpu_tiny.json

Parts, each a `python -m kconvert` process (plain for 1 rank, torchrun for N: one rank per GPU,
NCCL), timed whole:
- calibrate: synthetic.kimi_set's full-size one-MoE-layer set (MLA, 384 INT4 experts),
  at 0.5M and 2M tokens (256 and 1024 x 2048 input_ids), page cache warm (the set is read once
  first): process wall, per-layer seconds from -v, the MoE layer's scaling efficiency
  (t1 / (N * tN)), and the statistics of N ranks against 1 (max relative difference).
- reap --data at 0.5M tokens with 1 and N ranks: the plans must keep the same experts.
- int4-to-nvfp4 on ROUTED experts of full size (synthetic.expert_set split into SHARDS
  shards; needs ../shared/bench/anchor_convert.py as .bench/, like `convert`):
  page cache dropped before each run, 1 and N ranks, bytes compared, against the concurrent
  read+write floor of the same bytes (`convert`'s `_iofloor`).
- sparsify --method sparsegpt and eval run in one process only: the bench records their
  refusal under torchrun (exit 2 for eval) on the tiny fixture rather than timing them.
NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, inherited and set here).

Env: ROOT, RANKS (default: the GPU count), N_EXPERTS (192), SHARDS (8), PARTS
(calibrate,reap,convert,refusals), DEADLINE_S (520: later parts are skipped, the JSON says so),
SEQ (2048), BATCH (8), DIMS.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.calibrate import LAYER_LINE
from benchmarks.harness import (
    REPO,
    Timer,
    arguments,
    child_env,
    drop_page_cache,
    record,
    result_path,
    run_child,
    save,
)
from benchmarks.outputs import same_output
from benchmarks.synthetic import (
    FIXTURE,
    TINY,
    Dims,
    dims_from_env,
    kimi_set,
    random_ids,
    sharded_expert_set,
    write_ids,
)

# NCCL's NVLink multicast off for every rank, as the device machines require.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Bench:
    root: Path
    ranks: int
    dev: str
    dims: Dims
    seq: int
    batch: int
    tokens: dict[str, int]
    timer: Timer
    out: Path
    res: dict

    def save(self) -> None:
        save(self.res, self.out)

    def past_deadline(self, what: str) -> bool:
        """True (and `what` recorded as skipped) once DEADLINE_S has passed."""
        if not self.timer.late():
            return False
        self.res.setdefault("skipped", []).append(what)
        return True

    def run(self, ranks: int, args: list[str], drop: bool = False) -> dict:
        """One command on `ranks` ranks: wall seconds, exit status, the -v layer lines of
        rank 0."""
        if drop:
            drop_page_cache()
        c = run_child([*launcher(ranks), *args], env=child_env(**NO_MULTICAST), cwd=REPO)
        res: dict = {"ranks": ranks, "rc": c.rc, "wall_s": round(c.wall_s, 2),
                     "peak_rss_gb": c.peak_rss_gb}
        layers = [{"layer": m["label"], "wall": float(m["wall"]), "read": float(m["read"]),
                   "compute": float(m["compute"])} for m in LAYER_LINE.finditer(c.stderr)]
        if layers:
            res["layers"] = layers
            res["moe_layer_s"] = sum(lay["wall"] for lay in layers if lay["layer"] != "layer 0")
        if c.rc:
            res["tail"] = (c.stdout[-1500:] + c.stderr[-2500:]).strip()
        return res


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
    worst = 0.0
    for name, t in one.items():
        t, u = t.double(), many[name].double()
        worst = max(worst, float(((t - u).abs() / t.abs().clamp_min(1e-30)).max()))
    return {"same_names": True, "max_rel_diff": worst}


def efficiency(one: dict, many: dict, key: str) -> float | None:
    if one.get(key) and many.get(key):
        return round(one[key] / (many["ranks"] * many[key]), 3)
    return None


def data_file(b: Bench, seqs: int) -> Path:
    data = b.root / f"ids-{seqs}x{b.seq}.jsonl"
    if not data.exists():
        write_ids(data, random_ids(seqs, b.seq, b.dims.vocab))
    return data


def part_calibrate(b: Bench, src: Path) -> None:
    for label, seqs in b.tokens.items():
        data = data_file(b, seqs)
        common = ["--data", str(data), "--samples", str(seqs), "--seq-len", str(b.seq),
                  "--batch-size", str(b.batch), "--device", b.dev, "-v"]
        runs = {}
        for ranks in (1, b.ranks):
            if b.past_deadline(f"calibrate {label} {ranks} ranks"):
                continue
            out = b.root / f"stats-{label}-{ranks}"
            runs[ranks] = b.run(ranks, ["calibrate", str(src), "-o", str(out), "--overwrite",
                                        *common])
        entry: dict = {"tokens": seqs * b.seq, "runs": list(runs.values())}
        if len(runs) == 2 and all(r["rc"] == 0 for r in runs.values()):
            one, many = runs[1], runs[b.ranks]
            entry["efficiency_moe_layer"] = efficiency(one, many, "moe_layer_s")
            entry["efficiency_wall"] = efficiency(one, many, "wall_s")
            entry["statistics"] = stats_difference(b.root / f"stats-{label}-1",
                                                   b.root / f"stats-{label}-{b.ranks}")
        b.res["calibrate"][label] = entry
        b.save()


def part_reap(b: Bench, src: Path) -> None:
    seqs = next(iter(b.tokens.values()))
    data = data_file(b, seqs)
    plans = {}
    for ranks in (1, b.ranks):
        if b.past_deadline(f"reap {ranks} ranks"):
            continue
        dst = b.root / f"reap-{ranks}"
        r = b.run(ranks, ["reap", str(src), str(dst), "--keep", str(b.dims.experts // 2),
                          "--overwrite", "--data", str(data), "--samples", str(seqs),
                          "--seq-len", str(b.seq), "--batch-size", str(b.batch), "--device",
                          b.dev, "-v"])
        if r["rc"] == 0:
            plans[ranks] = json.loads((dst / "reap-plan.json").read_text())
        shutil.rmtree(dst, ignore_errors=True)
        b.res["reap"]["runs"].append(r)
    if len(plans) == 2:
        kept = [{layer: entry["keep"] for layer, entry in p["layers"].items()} for p in
                plans.values()]
        b.res["reap"]["same_kept_experts"] = kept[0] == kept[1]
    b.save()


def part_convert(b: Bench) -> None:
    n, shards = int(os.environ.get("N_EXPERTS", "192")), int(os.environ.get("SHARDS", "8"))
    src = sharded_expert_set(b.root, n, shards)
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    b.res["convert"] = {"experts": n, "shards": shards, "source_bytes": src_bytes, "runs": []}
    outs = {}
    for ranks in (1, b.ranks):
        if b.past_deadline(f"int4-to-nvfp4 {ranks} ranks"):
            continue
        dst = b.root / f"convert-{ranks}"
        shutil.rmtree(dst, ignore_errors=True)
        b.res["convert"]["runs"].append(b.run(ranks, ["int4-to-nvfp4", str(src), str(dst),
                                                      "--device", b.dev, "--quiet"], drop=True))
        outs[ranks] = dst
        b.save()
    if len(outs) == 2:
        b.res["convert"]["same_bytes"] = same_output(outs[1], outs[b.ranks])
        dst_bytes = sum(p.stat().st_size for p in outs[1].glob("*.safetensors"))
        for d in outs.values():
            shutil.rmtree(d, ignore_errors=True)
        drop_page_cache()
        floor = run_child([sys.executable, "-m", "benchmarks", "convert", "_iofloor", src,
                           b.root / "floor", dst_bytes], env=child_env())
        b.res["convert"]["io_floor_concurrent"] = floor.result or floor.stderr[-1500:]
    b.save()


def part_refusals(b: Bench) -> None:
    """What the commands that run in one process say under torchrun (the tiny fixture)."""
    data = b.root / "refusal.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(16))}) + "\n")
    common = ["--data", str(data), "--samples", "1", "--seq-len", "16", "--device", "cpu"]
    for name, args in (("eval", ["eval", str(FIXTURE), str(FIXTURE), *common]),
                       ("sparsify_sparsegpt", ["sparsify", "--method", "sparsegpt",
                                               str(FIXTURE), str(b.root / "refused"),
                                               *common])):
        r = b.run(2, args)
        r["says"] = [ln for ln in r.pop("tail", "").splitlines() if "kconvert: error" in ln
                     or "Error:" in ln][:2]
        b.res["refusals"][name] = r
    b.save()


def main(argv: list[str]) -> None:
    ap = arguments("multi_gpu", __doc__)
    ap.add_argument("out", nargs="?", help="JSON results file (default: in OUT)")
    ap.add_argument("--tiny", action="store_true", help="tiny dims on the CPU, gloo, 2 ranks")
    a = ap.parse_args(argv)
    if a.tiny:
        os.environ.update(SEQ="32", BATCH="2")
        for k, v in (("ROOT", "/tmp/kbench-multi-tiny"), ("RANKS", "2"),
                     ("PARTS", "calibrate,reap,refusals")):
            os.environ.setdefault(k, v)
    import torch

    timer = Timer(deadline_s=float(os.environ.get("DEADLINE_S", 520)))
    root = Path(os.environ.get("ROOT", "/tmp/kbench"))
    root.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = int(os.environ.get("RANKS", max(torch.cuda.device_count(), 1)))
    parts = os.environ.get("PARTS", "calibrate,reap,convert,refusals").split(",")
    rec = record("multi_gpu", gpu=dev == "cuda", scratch=root)
    b = Bench(root=root, ranks=ranks, dev=dev, dims=TINY if a.tiny else dims_from_env(),
              seq=int(os.environ.get("SEQ", 2048)), batch=int(os.environ.get("BATCH", 8)),
              tokens={"small": 4, "large": 16} if a.tiny else {"0.5M": 256, "2M": 1024},
              timer=timer, out=result_path(rec, a.out),
              res={"record": rec, "device": rec["device"]["name"],
                   "gpus": rec["device"]["count"], "ranks": ranks, "calibrate": {},
                   "reap": {"runs": []}, "refusals": {}})
    src = None
    if {"calibrate", "reap"} & set(parts):
        src = kimi_set(root, b.dims)
        run_child(["sh", "-c", f"cat {src}/*.safetensors > /dev/null"])  # page cache warm
        b.res["make_s"] = round(timer.elapsed(), 1)
    for part in parts:
        if part == "calibrate":
            part_calibrate(b, src)
        elif part == "reap":
            part_reap(b, src)
        elif part == "convert":
            part_convert(b)
        elif part == "refusals":
            part_refusals(b)
    b.res["script_s"] = round(timer.elapsed(), 1)
    b.save()
    res = b.res
    for label, entry in res["calibrate"].items():
        print(f"calibrate {label}: " + ", ".join(f"{r['ranks']} rank(s) wall {r['wall_s']} s MoE "
                                                 f"{r.get('moe_layer_s')} s" for r in
                                                 entry["runs"])
              + f"; efficiency {entry.get('efficiency_moe_layer')}; {entry.get('statistics')}")
    print("reap:", [(r["ranks"], r["wall_s"], r["rc"]) for r in res["reap"]["runs"]],
          "same plan:", res["reap"].get("same_kept_experts"))
    if "convert" in res:
        print("convert:", [(r["ranks"], r["wall_s"], r["rc"]) for r in res["convert"]["runs"]],
              "same bytes:", res["convert"].get("same_bytes"), "floor:",
              res["convert"].get("io_floor_concurrent"))
    print("refusals:", {k: (v["rc"], v["says"]) for k, v in res["refusals"].items()})
    print("wrote", b.out)
