"""`--stream` against its target: a conversion straight from the Hub, overlapped with the
download, takes at most 1.15x the longer of the download alone and the local conversion alone,
with at most the window of source shards on disk.

    python3 scripts/bench_stream.py OUT.json

On the device machine: builds the full-size synthetic Kimi-K2-Thinking shard set with
anchor_convert.py's builder (shared/bench; as scripts/bench_convert.py does: layer 0, MOE_LAYERS
MoE layers of 384 INT4 experts, ~9 GB a shard, and embed/lm_head), serves it from a local Hub
(kconvert.testing.hub_server, the one the tests use) throttled to RATE bytes/s over all
connections together, and measures, each in its own process with the page cache dropped first:

  download   huggingface_hub's snapshot_download of every shard into a local directory (what
             a cached run does before converting), wall seconds
  local      `kconvert int4-to-nvfp4` of that downloaded directory, wall seconds
  streamed   `kconvert int4-to-nvfp4 REPO --stream` from the local Hub, wall seconds, and the
             peak bytes of shards in its download directory (sampled every 20 ms)

then checks that both conversions wrote the same tensors (the manifests' content hashes) and
writes the JSON: the three walls, streamed / max(download, local) against 1.15, peak source
bytes against the window's bound, and pipeline_bound_s = max + min / shards (a pipeline of N
shards must download the first before converting it and convert the last after downloading
it, so few large shards cost more than the real model's 64).

The served set sits in SRC_DIR (default /dev/shm/kstream-src when it has room: the server then
reads RAM, as a remote Hub would not touch this disk; else ROOT/src), downloads and outputs in
ROOT (default /tmp/kstream). Disk needed in ROOT: about twice the set (download + local output,
then output + window). Env: MOE_LAYERS (default 2: ~24 GB), RATE (default 1e9), WINDOW (default
3), DEVICE (default cuda if present), DIMS=tiny (a check of the script in seconds),
ANCHOR_SCRIPT (as bench_convert.py). About 3-5 minutes with the defaults on an H100 machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_DIR), str(REPO_DIR / "scripts")]

from bench_convert import drop_caches, env_with, load_anchor_ns, machine  # noqa: E402

from kconvert.testing.hub_server import LocalHub  # noqa: E402

REPO = "bench/kimi-synthetic"
ROOT = Path(os.environ.get("ROOT", "/tmp/kstream"))
RATE = float(os.environ.get("RATE", "1e9"))
WINDOW = int(os.environ.get("WINDOW", "3"))
TARGET = 1.15
RES: dict = {}


def log(*a) -> None:
    print(f"[bench_stream {time.strftime('%H:%M:%S')}]", *a, flush=True)


def save(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(RES, indent=1, default=str))


def build_source() -> Path:
    """The synthetic set, built once (anchor_convert.make_src) where the server reads it."""
    os.environ.setdefault("DIMS", "full")
    os.environ.setdefault("MOE_LAYERS", "2")
    layers = int(os.environ["MOE_LAYERS"])
    full = os.environ["DIMS"] == "full"
    need = (1.5 + 9.2 * layers + 4.8) * 1e9 if full else 1e8
    shm = Path("/dev/shm")
    default = (shm / "kstream-src" if shm.is_dir() and shutil.disk_usage(shm).free > need * 1.1
               else ROOT / "src")
    src = Path(os.environ.get("SRC_DIR", default))
    marker = src / ".built"
    if marker.is_file() and marker.read_text() == f"{os.environ['DIMS']}:{layers}":
        return src
    shutil.rmtree(src, ignore_errors=True)
    t = time.perf_counter()
    ns = load_anchor_ns()
    ns["make_src"](str(src))
    marker.write_text(f"{os.environ['DIMS']}:{layers}")
    RES["build_s"] = round(time.perf_counter() - t, 1)
    return src


def timed(args: list[str], env: dict, sample: Path | None = None) -> dict:
    """A child process, wall-timed from here; with `sample`, the peak bytes of shards under
    that directory while it runs."""
    peak, stop = [0], threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            total = 0
            for dirpath, _, names in os.walk(sample):
                for name in names:
                    if name.endswith((".safetensors", ".incomplete")):
                        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                            total += os.path.getsize(os.path.join(dirpath, name))
            peak[0] = max(peak[0], total)
            stop.wait(0.02)

    cold = drop_caches()
    watcher = threading.Thread(target=sampler, daemon=True) if sample else None
    t = time.perf_counter()
    if watcher:
        watcher.start()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    stop.set()
    if watcher:
        watcher.join()
    out = {"wall_s": round(wall, 2), "rc": done.returncode, "page_cache_dropped": cold}
    if sample:
        out["peak_source_bytes"] = peak[0]
    if done.returncode:
        out["stderr_tail"] = done.stderr[-3000:]
    try:  # kconvert --json: its own timings
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        out["timings"] = summary.get("timings")
    except (ValueError, IndexError):
        pass
    return out


def tensor_hashes(out: Path) -> dict:
    return json.loads((out / "kconvert-manifest.json").read_text())["tensors"]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    result = Path(sys.argv[1]).resolve()
    RES["machine"] = machine()
    ROOT.mkdir(parents=True, exist_ok=True)
    src = build_source()
    shards = sorted(p for p in src.glob("*.safetensors"))
    sizes = [p.stat().st_size for p in shards]
    RES.update(source_bytes=sum(sizes), shards=len(sizes), rate=RATE, window=WINDOW)
    log("source", src, len(sizes), "shards", sum(sizes) / 1e9, "GB")
    device = os.environ.get("DEVICE") or ("cuda" if RES["machine"].get("gpu") else "cpu")
    t = time.perf_counter()
    with LocalHub({REPO: src}, rate=RATE) as hub:
        RES["server_start_s"] = round(time.perf_counter() - t, 1)  # hashing every file
        env = env_with(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_PROGRESS_BARS=1,
                       HF_HUB_DISABLE_TELEMETRY=1)
        kc = [sys.executable, "-m", "kconvert.cli", "int4-to-nvfp4"]
        dl, local_out, stream_out = ROOT / "download", ROOT / "out-local", ROOT / "out-stream"
        for d in (dl, local_out, stream_out, ROOT / "hf-cache"):
            shutil.rmtree(d, ignore_errors=True)

        RES["download"] = timed([sys.executable, "-c", (
            "import sys; from huggingface_hub import snapshot_download; "
            "snapshot_download(sys.argv[1], local_dir=sys.argv[2], max_workers=8)"),
            REPO, str(dl)], env)
        log("download alone", RES["download"])
        save(result)
        RES["local"] = timed([*kc, str(dl), str(local_out), "--device", device, "--quiet",
                              "--json"], env)
        log("local conversion alone", RES["local"])
        local_hashes = tensor_hashes(local_out) if RES["local"]["rc"] == 0 else None
        shutil.rmtree(dl, ignore_errors=True)
        shutil.rmtree(local_out, ignore_errors=True)
        save(result)
        RES["streamed"] = timed([*kc, REPO, str(stream_out), "--stream", "--stream-window",
                                 str(WINDOW), "--device", device, "--quiet", "--json",
                                 "--cache-dir", str(ROOT / "hf-cache")], env,
                                sample=stream_out / ".kconvert" / "source")
        log("streamed conversion", RES["streamed"])
        if RES["streamed"]["rc"] == 0 and local_hashes is not None:
            RES["same_tensors_as_local"] = tensor_hashes(stream_out) == local_hashes
        shutil.rmtree(stream_out, ignore_errors=True)
    walls = [RES[k]["wall_s"] for k in ("download", "local")]
    bound = sum(sorted(sizes, reverse=True)[:WINDOW])
    RES["ratio"] = {
        "streamed_over_max": round(RES["streamed"]["wall_s"] / max(walls), 3),
        "target": TARGET,
        "target_ok": RES["streamed"]["wall_s"] <= TARGET * max(walls),
        "pipeline_bound_s": round(max(walls) + min(walls) / len(sizes), 2),
        "peak_source_bytes": RES["streamed"].get("peak_source_bytes"),
        "window_bound_bytes": bound,
        "peak_ok": (RES["streamed"].get("peak_source_bytes") or 0) <= bound,
    }
    save(result)
    log("result", RES["ratio"], "same tensors:", RES.get("same_tensors_as_local"))


if __name__ == "__main__":
    main()
