"""Events: what a conversion has just done, and how long each of its steps took.

Run events, to every listener, at each step that leaves something on disk, in order:
`shard-done` (a shard renamed into place), `file-copied` (a non-weight file), `index-written`,
`config-written`, `file-written` (a generated file such as the pruning plan),
`manifest-staged` (the manifest written under its temporary name), `manifest-written` (renamed
into place), `output-committed` (a replaced output swapped in) and `run-finished` (run state
removed).

Timing events (TIMING_EVENTS), only to listeners subscribed with `timings=True`, for benchmarks
and tests that want to see inside the engine's pipeline. Each is emitted when its step ends,
in the thread that did it, with `start` and `end` (time.perf_counter() seconds) and `thread`
(the thread's name: `MainThread` computes, `kconvert-read_N` read, `kconvert-hash_0` hashes,
`kconvert-writer` writes). A work item's events carry `item` (its index in the work plan),
`kind` ("copy" or "transform") and `nbytes` (its source bytes, as the progress bar counts):
  read        a reader thread read the item's source bytes into host buffers
  wait-read   the compute thread waited for that read to finish (once more at the end, when
              no item is left: item None)
  compute     the compute thread decoded, transformed and encoded it
  wait-put    the compute thread waited for room in the bounded queue of results
  hash        the hasher thread hashed the item's output bytes
  wait-get    the writer waited for the item's result (once more at the end, for the
              end-of-run mark: item None)
  write       the writer wrote the result (its pwrites, waits and finished shards included)
  wait-hash   the writer waited for the result's hashes
  pwrite      one piece of output bytes written: `item`, `shard`, `tensor`, `nbytes`
  fsync       a complete shard flushed to disk, closed and renamed: `shard`, `nbytes`
  phase       a phase of the run: `name` (read_shape_values, build_work_plan, execute)
A streamed run (`--stream`, kconvert.io.stream) adds, each with `shard` (a source shard):
  download    one download of the shard (`attempt`, `nbytes`), timed in a worker process
  verify      its hash, once the download returned (`ok`; `followed`: hashed as the bytes
              landed, so only the last bytes were left), timed in a worker process
  source-wait a reader waited for the verified shard, the first time the run reads it
  source-deleted  the download deleted, every output shard that reads it being recorded
Nothing is timed and no event is built while no such listener is subscribed: emitters test the
`timing` flag first (`span` returns a shared no-op then).

A listener runs in the emitting thread, so it must be thread-safe (appending to a list is).
A listener that raises stops the run like any other failure of the step it observes, so tests
can stop a run at an exact step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]

TIMING_EVENTS = ("read", "wait-read", "compute", "wait-put", "hash", "wait-get", "write",
                 "wait-hash", "pwrite", "fsync", "phase", "download", "verify", "source-wait",
                 "source-deleted")

_listeners: list[tuple[Listener, bool]] = []

# True while a listener wants timing events; emitters test it before timing anything.
timing = False


def subscribe(listener: Listener, timings: bool = False) -> Callable[[], None]:
    """Call `listener(event, info)` on every run event from now on, and on every timing event
    too if `timings`; returns the unsubscribe."""
    entry = (listener, timings)
    _listeners.append(entry)
    _set_timing()

    def unsubscribe() -> None:
        _listeners.remove(entry)
        _set_timing()

    return unsubscribe


def _set_timing() -> None:
    global timing
    timing = any(wants for _, wants in _listeners)


def emit(event: str, **info: Any) -> None:
    """A run event, to every listener."""
    for listener, _ in list(_listeners):
        listener(event, info)


class Span:
    """Times a `with` block as a timing event, emitted when the block ends without raising;
    `add` puts fields in the event that are known only inside the block."""

    __slots__ = ("event", "info", "start")

    def __init__(self, event: str, info: dict[str, Any]):
        self.event, self.info, self.start = event, info, 0.0

    def add(self, **info: Any) -> None:
        self.info.update(info)

    def __enter__(self) -> Span:
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        info = {**self.info, "start": self.start, "end": time.perf_counter(),
                "thread": threading.current_thread().name}
        for listener, wants in list(_listeners):
            if wants:
                listener(self.event, info)


class NoSpan:
    """What `span` returns while nobody listens to timing events: does nothing."""

    __slots__ = ()

    def add(self, **info: Any) -> None:
        pass

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass


NO_SPAN = NoSpan()


def record(event: str, start: float, end: float, **info: Any) -> None:
    """A timing event measured elsewhere, e.g. in another process (time.perf_counter reads
    one clock for every process on Linux), emitted from this thread."""
    if not timing:
        return
    info = {**info, "start": start, "end": end, "thread": threading.current_thread().name}
    for listener, wants in list(_listeners):
        if wants:
            listener(event, info)


def span(event: str, **info: Any) -> Span | NoSpan:
    """`with span("read", item=3, ...):` times its block as timing event `event`, or does
    nothing at all (one shared object, no clock read) while nobody listens."""
    return Span(event, info) if timing else NO_SPAN
