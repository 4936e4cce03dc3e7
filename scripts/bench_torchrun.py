"""`int4-to-nvfp4` as a plain run, under `torchrun --nproc-per-node 1`, and as 2 ranks sharing
one GPU: every output byte equal, times reported (acceptance 3 of the torchrun issue).

On the device machine (one GPU; ~3 minutes, most of it building the source):
    ROOT=/tmp/kbench python3 scripts/bench_torchrun.py 2>&1 | tail -1 > $OUT/bench_torchrun.json
Here, on a CPU (the bundled 4-shard fixture, gloo, seconds):
    python scripts/bench_torchrun.py --tiny

The device set is N_EXPERTS (default 96) full-size INT4 Kimi experts, built with
scripts/bench_convert.py's `make_expert_set` (needs its anchor_convert.py, as that script
does) and split into SHARDS (default 4) shards of whole experts (about 2.1 GB in all).
Each run is a process of its own, timed whole (start-up included) with the page cache
dropped first where allowed. 1 rank under torchrun uses NCCL (the real collectives, world
size 1); 2 ranks on one GPU use gloo, because NCCL refuses two ranks on one device
(kconvert.distributed picks it). Prints one JSON line: per run its seconds and exit status,
and whether every file equals the plain run's (the manifest but for its world_size).

Env: ROOT (scratch, default /tmp/kbench), N_EXPERTS, SHARDS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
FIXTURE = REPO / "tests" / "fixtures" / "tiny-k2-thinking-int4"
MANIFEST = "kconvert-manifest.json"


def split_shards(single: Path, dst: Path, shards: int) -> None:
    """The one-shard set `single` as `shards` shards, each holding whole experts (a fused set
    is never split) and the router in the first."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    (src_file,) = single.glob("*.safetensors")
    weight_map = {}
    with safe_open(str(src_file), framework="pt") as f:
        names = sorted(f.keys())
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {}
            for n in names:
                expert = n.split(".experts.")[1].split(".")[0] if ".experts." in n else None
                if (expert is None and s == 0) or (expert is not None
                                                   and int(expert) % shards == s):
                    part[n] = f.get_tensor(n)
            save_file(part, str(dst / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
    total = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text((single / "config.json").read_text())


def build_source() -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_convert import make_expert_set, rm

    src = ROOT / "torchrun-src"
    n, shards = int(os.environ.get("N_EXPERTS", "96")), int(os.environ.get("SHARDS", "4"))
    if not (src / "config.json").is_file():
        single = ROOT / "torchrun-single"
        make_expert_set(single, n)
        split_shards(single, src, shards)
        rm(single)
    return src


def drop_caches() -> None:
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"],
                   capture_output=True, check=False)


def timed(cmd: list[str], env: dict) -> dict:
    drop_caches()
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    out = {"seconds": round(time.perf_counter() - t0, 2), "rc": res.returncode}
    if res.returncode:
        out["stderr"] = res.stderr[-2000:]
    return out


def same_output(a: Path, b: Path) -> bool | str:
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if names_a != names_b:
        return f"files differ: {sorted(set(map(str, names_a)) ^ set(map(str, names_b)))}"
    for rel in names_a:
        if rel.name == MANIFEST:
            ma, mb = (json.loads((d / rel).read_text()) for d in (a, b))
            for m in (ma, mb):
                m["summary"].pop("world_size", None)
            if ma != mb:
                return "manifests differ beyond world_size"
        elif (a / rel).read_bytes() != (b / rel).read_bytes():
            return f"{rel} differs"
    return True


def main() -> None:
    tiny = "--tiny" in sys.argv
    src = FIXTURE if tiny else build_source()
    device = "cpu" if tiny else "cuda"
    out = ROOT / "torchrun-out"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = ["int4-to-nvfp4", str(src), None, "--device", device, "--quiet"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    runs = {"plain": [sys.executable, "-m", "kconvert"],
            "torchrun_1": [*launch, "--nproc-per-node=1", "-m", "kconvert"],
            "torchrun_2_shared": [*launch, "--nproc-per-node=2", "-m", "kconvert"]}
    result: dict = {"device": device, "source_bytes": sum(
        p.stat().st_size for p in Path(src).glob("*.safetensors"))}
    for name, prefix in runs.items():
        dst = out / name
        args = [str(dst) if a is None else a for a in command]
        result[name] = timed([*prefix, *args], env)
        if name != "plain" and result[name]["rc"] == 0:
            result[name]["same_as_plain"] = same_output(out / "plain", dst)
        manifest = dst / MANIFEST
        if manifest.is_file():
            result[name]["world_size"] = json.loads(manifest.read_text())["summary"].get(
                "world_size")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
