"""A Hub repo's shards streamed beside the conversion (`--stream`): each shard is downloaded a
bounded window ahead of the item that first reads it, verified, read, and deleted once every
output shard that reads it is complete and recorded. Source bytes on disk at any time: the
window (a few shards), never the model.

- Non-weight files (config, index, tokenizer, code) go to the Hugging Face cache as in a cached
  run; shard headers are read with HTTP range requests (kconvert.io.remote) to plan the run.
- A shard already in the user's Hugging Face cache is read there and never deleted, nor
  counted in the window. Every other shard is fetched with huggingface_hub's `hf_hub_download`
  into `<output>/.kconvert/source/` (a directory kconvert owns; only files there are deleted),
  which retries a dropped connection with a range request and checks the size. The downloads
  run in worker processes (kconvert.io.download_worker), DOWNLOADS shards at once in the
  order the run reads them, so that they neither wait for nor slow down the engine's threads.
- huggingface_hub does not check a downloaded file's content against the Hub's hash
  (docs/hub.md §3), so that is done here: sha256 against the LFS oid the Hub lists (git's
  blob id for a non-LFS file), computed by the worker as the bytes land. A shard that does
  not match is downloaded again (ATTEMPTS downloads in all), then refused, naming the file;
  no item reads it.
- `--resume`: downloads already complete in `source/` are verified and reused; only shards that
  unfinished output shards read are fetched.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path

import torch

from kconvert.common import events
from kconvert.common.options import STREAM_WINDOW
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import Checkpoint, checked, download
from kconvert.io.hub_downloads import DownloadWorker, RemoteFile, hub_settings, remote_files
from kconvert.io.remote import HeaderOnlyShard, open_headers
from kconvert.io.shards import ShardReader, TensorInfo

log = logging.getLogger(__name__)

SOURCE_DIR = "source"  # under the run state directory (.kconvert/)
ATTEMPTS = 3  # downloads of one shard before it is refused
# Shards downloaded at once, each by a worker process (kconvert.io.download_worker): one plain
# HTTP download is a Python loop that one core bounds (well below 1 GB/s).
DOWNLOADS = 2


def window_bytes(sizes: Collection[int], window: int) -> int:
    """The most source bytes `window` shards of these sizes can hold on disk."""
    return sum(sorted(sizes, reverse=True)[:window])


class ShardStream:
    """Downloads the shards in the order the run reads them, DOWNLOADS at once, at most
    `window` on disk (those being downloaded count)."""

    def __init__(self, repo: str, commit: str, token: str | None, root: Path,
                 names: list[str], window: int):
        self.repo, self.commit, self.token, self.root = repo, commit, token, root
        self.names, self.window = names, window
        self.where: Path | None = None
        self.cond = threading.Condition()
        self.ready: dict[str, Path] = {}
        self.held: set[str] = set()  # downloading, downloaded or being read
        self.fetching = 0  # downloads in progress
        self.failed: dict[str, KconvertError] = {}
        self.stopped = False
        self.readers: dict[str, set[str]] = {}
        self.shards: dict[str, StreamedShard | ShardReader] = {}  # cached ones: ShardReader
        self.expected_shapes: dict[str, tuple[int, ...]] = {}
        self.peak_bytes = 0  # the most downloaded source bytes held at once
        self.thread: threading.Thread | None = None
        self.workers: list[DownloadWorker] = []

    @cached_property
    def files(self) -> dict[str, RemoteFile]:
        return remote_files(self.repo, self.commit, self.token)

    def local(self) -> set[str]:
        """Shards read in place from the Hugging Face cache (never downloaded or deleted)."""
        return {n for n in self.names if not isinstance(self.shards.get(n), StreamedShard)}

    def start(self, where: Path, order: list[str], readers: dict[str, set[str]],
              window: int, expected_shapes: dict[str, tuple[int, ...]]) -> None:
        """Fetch the shards of `order` into `where` (`readers`: source shard -> the output
        shards whose completion releases it), at most `window` at once."""
        self.where, self.readers, self.window = where, readers, window
        self.expected_shapes = expected_shapes
        where.mkdir(parents=True, exist_ok=True)
        streamed = [n for n in order if n not in self.local()]
        for left in sorted(set(self.names) - set(streamed)):  # an earlier run's, not needed
            (where / left).unlink(missing_ok=True)
        for partial in where.rglob("*.incomplete"):  # an interrupted download's: not reused
            partial.unlink()
        log.info("streaming %d shard(s) of %s@%s into %s, %d at most on disk",
                 len(streamed), self.repo, self.commit, where, window)
        settings = {"constants": hub_settings(), "repo": self.repo, "commit": self.commit,
                    "token": self.token, "where": str(where)}
        self.workers = [DownloadWorker(settings) for _ in range(min(DOWNLOADS, len(streamed)))]
        for worker in self.workers:  # now, with this thread's CPU mask (see engine.execute)
            worker.start()
        self.thread = threading.Thread(target=self._fetch_all, args=(streamed,),
                                       name="kconvert-download", daemon=True)
        self.thread.start()

    def _fetch_all(self, names: list[str]) -> None:
        """Start each download in order once the window and a worker have room for it."""
        try:
            self.files  # noqa: B018 (listed once, before the downloads that read it)
        except KconvertError as exc:
            for name in names:
                self._fail(name, exc)
            return
        idle: queue.SimpleQueue[DownloadWorker] = queue.SimpleQueue()
        for worker in self.workers:
            idle.put(worker)
        with ThreadPoolExecutor(max(len(self.workers), 1),
                                thread_name_prefix="kconvert-download") as pool:
            for name in names:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or (
                        len(self.held) < self.window and self.fetching < len(self.workers)))
                    if self.stopped:
                        return
                    self.held.add(name)
                    self.fetching += 1
                pool.submit(self._fetch, name, idle)

    def _fetch(self, name: str, idle: queue.SimpleQueue) -> None:
        """Download `name` and check it against the Hub's hash, ATTEMPTS times at most; then
        it is ready, or the run fails naming it."""
        try:
            remote = self.files.get(name)
            if remote is None:
                self._fail(name, KconvertError(f"the Hub lists no {name} in {self.repo}@"
                                               f"{self.commit}", file=name))
                return
            expected = remote.sha256 or remote.blob_id
            job = {"name": name, "size": remote.size, "etag": expected,
                   "kind": "sha256" if remote.sha256 else "git-blob"}
            error, found = "", ""
            for attempt in range(1, ATTEMPTS + 1):
                worker = idle.get()
                try:
                    if self.stopped:
                        return
                    log.info("downloading %s", name)
                    got = worker.run(job)
                finally:
                    idle.put(worker)
                if self.stopped:
                    return
                if "error" in got:
                    log.warning("download %d of %s failed: %s", attempt, name, got["error"])
                    error, found = got["error"], ""
                    continue
                ok = got["digest"] == expected
                events.record("download", got["start"], got["downloaded"], shard=name,
                              attempt=attempt, nbytes=remote.size)
                events.record("verify", got["downloaded"], got["hashed"], shard=name, ok=ok,
                              followed=got["followed"])
                if ok:
                    self._ready(name, Path(got["path"]))
                    return
                Path(got["path"]).unlink(missing_ok=True)
                found = got["digest"]
                log.warning("download %d of %s has sha %s, the Hub lists %s", attempt, name,
                            found, expected)
            self._fail(name, self._refusal(name, remote, found, error))
        except BaseException as exc:  # a bug here must not leave a reader waiting forever
            self._fail(name, KconvertError(f"downloading the shard failed: {exc}", file=name))
            raise
        finally:
            with self.cond:
                self.fetching -= 1
                self.cond.notify_all()

    def _refusal(self, name: str, remote: RemoteFile, found: str, error: str) -> KconvertError:
        """Why the shard was refused, after ATTEMPTS downloads: the last one's failure."""
        if not found:
            return KconvertError(f"shard could not be downloaded from {self.repo}@{self.commit} "
                                 f"in {ATTEMPTS} attempts: {error}", file=name)
        kind = "sha256" if remote.sha256 else "git blob id"
        return KconvertError(
            f"downloaded shard does not match the Hub's {kind} {remote.sha256 or remote.blob_id} "
            f"(got {found}) in {ATTEMPTS} downloads; it was not converted and was deleted: check "
            "the network or disk, then run again with --resume",
            file=f"{self.repo}@{self.commit}/{name}")

    def _ready(self, name: str, path: Path) -> None:
        with self.cond:
            self.ready[name] = path
            held = sum(self.files[n].size for n in self.held if n in self.files)
            self.peak_bytes = max(self.peak_bytes, held)
            self.cond.notify_all()

    def _fail(self, name: str, error: KconvertError) -> None:
        with self.cond:
            self.failed[name] = error
            self.cond.notify_all()

    def wait(self, name: str) -> Path:
        """The verified local file of shard `name`, once it is there."""
        if self.thread is None:
            raise RuntimeError(f"{name} was read before its stream started")
        with self.cond:
            self.cond.wait_for(lambda: name in self.ready or bool(self.failed) or self.stopped)
            if name in self.ready:
                return self.ready[name]
            if self.failed:
                raise self.failed.get(name) or next(iter(self.failed.values()))
        raise KconvertError("the run stopped before this shard was downloaded", file=name)

    def shard_done(self, shard: str) -> None:
        """Output `shard` is complete and recorded: delete the downloads nothing reads now."""
        for name, outs in self.readers.items():
            outs.discard(shard)
            if outs or name not in self.held:
                continue
            reader = self.shards.get(name)
            if isinstance(reader, StreamedShard):
                reader.release()
            path = self.ready.get(name)
            if path is not None and self.where is not None and self.where in path.parents:
                with events.span("source-deleted", shard=name):
                    path.unlink(missing_ok=True)  # only kconvert's own downloads
                log.info("deleted the download of %s", name)
            with self.cond:
                self.held.discard(name)
                self.ready.pop(name, None)
                self.cond.notify_all()

    def stop(self) -> None:
        """No more reads: end the downloads, in progress or not."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for worker in self.workers:
            worker.close()

    def finish(self) -> None:
        """The run is complete: remove the download directory (kconvert's own)."""
        self.stop()
        if self.thread is not None:
            self.thread.join()
        log.info("at most %d bytes of downloaded shards were on disk at once", self.peak_bytes)
        if self.where is not None:
            shutil.rmtree(self.where, ignore_errors=True)

    def close(self) -> None:
        self.stop()


class StreamedShard:
    """A shard whose header is known (the run is planned from it) and whose bytes are read
    from its download once the stream has it."""

    def __init__(self, header: HeaderOnlyShard, stream: ShardStream):
        self.path, self.metadata, self.tensors = header.path, header.metadata, header.tensors
        self.stream = stream
        self.lock = threading.Lock()
        self.reader: ShardReader | None = None

    def _open(self) -> ShardReader:
        with self.lock:
            if self.reader is None:
                with events.span("source-wait", shard=self.path.name):
                    where = self.stream.wait(self.path.name)
                reader = ShardReader(where)
                try:
                    self._check(reader)
                except KconvertError:
                    reader.close()
                    raise
                self.reader = reader
            return self.reader

    def _check(self, reader: ShardReader) -> None:
        """The download holds what its header promised, and INT4 weight_shape values are the
        ones the plan took from the weight_packed headers."""
        for name, info in self.tensors.items():
            got = reader.tensors.get(name)
            if got is None or (got.dtype, got.shape, got.nbytes) != \
                    (info.dtype, info.shape, info.nbytes):
                raise KconvertError("the downloaded shard differs from the header the run was "
                                    "planned from", file=self.path.name, tensor=name)
            planned = self.stream.expected_shapes.get(name)
            if planned is not None:
                value = reader.read_ints(got)
                if value != planned:
                    raise KconvertError(f"weight_shape is {list(value)} but weight_packed's "
                                        f"header says {list(planned)}, which a streamed run "
                                        "plans from: convert without --stream",
                                        file=self.path.name, tensor=name)

    def read_into(self, info: TensorInfo, out: torch.Tensor, offset: int = 0) -> None:
        reader = self._open()
        reader.read_into(reader.tensors[info.name], out, offset)

    def read(self, info: TensorInfo, pin: bool = False) -> torch.Tensor:
        reader = self._open()
        return reader.read(reader.tensors[info.name], pin)

    def read_ints(self, info: TensorInfo) -> tuple[int, ...]:
        reader = self._open()
        return reader.read_ints(reader.tensors[info.name])

    def will_need(self, info: TensorInfo, offset: int = 0, length: int | None = None) -> None:
        reader = self._open()
        reader.will_need(reader.tensors[info.name], offset, length)

    def release(self) -> None:
        """Close the download (about to be deleted)."""
        with self.lock:
            if self.reader is not None:
                self.reader.close()
                self.reader = None

    def close(self) -> None:
        self.stream.close()
        self.release()


def open_streamed(src: str, revision: str | None, *, token: str | None = None,
                  cache_dir: str | None = None) -> Checkpoint:
    """Hub repo `src` for a streamed run: non-weight files in the Hugging Face cache, shard
    headers read remotely, shard bytes fetched during the run (`stream_of(ckpt).start`)."""
    root, identity = download(src, revision, token, cache_dir, shards=False)
    ckpt = open_headers(src, identity["commit"], token=token, cache_dir=cache_dir)
    ckpt.identity = identity  # the revision asked for, as a cached run records it
    stream = ShardStream(src, identity["commit"], token, root, ckpt.shards, STREAM_WINDOW)
    for name, reader in ckpt.readers.items():
        if isinstance(reader, HeaderOnlyShard):
            ckpt.readers[name] = stream.shards[name] = StreamedShard(reader, stream)
        else:
            stream.shards[name] = reader
    return checked(ckpt)


def stream_of(ckpt: Checkpoint) -> ShardStream | None:
    """The stream that feeds `ckpt`'s shards (None: every shard is on disk)."""
    return next((r.stream for r in ckpt.readers.values() if isinstance(r, StreamedShard)), None)
