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

import torch

from kconvert.engine.compute import compute_item, read_item
from kconvert.engine.sink import ShardSink
from kconvert.engine.work import WorkPlan
from kconvert.formats import nvfp4
from kconvert.io.readahead import read_ahead

# On a CPU run the reader and writer threads get cores of their own, one in IO_CORE_EVERY of
# the cores this process may use (none below that many), and the kernels the rest. Sharing
# cores, an I/O thread preempts a kernel thread, and a parallel kernel waits for its slowest
# thread: on 16 cores an expert matrix took 28-32 ms end to end that way, 19 ms with two
# cores set apart (scripts/results/README.md, session 4).
IO_CORE_EVERY = 8


# Thread masks are read and set per thread through /proc/self/task: Linux only.
_CAN_PIN = sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")


def execute(
    plan: WorkPlan,
    dst: Path,
    device: torch.device,
    done: dict[str, dict],
    progress: Callable[[int], None],
    readers: int = 4,
    prefetch: int = 4,
) -> dict[str, dict]:
    """Run every item whose output is not already complete; returns shard -> record."""
    _fix_mmap_threshold()
    sink = ShardSink(plan, dst, done)
    todo = [(i, it) for i, it in enumerate(plan.items) if plan.item_shards(it) - set(done)]
    skipped = sum(it.nbytes for it in plan.items) - sum(it.nbytes for _, it in todo)
    if skipped:
        progress(skipped)
    pin = device.type == "cuda"
    chunk_elems = 1 << 27 if device.type == "cuda" else 1 << 22
    results: queue.Queue = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def writer(io_cores: set[int] | None) -> None:
        _pin_thread(io_cores)
        while (got := results.get()) is not None:
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
                for (index, item), bufs in read_ahead(
                        pool, todo, lambda t: read_item(plan.ckpt, t[1], pin), prefetch):
                    if failure:
                        break
                    res = compute_item(plan, item, bufs, device, index, chunk_elems)
                    results.put((res, hasher.submit(sink.hash, res)))
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
    sink.finish_empty()
    return sink.done


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
        with nvfp4.cpu_threads(len(kernel)):
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


def _fix_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Keep every host buffer of >= 1 MiB in its own mapping, unmapped when freed.

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB),
    after which item-sized buffers come from per-thread arenas that fragment: peak RSS then
    creeps up item after item (+100-260 MiB on a shard of 16+ CPU work items) and varies
    run to run. Setting the threshold explicitly turns that adjustment off.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
            ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
