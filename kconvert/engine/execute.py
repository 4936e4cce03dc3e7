"""Running a work plan: reader threads, the compute thread, a hasher and a writer thread."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch

from kconvert.common import events
from kconvert.engine.compute import compute_item, read_item
from kconvert.engine.items import Item, WorkPlan
from kconvert.engine.sink import ShardSink
from kconvert.engine.warm_up import start_warm_up
from kconvert.engine.work import Share
from kconvert.formats import SOURCE_CODECS, cpu_threads
from kconvert.gpu.parts import Encode
from kconvert.io.readahead import read_ahead

# The engine's knobs, read at the start of each run (benchmarks/cpu_engine.py sets them to
# measure what each is worth):
#
# On a CPU run the reader and writer threads get cores of their own, one in IO_CORE_EVERY of
# the cores this process may use (none below that many; 10**6: none set apart), and the
# kernels the rest. Sharing cores, an I/O thread preempts a kernel thread, and a parallel
# kernel waits for its slowest thread: on the 16 cores of the H200 machine an expert matrix
# took 27-33 ms end to end that way, 18-22 ms with two cores set apart
# (benchmarks/results/README.md, cpu_engine runs 2 and 3).
IO_CORE_EVERY = 8
# Host buffers of at least MMAP_THRESHOLD bytes each get a mapping of their own, unmapped when
# freed (see _fix_mmap_threshold); None leaves glibc's own sliding threshold on.
MMAP_THRESHOLD: int | None = 1 << 20
# Results computed but not yet written: the compute thread waits (event wait-put) while the
# writer is RESULT_QUEUE results behind. Each holds an item's output bytes in host memory.
RESULT_QUEUE = 2

# Rows of a weight the encoder quantizes at a time, in decoded elements, by device: bounds its
# temporaries and keeps kernel launches few on a GPU.
CHUNK_ELEMS = {"cuda": 1 << 27, "cpu": 1 << 22}


def gpu_encode() -> Encode:
    """The encode of a work item on a GPU, for the command's memory plan (kconvert.gpu.plan):
    items of up to 2^28 decoded elements (~18 Kimi expert matrices; fewer where the plan says
    so), large enough to keep the GPU busy, small enough that prefetch and queued results stay
    within ~4 GB of host RAM; per decoded element four fp32 copies (the decode, the method's
    result, the decode of the encoded result and its error), the packed source and the
    encoder's own outputs, and per element of the encoder's chunk its temporaries: both as
    the registered formats declare them (the most any declares)."""
    codecs = SOURCE_CODECS
    return Encode(item_elems=1 << 28,
                  bytes_per_elem=4 * 4 + max(c.encode_bytes_per_elem for c in codecs),
                  chunk_elems=CHUNK_ELEMS["cuda"],
                  chunk_bytes_per_elem=max(c.encode_chunk_bytes_per_elem for c in codecs))

# Thread masks are read and set per thread through /proc/self/task: Linux only.
_CAN_PIN = sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")


class SourceFeed(Protocol):
    """A source whose shards arrive during the run (kconvert.io.stream): told when an output
    shard is complete and recorded, so it can let go of the source shards nothing reads any
    more, and told to stop when the reading is over (a reader thread may be waiting on it)."""

    def shard_done(self, shard: str) -> None: ...

    def stop(self) -> None: ...


def execute(
    plan: WorkPlan,
    dst: Path,
    device: torch.device,
    done: dict[str, dict],
    progress: Callable[[int], None],
    readers: int = 4,
    prefetch: int = 4,
    share: Share | None = None,
    feed: SourceFeed | None = None,
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Run every item whose output is not already complete; returns (shard -> record of the
    shards finished here, shared shard -> this rank's record of its part of it).

    `readers` threads read up to `prefetch` items ahead of the one being computed. With
    `share` (a rank's part under torchrun, engine.work.share_work), only its items run.
    `feed`: a source whose shards arrive while the run goes on."""
    with events.span("phase", name="execute"):
        return _execute(plan, dst, device, done, progress, readers, prefetch, share, feed)


def _execute(plan: WorkPlan, dst: Path, device: torch.device, done: dict[str, dict],
             progress: Callable[[int], None], readers: int, prefetch: int,
             share: Share | None, feed: SourceFeed | None
             ) -> tuple[dict[str, dict], dict[str, dict]]:
    _fix_mmap_threshold(MMAP_THRESHOLD)
    sink = ShardSink(plan, dst, done, share, None if feed is None else feed.shard_done)
    finished = set(done)
    mine = [(i, it) for i, it in enumerate(plan.items) if share is None or i in share.items]
    todo = [(i, it) for i, it in mine if plan.item_shards(it) - finished]
    skipped = sum(it.nbytes for _, it in mine) - sum(it.nbytes for _, it in todo)
    if skipped:
        progress(skipped)
    pin = device.type == "cuda"
    chunk_elems = CHUNK_ELEMS.get(device.type, CHUNK_ELEMS["cpu"])
    warming = start_warm_up(plan, [it for _, it in todo], device, chunk_elems)
    try:
        _pipeline(plan, sink, todo, device, readers, prefetch, feed, chunk_elems, pin, warming,
                  progress)
    finally:
        if warming is not None:  # no thread left using the device after the run
            warming.join()
    sink.finish_empty()
    return sink.done, sink.parts


def _pipeline(plan: WorkPlan, sink: ShardSink, todo: list[tuple[int, Item]],
              device: torch.device, readers: int, prefetch: int, feed: SourceFeed | None,
              chunk_elems: int, pin: bool, warming: threading.Thread | None,
              progress: Callable[[int], None]) -> None:
    """Read `todo` ahead on reader threads, compute each item here, hash and write it on
    threads of their own; the first item that encodes waits for `warming` (engine.warm_up)."""
    results: queue.Queue = queue.Queue(maxsize=RESULT_QUEUE)
    failure: list[BaseException] = []

    def read(entry: tuple[int, Item]) -> list[torch.Tensor]:
        index, item = entry
        with events.span("read", item=index, kind=item.kind, nbytes=item.nbytes):
            return read_item(plan.ckpt, item, pin)

    def writer(io_cores: set[int] | None) -> None:
        _pin_thread(io_cores)
        while True:
            with events.span("wait-get", item=None, kind=None, nbytes=0) as waited:
                got = results.get()
                if got is not None:
                    waited.add(item=got[0].index, kind=got[0].kind, nbytes=got[0].nbytes)
            if got is None:
                return
            if failure:
                continue
            try:
                sink.write(*got)
                progress(got[0].nbytes)
            except BaseException as exc:  # surfaced by the main thread
                failure.append(exc)

    with _cores_set_apart(device) as io_cores, \
            ThreadPoolExecutor(1, thread_name_prefix="kconvert-hash", initializer=_pin_thread,
                               initargs=(io_cores,)) as hasher:
        wthread = threading.Thread(target=writer, args=(io_cores,), name="kconvert-writer",
                                   daemon=True)
        wthread.start()
        try:
            with ThreadPoolExecutor(readers, thread_name_prefix="kconvert-read",
                                    initializer=_pin_thread, initargs=(io_cores,)) as pool:
                try:
                    ready = read_ahead(pool, todo, read, prefetch)
                    if events.timing:
                        ready = _timed_waits(ready)
                    for (index, item), bufs in ready:
                        if failure:
                            break
                        with events.span("compute", item=index, kind=item.kind,
                                         nbytes=item.nbytes):
                            if warming is not None and item.kind == "transform":
                                warming.join()
                                warming = None
                            res = compute_item(plan, item, bufs, device, index, chunk_elems)
                        queued = (res, hasher.submit(sink.hash, res))
                        with events.span("wait-put", item=index, kind=item.kind,
                                         nbytes=item.nbytes):
                            results.put(queued)
                finally:
                    # Before the pool waits for its threads: a reader may be waiting for a
                    # shard that will now never come.
                    if feed is not None:
                        feed.stop()
        except BaseException:
            results.put(None)
            wthread.join()
            sink.abandon()
            raise
        results.put(None)
        wthread.join()
    if failure:
        sink.abandon()
        raise failure[0]


def _timed_waits(ready: Iterator[tuple[tuple[int, Item], list[torch.Tensor]]]
                 ) -> Iterator[tuple[tuple[int, Item], list[torch.Tensor]]]:
    """The read-ahead's items as they come, each wait for one a `wait-read` event."""
    while True:
        with events.span("wait-read", item=None, kind=None, nbytes=0) as waited:
            got = next(ready, None)
            if got is not None:
                (index, item), _ = got
                waited.add(item=index, kind=item.kind, nbytes=item.nbytes)
        if got is None:
            return
        yield got


def split_cores(cores: Iterable[int]) -> tuple[set[int], set[int]] | None:
    """(kernel cores, I/O cores) for a CPU run on `cores`, or None (too few to set any apart)."""
    ordered = sorted(cores)
    n_io = len(ordered) // IO_CORE_EVERY
    if not n_io:
        return None
    return set(ordered[:-n_io]), set(ordered[-n_io:])


@contextlib.contextmanager
def _cores_set_apart(device: torch.device) -> Iterator[set[int] | None]:
    """On a CPU run: every thread of this process on the kernel cores (the thread pools that
    torch and numba keep may predate this run; threads they start later inherit the mask of
    this thread), kernels on as many threads as cores; yields the I/O cores for the reader and
    writer threads to pin themselves to. Every thread's mask is restored after (threads born
    during the run get this thread's former mask)."""
    own = os.sched_getaffinity(0) if _CAN_PIN else set()
    split = split_cores(own) if device.type == "cpu" and _CAN_PIN else None
    if split is None:
        yield None
        return
    kernel, io = split
    before: dict[int, set[int]] = {}
    try:
        for tid in _thread_ids():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, kernel)
        with cpu_threads(len(kernel)):
            yield io
    finally:
        for tid in _thread_ids():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, own))


def _thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _pin_thread(cores: set[int] | None) -> None:
    """Pin the calling (reader or writer) thread; if the system refuses (a cpuset that changed
    meanwhile), it runs unpinned: slower, never stuck."""
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)


def _fix_mmap_threshold(nbytes: int | None) -> None:
    """Keep every host buffer of >= `nbytes` in its own mapping, unmapped when freed (None:
    leave glibc's default).

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB),
    after which item-sized buffers come from per-thread arenas that fragment: peak RSS then
    creeps up item after item (+100-260 MiB on a shard of 16+ CPU work items) and varies
    run to run. Setting the threshold explicitly turns that adjustment off.
    """
    if nbytes is not None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
            ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
