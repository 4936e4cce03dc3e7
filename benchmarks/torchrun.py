"""`int4-to-nvfp4` as a plain run, under `torchrun --nproc-per-node 1`, and as 2 ranks sharing
one GPU: every output byte equal, times reported (acceptance 3 of the torchrun issue).

On the device machine (one GPU; ~3 minutes, most of it building the source):
    ROOT=/tmp/kbench python3 -m benchmarks torchrun 2>&1 | tail -1 > $OUT/bench_torchrun.json
Here, on a CPU (the bundled 4-shard fixture, gloo, seconds):
    python -m benchmarks torchrun --tiny

The device set is N_EXPERTS (default 96) full-size INT4 Kimi experts, built with
synthetic.sharded_expert_set (needs anchor_convert.py, as `convert` does): SHARDS (default
4) shards of whole experts (about 2.1 GB in all).
Each run is a process of its own, timed whole (start-up included) with the page cache
dropped first where allowed. 1 rank under torchrun uses NCCL (the real collectives, world
size 1); 2 ranks on one GPU use gloo, because NCCL refuses two ranks on one device
(kconvert.distributed picks it). Prints one JSON line: per run its seconds, peak RSS and exit
status, and whether every file equals the plain run's (the manifest but for its world_size);
the same, with its record, goes to OUT.

Env: ROOT (scratch, default /tmp/kbench), N_EXPERTS, SHARDS.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from benchmarks.harness import (
    REPO,
    arguments,
    child_env,
    drop_page_cache,
    record,
    result_path,
    run_child,
    save,
)
from benchmarks.outputs import MANIFEST, same_output
from benchmarks.synthetic import FIXTURE, sharded_expert_set


def timed(cmd: list[str]) -> dict:
    drop_page_cache()
    c = run_child(cmd, env=child_env(), cwd=REPO)
    out = {"seconds": round(c.wall_s, 2), "rc": c.rc, "peak_rss_gb": c.peak_rss_gb}
    if c.rc:
        out["stderr"] = c.stderr[-2000:]
    return out


def main(argv: list[str]) -> None:
    ap = arguments("torchrun", __doc__)
    ap.add_argument("--tiny", action="store_true", help="the bundled fixture on the CPU")
    tiny = ap.parse_args(argv).tiny
    root = Path(os.environ.get("ROOT", "/tmp/kbench"))
    src = FIXTURE if tiny else sharded_expert_set(root, int(os.environ.get("N_EXPERTS", "96")),
                                                  int(os.environ.get("SHARDS", "4")))
    device = "cpu" if tiny else "cuda"
    out = root / "torchrun-out"
    shutil.rmtree(out, ignore_errors=True)
    command = ["int4-to-nvfp4", str(src), None, "--device", device, "--quiet"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    runs = {"plain": [sys.executable, "-m", "kconvert"],
            "torchrun_1": [*launch, "--nproc-per-node=1", "-m", "kconvert"],
            "torchrun_2_shared": [*launch, "--nproc-per-node=2", "-m", "kconvert"]}
    rec = record("torchrun", gpu=not tiny, scratch=root)
    result: dict = {"device": device, "source_bytes": sum(
        p.stat().st_size for p in Path(src).glob("*.safetensors"))}
    for name, prefix in runs.items():
        dst = out / name
        args = [str(dst) if a is None else a for a in command]
        result[name] = timed([*prefix, *args])
        if name != "plain" and result[name]["rc"] == 0:
            result[name]["same_as_plain"] = same_output(out / "plain", dst)
        manifest = dst / MANIFEST
        if manifest.is_file():
            result[name]["world_size"] = json.loads(manifest.read_text())["summary"].get(
                "world_size")
    print(json.dumps(result))
    save({"record": rec, **result}, result_path(rec))
