"""`--stream`: a Hub repo's shards downloaded during the run, against a real HTTP server on
127.0.0.1 that speaks the Hub's API (kconvert.testing.hub_server) with huggingface_hub's own
client code unmodified (its endpoint constants pointed at the server). The server drops
connections, serves a wrong byte or stalls on request; a sampler thread watches the download
directory. Every streamed output is compared byte for byte with the same conversion of the
same files as a local directory."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants, hf_hub_download
from safetensors.torch import save_file

import kconvert
from helpers import CLI, INDEX, MANIFEST, cli_subprocess, file_tensors, snapshot
from kconvert.common import events
from kconvert.common.options import STREAM_WINDOW
from kconvert.driver.recipes import build_stages, load_recipe
from kconvert.engine.source_order import source_order
from kconvert.engine.work import build_work_plan
from kconvert.errors import KconvertError, UsageError
from kconvert.io.checkpoint import open_checkpoint
from kconvert.io.stream import SOURCE_DIR, window_bytes
from kconvert.testing.hub_server import COMMIT, LocalHub

REPO = "kimi/tiny"
SPLIT = "kimi/split"
LAYERS = 4  # MoE layers: 6 shards


def shard(i: int, n: int = LAYERS + 2) -> str:
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def split_module(src: Path, dst: Path) -> Path:
    """`src` with parameters moved into the next layer's shard: expert 0's up_proj
    weight_scale (a module whose parameters span two shards) and expert 1's whole up_proj (a
    gate/up fused set whose members do)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    a, b = shard(2), shard(3)
    first, second = file_tensors(dst / a), file_tensors(dst / b)
    moved = [n for n in first if ".mlp.experts.0.up_proj.weight_scale" in n
             or ".mlp.experts.1.up_proj." in n]
    assert len(moved) == 4
    for name in moved:
        second[name] = first.pop(name)
        index["weight_map"][name] = b
    save_file(first, str(dst / a), metadata={"format": "pt"})
    save_file(second, str(dst / b), metadata={"format": "pt"})
    (dst / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True))
    return dst


@pytest.fixture(scope="module")
def sources(fixture_dir, tmp_path_factory) -> dict[str, Path]:
    src = fixture_dir("k2-int4-kimi", moe_layers=LAYERS)
    return {REPO: src, SPLIT: split_module(src, tmp_path_factory.mktemp("split") / "split")}


@pytest.fixture(scope="module")
def server(sources):
    with LocalHub(sources, rate=4e6) as hub:  # ~0.1 s a shard: the sampler sees each
        yield hub


@pytest.fixture(scope="module")
def local(sources, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The same conversion of each repo's files as a local directory (manifest aside)."""
    out = {}
    for repo, src in sources.items():
        dst = tmp_path_factory.mktemp("local") / "out"
        kconvert.int4_to_nvfp4(str(src), str(dst), device="cpu")
        out[repo] = without_manifest(dst)
    return out


@pytest.fixture
def hub(server, monkeypatch):
    """huggingface_hub pointed at the server (as HF_ENDPOINT would at import); small download
    chunks, so that a connection dropped mid-file resumes with a range request."""
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 32 << 10)
    server.faults.clear()
    server.requests.clear()
    return server


def downloads(hub: LocalHub, name: str) -> list:
    """The GETs of a whole file (a header read is a range request from byte 0)."""
    return [r for r in hub.gets(name) if r.start is None]


def fetched_shards(hub: LocalHub) -> set[str]:
    return {r.path for r in hub.requests if r.method == "GET" and r.start is None
            and r.path.endswith(".safetensors")}


def without_manifest(root: Path) -> dict[str, str]:
    return {k: v for k, v in snapshot(root).items() if k != MANIFEST}


class Sampler:
    """The shard bytes under a download directory, every millisecond, from another thread."""

    def __init__(self, where: Path):
        self.where, self.peak, self.most_files = where, 0, 0
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while self.running:
            files = {}
            for dirpath, _, names in os.walk(self.where):
                for name in names:
                    # A shard, or its download in progress (huggingface_hub's bookkeeping
                    # beside them, a few hundred bytes, is not shard bytes).
                    if name.endswith((".safetensors", ".incomplete")):
                        try:
                            files[name] = os.path.getsize(os.path.join(dirpath, name))
                        except FileNotFoundError:
                            continue
            self.peak = max(self.peak, sum(files.values()))
            self.most_files = max(self.most_files, len(files))
            time.sleep(0.001)

    def stop(self) -> Sampler:
        self.running = False
        self.thread.join()
        return self


def streamed(repo: str, dst: Path, **kwargs):
    return kconvert.int4_to_nvfp4(repo, str(dst), device="cpu", stream=True,
                                  cache_dir=str(dst.parent / "hf-cache"), **kwargs)


def shard_sizes(src: Path) -> list[int]:
    return [p.stat().st_size for p in src.glob("*.safetensors")]


def test_streamed_run_is_the_local_run_with_the_window_on_disk(hub, sources, local, tmp_path,
                                                               seen):
    dst = tmp_path / "out"
    sampler = Sampler(dst / ".kconvert" / SOURCE_DIR)
    result = streamed(REPO, dst, stream_window=2)
    sampler.stop()
    assert without_manifest(dst) == local[REPO]
    assert result.manifest.source.model_dump(exclude_none=True) == {
        "repo": REPO, "revision": "main", "commit": COMMIT}
    # Every shard went through the download directory and was deleted there (the run's own
    # events: sampling may miss one that came and went between two samples), never more than
    # 2 at once (the sampler's bound holds whatever it missed); it is gone at the end, and each
    # shard was fetched once.
    deleted = sorted(i["shard"] for e, i in seen if e == "source-deleted")
    assert deleted == [shard(i) for i in range(1, 7)], deleted
    assert 0 < sampler.peak <= window_bytes(shard_sizes(sources[REPO]), 2)
    assert sampler.most_files <= 2
    assert sampler.peak < sum(shard_sizes(sources[REPO])) / 2
    assert not (dst / ".kconvert").exists()
    for i in range(1, 7):
        assert len(downloads(hub, shard(i))) == 1


@pytest.fixture
def seen():
    """The timing events of the test's runs (kconvert.common.events), in order."""
    got: list[tuple[str, dict]] = []
    unsubscribe = events.subscribe(lambda e, info: got.append((e, info)), timings=True)
    yield got
    unsubscribe()


def test_downloads_run_ahead_of_the_conversion(hub, local, tmp_path, seen, monkeypatch):
    """From the run's own events: the conversion starts on shard 1 while later shards are
    still downloading, each next shard's download starts before the shard before it is
    converted, and every shard is hashed as it downloads (not read again after). The link is
    slowed to ~0.3 s a shard, so that the worker sees each download in progress even on a
    busy machine (one that ends before it looks is hashed again, and the test says so)."""
    monkeypatch.setattr(hub, "rate", 1e6)
    streamed(REPO, tmp_path / "out", stream_window=LAYERS + 2)
    assert without_manifest(tmp_path / "out") == local[REPO]
    downloads = {i["shard"]: i for e, i in seen if e == "download"}
    verified = {i["shard"]: i for e, i in seen if e == "verify"}
    complete = {i["shard"]: i["end"] for e, i in seen if e == "fsync"}
    names = [shard(i) for i in range(1, LAYERS + 3)]
    assert sorted(downloads) == sorted(verified) == names
    assert all(v["ok"] and v["followed"] for v in verified.values())
    first_compute = min(i["start"] for e, i in seen if e == "compute")
    assert first_compute < max(d["end"] for d in downloads.values())
    for before, after in itertools.pairwise(names):
        assert downloads[after]["start"] < complete[before]


def test_parameters_and_fused_sets_across_shards(hub, local, tmp_path):
    """Modules and fused sets whose parameters lie in two shards: both shards are on disk
    when they are converted (a window of 1 is raised to the 2 the plan needs, and said)."""
    messages = []
    streamed(SPLIT, tmp_path / "out", stream_window=1, echo=messages.append)
    assert without_manifest(tmp_path / "out") == local[SPLIT]
    assert any("--stream-window 1 is too small for this plan: items read 2 shards at once"
               in m for m in messages)


def test_source_order_follows_the_shards(sources):
    for repo, least in ((REPO, 1), (SPLIT, 2)):
        ckpt = open_checkpoint(str(sources[repo]))
        try:
            plan = build_work_plan(ckpt, build_stages(load_recipe("int4-to-nvfp4"), {}, {}),
                                   1 << 24)
            order = source_order(plan, ())
            assert order.shards == ckpt.shards
            assert order.min_window == least
            assert order.readers[shard(3)] == ({shard(2), shard(3)} if repo == SPLIT
                                               else {shard(3)})
            # Output shards already complete: their sources are not needed again.
            rest = source_order(plan, {shard(1), shard(2)})
            assert rest.shards == ckpt.shards[2:]
        finally:
            ckpt.close()


def test_dropped_connection_resumes_with_a_range_request(hub, local, tmp_path, seen):
    hub.fault(shard(3), drop_after=100_000)
    streamed(REPO, tmp_path / "out")
    assert without_manifest(tmp_path / "out") == local[REPO]
    gets = [r.start for r in hub.gets(shard(3))]
    # The header read (range from 0), the cut download, then its rest from where it was cut.
    assert gets[0] == 0 and gets[1] is None and len(gets) == 3 and 0 < gets[2] <= 100_000
    # A download that huggingface_hub resumed is hashed again from disk, not as it landed.
    verified = {i["shard"]: i for e, i in seen if e == "verify"}
    assert verified[shard(3)]["ok"] and not verified[shard(3)]["followed"]


def test_stalled_download_times_out_and_resumes(hub, local, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    hub.fault(shard(6), stall=3)
    streamed(REPO, tmp_path / "out")
    assert without_manifest(tmp_path / "out") == local[REPO]
    assert len(downloads(hub, shard(6))) == 2


def test_wrong_byte_is_refused_naming_the_file(hub, tmp_path):
    hub.fault(shard(4), wrong_byte=300_000, times=10)
    dst = tmp_path / "out"
    with pytest.raises(KconvertError, match=rf"downloaded shard does not match the Hub's sha256 "
                       rf"[0-9a-f]{{64}} \(got [0-9a-f]{{64}}\) in 3 downloads; it was not "
                       rf"converted.*\(file {REPO}@{COMMIT}/{shard(4)}\)"):
        streamed(REPO, dst)
    assert not (dst / MANIFEST).exists()
    assert not (dst / shard(4)).exists()  # its output shard never complete
    assert not (dst / ".kconvert" / SOURCE_DIR / shard(4)).exists()
    assert len(downloads(hub, shard(4))) == 3


def test_a_wrong_byte_once_is_downloaded_again(hub, local, tmp_path):
    hub.fault(shard(2), wrong_byte=10, times=1)
    streamed(REPO, tmp_path / "out")
    assert without_manifest(tmp_path / "out") == local[REPO]
    assert len(downloads(hub, shard(2))) == 2


def test_the_users_cache_is_read_in_place_and_kept(hub, local, tmp_path):
    cache = tmp_path / "hf-cache"
    kept = {i: Path(hf_hub_download(REPO, shard(i), cache_dir=str(cache))) for i in (2, 5)}
    before = snapshot(cache)
    hub.requests.clear()
    streamed(REPO, tmp_path / "out")
    assert without_manifest(tmp_path / "out") == local[REPO]
    after = snapshot(cache)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing deleted
    assert all(p.is_file() for p in kept.values())
    for i in range(1, 7):  # cached shards: not fetched, not even their headers
        assert len(hub.gets(shard(i))) == (0 if i in kept else 2)


def test_killed_mid_run_resumes_with_what_it_still_needs(hub, local, tmp_path):
    dst = tmp_path / "out"
    hub.fault(shard(5), stall=60)  # the run waits there; it is killed meanwhile
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DOWNLOAD_TIMEOUT": "120",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(Path.cwd())}
    args = ["int4-to-nvfp4", REPO, str(dst), "--stream", "--stream-window", "2", "--device",
            "cpu", "--quiet", "--cache-dir", str(tmp_path / "hf-cache")]
    run = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    records = dst / ".kconvert" / "done"
    deadline = time.monotonic() + 120
    while len(list(records.glob("*.json"))) < 3 and time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    done = {p.stem for p in records.glob("*.json")}
    assert {shard(1), shard(2), shard(3)} <= done and not (dst / MANIFEST).exists()
    # Downloads complete when it was killed are verified and used, not fetched again.
    present = {p.name for p in (dst / ".kconvert" / SOURCE_DIR).glob("*.safetensors")}
    hub.faults.clear()
    hub.requests.clear()
    streamed(REPO, dst, resume=True)
    assert without_manifest(dst) == local[REPO]
    assert fetched_shards(hub) == {shard(i) for i in range(1, 7)} - done - present


def test_reading_the_source_twice_or_locally_is_refused(hub, sources, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    with pytest.raises(UsageError, match="--stream reads each source shard once"):
        kconvert.reap(REPO, str(tmp_path / "o1"), stream=True, data=str(data), keep=8)
    with pytest.raises(UsageError, match="--stream reads each source shard once"):
        kconvert.sparsify(REPO, str(tmp_path / "o2"), stream=True, method="sparsegpt",
                          data=str(data))
    with pytest.raises(UsageError, match="is not one"):
        kconvert.dequant(str(sources[REPO]), str(tmp_path / "o3"), stream=True)
    assert not hub.requests  # refused before anything was fetched
    done = cli_subprocess("reap", REPO, tmp_path / "o4", "--stream", "--data", data, "--keep",
                          8, env={**os.environ, "HF_ENDPOINT": hub.url}, timeout=120)
    assert done.returncode == 2 and "--stream reads each source shard once" in done.stderr


def test_dry_run_says_the_disk_of_a_streamed_and_a_cached_run(hub, sources, tmp_path):
    lines = []
    kconvert.int4_to_nvfp4(REPO, str(tmp_path / "out"), dry_run=True, device="cpu",
                           cache_dir=str(tmp_path / "hf-cache"), stream_window=2,
                           echo=lines.append)
    sizes = shard_sizes(sources[REPO])
    streamed_line, cached_line = lines[-2:]
    assert streamed_line.startswith("disk, streamed (--stream, 2 shards at once): ")
    assert f"= {window_bytes(sizes, 2) / 1e6:.1f} MB of shards downloaded at once + " \
        in streamed_line
    assert cached_line.startswith("disk, cached (without --stream): ")
    assert f"= {sum(sizes) / 1e6:.1f} MB of shards in the Hugging Face cache + " in cached_line
    assert not (tmp_path / "out").exists()
    disk = kconvert.inspect(REPO, as_format="nvfp4", cache_dir=str(tmp_path / "hf-cache")
                            ).to_json()["disk_from_hub"]
    assert disk["window"] == STREAM_WINDOW and disk["remote_source_bytes"] == sum(sizes)
    assert disk["streamed_peak_bytes"] == window_bytes(sizes, STREAM_WINDOW) + disk["output_bytes"]
    assert disk["cached_peak_bytes"] == sum(sizes) + disk["output_bytes"]
    assert not fetched_shards(hub)

