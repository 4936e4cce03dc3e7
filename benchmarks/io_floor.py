"""What the disk does alone: the concurrent read+write floor a conversion is measured against
(`_iofloor`), and how it reads and writes with more I/O in flight and without the page cache
(`_ioprobe`, not a floor). Children of `convert` (and `multi_gpu`)."""

from __future__ import annotations

import mmap
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from benchmarks.child_process import report
from benchmarks.harness import Timer, drop_page_cache


def together(*fns: Callable[[], None]) -> None:
    """Run `fns` on threads of their own, all at once; return when every one has."""
    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def iofloor(argv: list[str]) -> None:
    """Cold read of every source byte AND writing `nbytes` (fsync per 1 GiB file), at once."""
    src, dst, nbytes = Path(argv[0]), Path(argv[1]), int(argv[2])
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    res: dict = {}
    chunk = 64 << 20
    timer = Timer()

    def reader() -> None:
        buf = bytearray(chunk)
        view = memoryview(buf)
        total = 0
        with timer.span("read_s"):
            for f in sorted(src.glob("*.safetensors")):
                fd = os.open(f, os.O_RDONLY)
                pos = 0
                while n := os.preadv(fd, [view], pos):
                    pos += n
                total += pos
                os.close(fd)
        res["read_gb"] = round(total / 1e9, 2)

    def writer() -> None:
        buf = memoryview(os.urandom(chunk))
        with timer.span("write_s"):
            for i, off in enumerate(range(0, nbytes, 1 << 30)):
                fd = os.open(dst / f"w{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                n = min(1 << 30, nbytes - off)
                pos = 0
                while pos < n:
                    pos += os.pwrite(fd, buf[: min(chunk, n - pos)], pos)
                os.fsync(fd)
                os.close(fd)

    with timer.span("both_s"):
        together(reader, writer)
    shutil.rmtree(dst, ignore_errors=True)
    report({**res, **timer.rounded(2)})


def ioprobe(argv: list[str]) -> None:
    """How this disk reads and writes with more I/O in flight, and without the page cache:
    buffered vs O_DIRECT reads of every source byte (argv's THREADS threads, 16 MiB
    requests), and O_DIRECT writes of `nbytes` (each 1 GiB file rounded up to 16 MiB) alone
    and at the same time as O_DIRECT reads. The page cache is dropped before each phase (needs
    root) unless KEEP is 1. argv: SRC DST NBYTES THREADS KEEP."""
    src, dst, nbytes = Path(argv[0]), Path(argv[1]), int(argv[2])
    threads, keep, chunk = int(argv[3]), argv[4] == "1", 16 << 20
    files = sorted(src.glob("*.safetensors"))
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    res: dict = {"threads": threads, "chunk_mib": chunk >> 20,
                 "read_gb": round(sum(f.stat().st_size for f in files) / 1e9, 2)}

    def drain(todo: list, io: Callable) -> None:
        """`threads` workers take jobs in order; io(job, buf) with a page-aligned buffer of
        the worker's own (as O_DIRECT needs)."""
        pending, lock = iter(todo), threading.Lock()

        def work() -> None:
            buf = mmap.mmap(-1, chunk)
            while True:
                with lock:
                    job = next(pending, None)
                if job is None:
                    return
                io(job, buf)

        together(*[work] * threads)

    def reads(direct: bool) -> None:
        fds = {f: os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for f in files}
        drain(jobs, lambda job, buf: os.preadv(fds[job[0]], [buf], job[1]))
        for fd in fds.values():
            os.close(fd)

    def writes() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        data = mmap.mmap(-1, chunk)
        data.write(os.urandom(chunk))
        per_file = 1 << 30
        jobs_w = [(i, off) for i in range(-(-nbytes // per_file))
                  for off in range(0, min(per_file, nbytes - i * per_file), chunk)]
        fds = {i: os.open(dst / f"w{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
               for i in {j[0] for j in jobs_w}}
        drain(jobs_w, lambda job, _: os.pwritev(fds[job[0]], [data], job[1]))
        for fd in fds.values():
            os.fsync(fd)
            os.close(fd)

    timer = Timer()

    def timed(label: str, *fns: Callable[[], None]) -> None:
        drop_page_cache(keep)
        timer(label, together, *fns)

    timed("read_buffered_s", lambda: reads(False))
    timed("read_direct_s", lambda: reads(True))
    timed("write_direct_s", writes)
    timed("read_write_direct_s", lambda: reads(True), writes)
    shutil.rmtree(dst, ignore_errors=True)
    report({**res, **timer.rounded(2)})
