"""A process that downloads shards with huggingface_hub's `hf_hub_download` and hashes each
one as its bytes land, for a streamed run (kconvert.io.stream).

Why a process of its own: huggingface_hub's plain HTTP download is a Python loop over the
response (about 3 ns of CPU a byte on a 2-core machine), so in the converting process it
competes for the interpreter lock with the engine's threads, and one such loop cannot fill a
fast link on its own; each worker process runs one download at a time, with none of that.

Why hashing as the bytes land: hashing a finished shard again means reading it all once more
(9.5 GB of a Kimi shard: several seconds on the run's critical path, every time the engine
waits for that shard). A thread here follows huggingface_hub's temporary file (`*.incomplete`
under `.cache/huggingface/download/` of the local dir, named with the file's etag) as it
grows, hashing up to its current size; when the download returns the file renamed into place,
what was followed is the file's content if it is the same file (inode), as long (size), and
was only ever appended to: the file never shrank, and huggingface_hub logged no retry (a retry
may rewrite the file from the start). Otherwise the file is hashed again from disk; the digest
is the same either way, only the time differs.

Protocol (JSON lines): the first line on stdin is the settings (`constants`: huggingface_hub's
settings as the parent process has them, `repo`, `commit`, `token`, `where`); then one line a
job (`name`, `size`, `kind`: "sha256" or "git-blob", `etag`), each answered on stdout with
`path`, `digest`, `start`, `downloaded`, `hashed` (time.perf_counter, system-wide on Linux),
`followed` (whether the digest came from following the download) or `error`. The worker exits
when stdin ends, at once, even mid-download: its parent is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

CHUNK = 16 << 20
POLL_S = 0.005  # how often the follower looks for more bytes


def new_digest(kind: str, size: int):
    """The hash a file's content is checked with: sha256 (an LFS file), or git's blob id."""
    return hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size)


def file_digest(path: Path, kind: str, size: int) -> str:
    """The hex digest of the file's bytes, read from disk."""
    digest = new_digest(kind, size)
    with path.open("rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


class RetryWatch(logging.Handler):
    """Notes any warning huggingface_hub's download code logs (a retry, a resume)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


class Follower(threading.Thread):
    """Hashes the download's temporary file as it grows, until told the download is over."""

    def __init__(self, folder: Path, etag: str, kind: str, size: int):
        super().__init__(name="kconvert-follow", daemon=True)
        self.folder, self.etag = folder, etag
        self.digest = new_digest(kind, size)
        self.over = threading.Event()
        self.hashed = 0
        self.inode: int | None = None
        self.valid = True

    def run(self) -> None:
        fd = None
        while fd is None:
            over = self.over.is_set()
            found = sorted(self.folder.glob(f"*{self.etag}*.incomplete"))
            if len(found) == 1:
                # Renamed meanwhile: the file is hashed again from disk.
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(found[0], os.O_RDONLY)
            if fd is None and over:
                self.valid = False
                return
            if fd is None:
                time.sleep(POLL_S)
        try:
            self.inode = os.fstat(fd).st_ino
            while True:
                over = self.over.is_set()  # before the size: the last pass sees every byte
                size = os.fstat(fd).st_size
                if size < self.hashed:
                    self.valid = False
                    return
                while self.hashed < size:
                    block = os.pread(fd, min(CHUNK, size - self.hashed), self.hashed)
                    if not block:
                        self.valid = False
                        return
                    self.digest.update(block)
                    self.hashed += len(block)
                if over:
                    return
                self.over.wait(POLL_S)
        finally:
            os.close(fd)


def download(settings: dict, job: dict) -> dict:
    """One download of `job['name']` into `settings['where']`, and the digest of its bytes."""
    from huggingface_hub import hf_hub_download

    where = Path(settings["where"])
    folder = where / ".cache" / "huggingface" / "download"
    follower = Follower(folder, job["etag"], job["kind"], job["size"])
    watch = RetryWatch()
    hub_log = logging.getLogger("huggingface_hub")
    hub_log.addHandler(watch)
    start = time.perf_counter()
    follower.start()
    try:
        path = Path(hf_hub_download(settings["repo"], job["name"], revision=settings["commit"],
                                    token=settings["token"], local_dir=where))
    finally:
        follower.over.set()
        follower.join()
        hub_log.removeHandler(watch)
    downloaded = time.perf_counter()
    stat = path.stat()
    followed = (follower.valid and not watch.seen and follower.inode == stat.st_ino
                and follower.hashed == stat.st_size)
    digest = (follower.digest.hexdigest() if followed
              else file_digest(path, job["kind"], stat.st_size))
    return {"path": str(path), "digest": digest, "start": start, "downloaded": downloaded,
            "hashed": time.perf_counter(), "followed": followed}


def serve() -> None:
    """Read the settings, then jobs, from stdin; answer each on stdout."""
    lines: list[str] = []
    arrived = threading.Condition()

    def read_stdin() -> None:
        for line in sys.stdin:
            with arrived:
                lines.append(line)
                arrived.notify()
        os._exit(0)  # the parent is gone (or done): nothing here is worth finishing

    threading.Thread(target=read_stdin, name="kconvert-stdin", daemon=True).start()

    def next_line() -> dict:
        with arrived:
            arrived.wait_for(lambda: bool(lines))
            return json.loads(lines.pop(0))

    settings = next_line()
    from huggingface_hub import constants

    for key, value in settings["constants"].items():
        setattr(constants, key, value)
    while True:
        job = next_line()
        try:
            answer = download(settings, job)
        except Exception as exc:  # the parent decides: tried again, then reported
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
