"""`--stream` against its target: a conversion straight from the Hub, overlapped with the
download, takes at most 1.15x the longer of the download alone and the local conversion alone,
with at most the window of source shards on disk.

    python3 -m benchmarks stream OUT.json

On the device machine: builds the full-size synthetic Kimi-K2-Thinking shard set with
anchor_convert.py's builder (shared/bench; as `convert` does: layer 0, --moe-layers MoE
layers of 384 INT4 experts, ~9 GB a shard, and embed/lm_head), serves it from a local Hub
(kconvert.testing.hub_server, the one the tests use) throttled to --rate bytes/s over all
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

The served set sits in --src-dir (default /dev/shm/kstream-src when it has room: the server
then reads RAM, as a remote Hub would not touch this disk; else ROOT/src), downloads and
outputs in --root (default /tmp/kstream); without OUT.json the result goes to --out-dir. Disk
needed in ROOT: about twice the set (download + local output, then output + window).
--moe-layers 2 (the default) makes ~24 GB; --dims tiny checks the bench in seconds; --dims
small (a few hundred MB: MoE layers of 64 experts of 512 x 1024) suits a CPU machine, with
--rate lowered so that download and conversion take similar times. --downloads 2,1 adds a
streamed run with 1 shard downloaded at a time, under `streamed_downloads_1`. Each timed run
stops after --run-limit-s, its timeline kept. About 3-5 minutes with the defaults on an H100
machine.

Each conversion runs in-process in a child of this bench (`--child EVENTS N LIMIT -- ARGS`) that
subscribes to kconvert's timing events (kconvert.common.events) and writes them out; the JSON then
holds, under `timeline`, each run's per-shard times in seconds from the child's start: for
every source shard its download(s), sha256 verification, the first read of it (when the
engine asked for it and when it got it) and its deletion; for every output shard when it was
complete; the execute phase; the compute thread's busy seconds and the seconds it waited for
reads. `where_time_goes` sums them up: each streamed run's download rate against the download
alone's, the hashing left after each download, how long the compute thread waited for reads (for
shards to arrive) and its busy seconds against the local run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from collections import defaultdict
from pathlib import Path

from benchmarks.child_process import Child, child_env, run_child
from benchmarks.harness import (
    Timer,
    arguments,
    comma_ints,
    drop_page_cache,
    log,
    record,
    result_path,
    save,
)
from benchmarks.inprocess import run_cli
from benchmarks.synthetic import add_anchor_dims, anchor_set

REPO = "bench/kimi-synthetic"
TARGET = 1.15
TIMELINE_EVENTS = {"download", "verify", "source-wait", "source-deleted", "fsync", "phase",
                   "compute", "wait-read"}


def build_source(root: Path, res: dict, dims: str, layers: int, given: Path | None) -> Path:
    """The synthetic set, built once (anchor_convert.make_src) where the server reads it:
    `given`, else /dev/shm where it has room, else ROOT/src."""
    need = (1.5 + 9.2 * layers + 4.8) * 1e9 if dims == "full" else 1e9
    shm = Path("/dev/shm")
    default = (shm / "kstream-src" if shm.is_dir() and shutil.disk_usage(shm).free > need * 1.1
               else root / "src")
    src = given or default
    marker = src / ".built"
    if marker.is_file() and marker.read_text() == f"{dims}:{layers}":
        return src
    shutil.rmtree(src, ignore_errors=True)
    made = Timer()
    anchor_set(src, dims, layers)
    marker.write_text(f"{dims}:{layers}")
    res["build_s"] = round(made.elapsed(), 1)
    return src


def child(events_out: Path, downloads: int, limit_s: float, argv: list[str]) -> None:
    """The kconvert CLI with `argv`, in this process (`downloads` shards at once where it
    streams and that is not 0), its timeline (`timeline`) written to `events_out` as JSON."""
    kept: list[tuple[str, dict]] = []

    def listen(event: str, info: dict) -> None:
        if event in TIMELINE_EVENTS:
            kept.append((event, info))

    if "--stream" in argv:
        import kconvert.io.stream

        kconvert.io.stream.DOWNLOADS = downloads or kconvert.io.stream.DOWNLOADS
    # Past the run's limit the timeline is written all the same (SIGALRM ends the run).
    signal.signal(signal.SIGALRM, lambda *_: sys.exit(124))
    signal.alarm(int(limit_s) - 5)
    rc, t0, _ = run_cli(argv, listen)
    events_out.write_text(json.dumps(timeline(kept, t0)))
    sys.exit(rc)


def timeline(kept: list[tuple[str, dict]], t0: float) -> dict:
    """Per source shard: `download` [[start, end], ...] (one per attempt), `verify` [[start,
    end, ok], ...], `first_read` [asked, got], `deleted`; per output shard the time it was
    complete; the phases [start, end]; the compute thread's busy and read-waiting seconds.
    Times in seconds from `t0`."""
    def rel(t: float) -> float:
        return round(t - t0, 3)

    source: dict[str, dict] = defaultdict(dict)
    out: dict[str, float] = {}
    phases: dict[str, list[float]] = {}
    busy = {"compute": 0.0, "wait-read": 0.0}
    for event, info in kept:
        start, end = rel(info["start"]), rel(info["end"])
        if event == "download":
            source[info["shard"]].setdefault("download", []).append([start, end])
        elif event == "verify":
            source[info["shard"]].setdefault("verify", []).append([start, end, info["ok"]])
        elif event == "source-wait":
            source[info["shard"]]["first_read"] = [start, end]
        elif event == "source-deleted":
            source[info["shard"]]["deleted"] = end
        elif event == "fsync":
            out[info["shard"]] = end
        elif event == "phase":
            phases[info["name"]] = [start, end]
        else:
            busy[event] += info["end"] - info["start"]
    return {"source": dict(sorted(source.items())), "output_complete": dict(sorted(out.items())),
            "phases": phases, "compute_busy_s": round(busy["compute"], 2),
            "compute_waited_for_reads_s": round(busy["wait-read"], 2)}


def kconvert_args(events_out: Path, limit_s: float, argv: list[str], downloads: int = 0
                  ) -> list[str]:
    return [sys.executable, "-m", "benchmarks", "stream", "--child", str(events_out),
            str(downloads), str(limit_s), "--", *argv]


class ShardBytes:
    """The peak bytes of shards (whole or being downloaded) under a directory, sampled every
    20 ms on a thread until `finish`."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak = root, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for dirpath, _, names in os.walk(self.root):
                for name in names:
                    if name.endswith((".safetensors", ".incomplete")):
                        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                            total += os.path.getsize(os.path.join(dirpath, name))
            self.peak = max(self.peak, total)
            self.stop.wait(0.02)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {"peak_source_bytes": self.peak}


def timed(args: list[str], env: dict, limit_s: float, keep_page_cache: bool,
          sample: Path | None = None, events_out: Path | None = None) -> dict:
    """A child process, wall-timed from here, the page cache dropped first (unless
    `keep_page_cache`), stopped after `limit_s`; with `sample`, the peak bytes of shards under
    that directory while it runs; with `events_out`, the timeline the child wrote there."""
    cold = drop_page_cache(keep_page_cache) is None
    c: Child = run_child(args, env=env, timeout=limit_s,
                         watch=(lambda _pid: ShardBytes(sample)) if sample else None)
    out = {"wall_s": round(c.wall_s, 2), "rc": -9 if c.timed_out else c.rc,
           "peak_rss_gb": c.peak_rss_gb, "page_cache_dropped": cold, **c.watched}
    if out["rc"]:
        out["stderr_tail"] = c.stderr[-3000:]
    try:  # kconvert --json: its own timings
        summary = json.loads(c.stdout.strip().splitlines()[-1])
        out["timings"] = summary.get("timings")
    except (ValueError, IndexError):
        pass
    if events_out is not None and events_out.is_file():
        out["timeline"] = json.loads(events_out.read_text())
    return out


def tensor_hashes(out: Path) -> dict:
    return json.loads((out / "kconvert-manifest.json").read_text())["tensors"]


def main(argv: list[str]) -> None:
    if len(argv) > 4 and argv[0] == "--child" and argv[4] == "--":
        child(Path(argv[1]), int(argv[2]), float(argv[3]), argv[5:])
    ap = arguments("stream", __doc__, root="/tmp/kstream", results=True, page_cache=True)
    ap.add_argument("out", nargs="?", help="JSON results file (default: in --out-dir)")
    add_anchor_dims(ap, moe_layers=2)
    ap.add_argument("--src-dir", type=Path,
                    help="where the served set is built (default: /dev/shm/kstream-src when "
                         "it has room, else ROOT/src)")
    ap.add_argument("--rate", type=float, default=1e9,
                    help="the local Hub's bytes/s over all connections (default: %(default)s)")
    ap.add_argument("--window", type=int, default=3,
                    help="--stream-window of the streamed runs (default: %(default)s)")
    ap.add_argument("--device", help="the conversions' --device (default: cuda if present)")
    ap.add_argument("--downloads", type=comma_ints, default=[2],
                    help="shards downloaded at once, one streamed run each; the first is the "
                         "one the ratio is of (default: 2)")
    ap.add_argument("--run-limit-s", type=float, default=240,
                    help="each timed run at most, its timeline kept (default: %(default)s)")
    a = ap.parse_args(argv)
    from kconvert.testing.hub_server import LocalHub

    root, rate, window, downloads, limit = a.root, a.rate, a.window, a.downloads, a.run_limit_s
    root.mkdir(parents=True, exist_ok=True)
    rec = record("stream", scratch=root)
    res: dict = {"record": rec}
    result = result_path(rec, a.out, out_dir=a.out_dir).resolve()
    src = build_source(root, res, a.dims, a.moe_layers, a.src_dir)
    shards = sorted(p for p in src.glob("*.safetensors"))
    sizes = [p.stat().st_size for p in shards]
    res.update(source_bytes=sum(sizes), shards=len(sizes), rate=rate, window=window)
    log("source", src, len(sizes), "shards", sum(sizes) / 1e9, "GB")
    device = a.device or rec["device"]["kind"]
    started = Timer()
    with LocalHub({REPO: src}, rate=rate) as hub:
        res["server_start_s"] = round(started.elapsed(), 1)  # hashing every file
        hub_env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_PROGRESS_BARS": 1,
                   "HF_HUB_DISABLE_TELEMETRY": 1}
        env = child_env(**hub_env)
        kc = ["int4-to-nvfp4"]
        dl, local_out, stream_out = root / "download", root / "out-local", root / "out-stream"
        for d in (dl, local_out, stream_out, root / "hf-cache"):
            shutil.rmtree(d, ignore_errors=True)

        res["download"] = timed([sys.executable, "-c", (
            "import sys; from huggingface_hub import snapshot_download; "
            "snapshot_download(sys.argv[1], local_dir=sys.argv[2], max_workers=8)"),
            REPO, str(dl)], env, limit, a.keep_page_cache)
        log("download alone", res["download"])
        save(res, result)
        res["local"] = timed(kconvert_args(root / "events-local.json", limit, [
            *kc, str(dl), str(local_out), "--device", device, "--quiet", "--json"]), env, limit,
            a.keep_page_cache, events_out=root / "events-local.json")
        log("local conversion alone", {k: v for k, v in res["local"].items() if k != "timeline"})
        local_hashes = tensor_hashes(local_out) if res["local"]["rc"] == 0 else None
        shutil.rmtree(dl, ignore_errors=True)
        shutil.rmtree(local_out, ignore_errors=True)
        save(res, result)
        for n, at_once in enumerate(downloads):
            key = "streamed" if n == 0 else f"streamed_downloads_{at_once}"
            res[key] = timed(kconvert_args(root / "events-stream.json", limit, [
                *kc, REPO, str(stream_out), "--stream", "--stream-window", str(window),
                "--device", device, "--quiet", "--json", "--cache-dir", str(root / "hf-cache")],
                at_once), env, limit, a.keep_page_cache,
                sample=stream_out / ".kconvert" / "source",
                events_out=root / "events-stream.json")
            res[key]["downloads_at_once"] = at_once
            log(key, {k: v for k, v in res[key].items() if k != "timeline"})
            if res[key]["rc"] == 0 and local_hashes is not None:
                res[key]["same_tensors_as_local"] = tensor_hashes(stream_out) == local_hashes
            shutil.rmtree(stream_out, ignore_errors=True)
            save(res, result)
        res["same_tensors_as_local"] = res["streamed"].get("same_tensors_as_local")
    walls = [res[k]["wall_s"] for k in ("download", "local")]
    bound = sum(sorted(sizes, reverse=True)[:window])
    res["ratio"] = {
        "streamed_over_max": round(res["streamed"]["wall_s"] / max(walls), 3),
        "target": TARGET,
        "target_ok": res["streamed"]["wall_s"] <= TARGET * max(walls),
        "pipeline_bound_s": round(max(walls) + min(walls) / len(sizes), 2),
        "peak_source_bytes": res["streamed"].get("peak_source_bytes"),
        "window_bound_bytes": bound,
        "peak_ok": (res["streamed"].get("peak_source_bytes") or 0) <= bound,
    }
    res["where_time_goes"] = where_time_goes(res, sum(sizes))
    save(res, result)
    log("result", res["ratio"], "same tensors:", res.get("same_tensors_as_local"))
    log("where the time goes", res["where_time_goes"])
    for name, times in res["streamed"].get("timeline", {}).get("source", {}).items():
        log(name, times, "output complete:",
            res["streamed"]["timeline"]["output_complete"].get(name))


def where_time_goes(res: dict, nbytes: int) -> dict:
    """From the timelines: how fast the streamed run's downloads went against the download
    alone, the hashing left after them, how long its compute thread waited for reads (for
    shards, in a streamed run) and how busy it was against the local run's."""
    out: dict = {"download_alone_gb_s": round(nbytes / res["download"]["wall_s"] / 1e9, 3),
                 "local_compute_busy_s": res["local"].get("timeline", {}).get("compute_busy_s")}
    for key in [k for k in res if k.startswith("streamed")]:
        line = res[key].get("timeline")
        if not line or not line["source"]:
            continue
        shards = line["source"].values()
        starts = [d[0] for v in shards for d in v.get("download", [])]
        ends = [d[1] for v in shards for d in v.get("download", [])]
        out[key] = {
            "download_gb_s": round(nbytes / (max(ends) - min(starts)) / 1e9, 3),
            "first_download_start_s": min(starts), "last_download_end_s": max(ends),
            "verify_after_download_s": round(sum(x[1] - x[0] for v in shards
                                                 for x in v.get("verify", [])), 2),
            "compute_waited_for_reads_s": line["compute_waited_for_reads_s"],
            "compute_busy_s": line["compute_busy_s"],
            "execute_s": [round(x, 2) for x in line["phases"].get("execute", [])]}
    return out
