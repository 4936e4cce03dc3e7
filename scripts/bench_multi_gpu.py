"""Benchmark (issue 18): the distributed commands with 1 and N ranks on one multi-GPU host.

One device call on a multi-GPU kind (e.g. nvidia-h100-x2), ~8-9 minutes with the sets to build:
    ROOT=/tmp/kbench python3 scripts/bench_multi_gpu.py $OUT/multi_gpu.json
CPU smoke test (tiny dims, gloo, 2 ranks; a minute):
    python scripts/bench_multi_gpu.py --tiny /tmp/multi_gpu_tiny.json

Parts, each a `python -m kconvert` process (plain for 1 rank, torchrun for N: one rank per GPU,
NCCL), timed whole:
- calibrate: scripts/bench_calibrate.py's full-size one-MoE-layer set (MLA, 384 INT4 experts),
  at 0.5M and 2M tokens (256 and 1024 x 2048 input_ids), page cache warm (the set is read once
  first): process wall, per-layer seconds from -v, the MoE layer's scaling efficiency
  (t1 / (N * tN)), and the statistics of N ranks against 1 (max relative difference).
- reap --data at 0.5M tokens with 1 and N ranks: the plans must keep the same experts.
- int4-to-nvfp4 on ROUTED experts of full size (bench_convert.py's expert set split into
  SHARDS shards; needs ../shared/bench/anchor_convert.py as .bench/, like bench_convert.py):
  page cache dropped before each run, 1 and N ranks, bytes compared, against the concurrent
  read+write floor of the same bytes (bench_convert.py's `_iofloor`).
- sparsify --method sparsegpt and eval run in one process only: the bench records their
  refusal under torchrun (exit 2 for eval) on the tiny fixture rather than timing them.
NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, inherited and set here).

Env: ROOT, RANKS (default: the GPU count), N_EXPERTS (192), SHARDS (8), PARTS
(calibrate,reap,convert,refusals), DEADLINE_S (520: later parts are skipped, the JSON says so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:
    sys.argv.remove("--tiny")
    os.environ.update(DIMS="128,64,256,16,512,64,32,4", SEQ="32", BATCH="2")
    os.environ.setdefault("ROOT", "/tmp/kbench-multi-tiny")
    os.environ.setdefault("RANKS", "2")
    os.environ.setdefault("PARTS", "calibrate,reap,refusals")
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                  NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import bench_calibrate as calib  # noqa: E402

ROOT = calib.ROOT
RANKS = int(os.environ.get("RANKS", max(torch.cuda.device_count(), 1)))
PARTS = os.environ.get("PARTS", "calibrate,reap,convert,refusals").split(",")
DEADLINE = time.perf_counter() + float(os.environ.get("DEADLINE_S", 520))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
TOKENS = {"0.5M": 256, "2M": 1024} if not TINY else {"small": 4, "large": 16}


def launcher(ranks: int) -> list[str]:
    """Rank 0's output only: every rank logs its own -v lines."""
    if ranks == 1:
        return [sys.executable, "-m", "kconvert"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "--local-ranks-filter=0", "-m", "kconvert"]


def run(ranks: int, args: list[str], drop: bool = False) -> dict:
    """One command on `ranks` ranks: wall seconds, exit status, the -v layer lines of rank 0."""
    if drop:
        calib.drop_page_cache()
    t0 = time.perf_counter()
    proc = subprocess.run([*launcher(ranks), *args], env=ENV, cwd=REPO, capture_output=True,
                          text=True)
    res: dict = {"ranks": ranks, "rc": proc.returncode,
                 "wall_s": round(time.perf_counter() - t0, 2)}
    layers = [{"layer": m["label"], "wall": float(m["wall"]), "read": float(m["read"]),
               "compute": float(m["compute"])} for m in calib.LAYER_LINE.finditer(proc.stderr)]
    if layers:
        res["layers"] = layers
        res["moe_layer_s"] = sum(lay["wall"] for lay in layers if lay["layer"] != "layer 0")
    if proc.returncode:
        res["tail"] = (proc.stdout[-1500:] + proc.stderr[-2500:]).strip()
    return res


def past_deadline(res: dict, what: str) -> bool:
    """True (and `what` recorded as skipped) once DEADLINE_S has passed."""
    if time.perf_counter() <= DEADLINE:
        return False
    res.setdefault("skipped", []).append(what)
    return True


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


def part_calibrate(res: dict, src: Path) -> None:
    for label, seqs in TOKENS.items():
        data = ROOT / f"ids-{seqs}x{calib.SEQ}.jsonl"
        if not data.exists():
            calib.SEQS = seqs
            calib.make_data(data)
        common = ["--data", str(data), "--samples", str(seqs), "--seq-len", str(calib.SEQ),
                  "--batch-size", str(calib.BATCH), "--device", DEV, "-v"]
        runs = {}
        for ranks in (1, RANKS):
            if past_deadline(res, f"calibrate {label} {ranks} ranks"):
                continue
            out = ROOT / f"stats-{label}-{ranks}"
            runs[ranks] = run(ranks, ["calibrate", str(src), "-o", str(out), "--overwrite",
                                      *common])
        entry: dict = {"tokens": seqs * calib.SEQ, "runs": list(runs.values())}
        if len(runs) == 2 and all(r["rc"] == 0 for r in runs.values()):
            one, many = runs[1], runs[RANKS]
            entry["efficiency_moe_layer"] = efficiency(one, many, "moe_layer_s")
            entry["efficiency_wall"] = efficiency(one, many, "wall_s")
            entry["statistics"] = stats_difference(ROOT / f"stats-{label}-1",
                                                   ROOT / f"stats-{label}-{RANKS}")
        res["calibrate"][label] = entry
        save(res)


def part_reap(res: dict, src: Path) -> None:
    seqs = next(iter(TOKENS.values()))
    data = ROOT / f"ids-{seqs}x{calib.SEQ}.jsonl"
    plans = {}
    for ranks in (1, RANKS):
        if past_deadline(res, f"reap {ranks} ranks"):
            continue
        dst = ROOT / f"reap-{ranks}"
        r = run(ranks, ["reap", str(src), str(dst), "--keep", str(calib.E // 2), "--overwrite",
                        "--data", str(data), "--samples", str(seqs), "--seq-len",
                        str(calib.SEQ), "--batch-size", str(calib.BATCH), "--device", DEV, "-v"])
        if r["rc"] == 0:
            plans[ranks] = json.loads((dst / "reap-plan.json").read_text())
        subprocess.run(["rm", "-rf", str(dst)], check=False)
        res["reap"]["runs"].append(r)
    if len(plans) == 2:
        kept = [{layer: entry["keep"] for layer, entry in p["layers"].items()} for p in
                plans.values()]
        res["reap"]["same_kept_experts"] = kept[0] == kept[1]
    save(res)


def part_convert(res: dict) -> None:
    os.environ["N_EXPERTS"] = os.environ.get("N_EXPERTS", "192")
    os.environ["SHARDS"] = os.environ.get("SHARDS", "8")
    import bench_torchrun

    src = bench_torchrun.build_source()
    src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    res["convert"] = {"experts": int(os.environ["N_EXPERTS"]), "shards": int(
        os.environ["SHARDS"]), "source_bytes": src_bytes, "runs": []}
    outs = {}
    for ranks in (1, RANKS):
        if past_deadline(res, f"int4-to-nvfp4 {ranks} ranks"):
            continue
        dst = ROOT / f"convert-{ranks}"
        subprocess.run(["rm", "-rf", str(dst)], check=False)
        res["convert"]["runs"].append(run(ranks, ["int4-to-nvfp4", str(src), str(dst),
                                                  "--device", DEV, "--quiet"], drop=True))
        outs[ranks] = dst
        save(res)
    if len(outs) == 2:
        res["convert"]["same_bytes"] = bench_torchrun.same_output(outs[1], outs[RANKS])
        dst_bytes = sum(p.stat().st_size for p in outs[1].glob("*.safetensors"))
        for d in outs.values():
            subprocess.run(["rm", "-rf", str(d)], check=False)
        calib.drop_page_cache()
        floor = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_convert.py"),
                                "_iofloor", str(src), str(ROOT / "floor"), str(dst_bytes)],
                               env=ENV, capture_output=True, text=True)
        line = [ln for ln in floor.stdout.splitlines() if ln.startswith("RESULT ")]
        res["convert"]["io_floor_concurrent"] = (json.loads(line[-1][7:]) if line else
                                                 floor.stderr[-1500:])
    save(res)


def part_refusals(res: dict) -> None:
    """What the commands that run in one process say under torchrun (the tiny fixture)."""
    tiny = REPO / "tests" / "fixtures" / "tiny-k2-thinking-int4"
    data = ROOT / "refusal.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(16))}) + "\n")
    common = ["--data", str(data), "--samples", "1", "--seq-len", "16", "--device", "cpu"]
    for name, args in (("eval", ["eval", str(tiny), str(tiny), *common]),
                       ("sparsify_sparsegpt", ["sparsify", "--method", "sparsegpt", str(tiny),
                                               str(ROOT / "refused"), *common])):
        r = run(2, args)
        r["says"] = [ln for ln in r.pop("tail", "").splitlines() if "kconvert: error" in ln
                     or "Error:" in ln][:2]
        res["refusals"][name] = r
    save(res)


OUT_JSON = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "multi_gpu.json"


def save(res: dict) -> None:
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps(res, indent=1) + "\n")


def main() -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                 "gpus": torch.cuda.device_count(), "ranks": RANKS, "calibrate": {},
                 "reap": {"runs": []}, "refusals": {}}
    t0 = time.perf_counter()
    src = ROOT / "calib-src"
    if {"calibrate", "reap"} & set(PARTS):
        calib.MOE_LAYERS = 1
        if not (src / "config.json").exists():
            calib.make_checkpoint(src)
        subprocess.run(f"cat {src}/*.safetensors > /dev/null", shell=True, check=False)
        res["make_s"] = round(time.perf_counter() - t0, 1)
    for part in PARTS:
        if part == "calibrate":
            part_calibrate(res, src)
        elif part == "reap":
            part_reap(res, src)
        elif part == "convert":
            part_convert(res)
        elif part == "refusals":
            part_refusals(res)
    res["script_s"] = round(time.perf_counter() - t0, 1)
    save(res)
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
    print("wrote", OUT_JSON)


if __name__ == "__main__":
    main()
