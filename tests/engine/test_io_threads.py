"""The engine's reader, writer and hash threads: manifest hashes are the bytes written when a
tensor spans many results; the shard writer queues dirty pages for the disk as it goes (no
multi-GB final fsync); the read-ahead stays its depth ahead, in order, and a reader thread hands
its item's byte ranges to the kernel before reading them. A CPU run gives the reader
and writer threads cores of their own, the kernels the rest, and puts every thread back where it
was; the bytes are the same either way.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import xxhash
from safetensors import safe_open

from conftest import BUNDLED
from helpers import (
    MANIFEST,
    run_inproc,
    snapshot,
)


def test_manifest_hashes_are_the_bytes_written_when_tensors_span_many_items(
        tmp_path, monkeypatch):
    """Hashes are computed in a thread of their own beside the writer, one result after
    another. With 4 KiB copy items every larger pass-through tensor spans several results:
    each manifest hash must still be xxh3-128 of the tensor's bytes as safetensors reads them
    back from the output."""
    from kconvert.engine import work

    monkeypatch.setattr(work, "COPY_CHUNK", 4096)
    dst = tmp_path / "out"
    run_inproc("int4-to-nvfp4", BUNDLED, dst)
    tensors = json.loads((dst / MANIFEST).read_text())["tensors"]
    spanning = 0
    for name, entry in tensors.items():
        with safe_open(str(dst / entry["file"]), "pt") as fh:
            raw = fh.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy()
        assert entry["hash"] == xxhash.xxh3_128(raw.tobytes()).hexdigest(), name
        spanning += entry["stage"] == "copy" and raw.size > 4096
    assert spanning >= 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_shard_writer_starts_writeback_every_writeback_bytes(tmp_path, monkeypatch):
    """Dirty output pages are queued for the disk as they are written (sync_file_range through
    libc: Python's os module has no such call), so a shard's final fsync has little left to
    flush and does not stall the reads for seconds. The file is still exactly what was written."""
    from kconvert.io import shards

    calls = []
    real = shards.start_writeback
    monkeypatch.setattr(shards, "WRITEBACK_BYTES", 1 << 20)
    monkeypatch.setattr(shards, "start_writeback", lambda fd: calls.append(fd) or real(fd))
    data = torch.arange(5 << 18, dtype=torch.int32)  # 5 MiB, written in 640 KiB pieces
    path = tmp_path / "a.safetensors"
    writer = shards.ShardWriter(path, tmp_path / "a.partial", [("x", "I32", tuple(data.shape))])
    for piece, offset in zip(data.split(5 << 15), range(0, 5 << 20, 5 << 17), strict=True):
        writer.write("x", piece, offset)
    writer.finish()
    assert len(calls) == 4  # after 1.25, 2.5, 3.75 and 5 MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        assert real(fd) is True  # the call exists and succeeds here
    finally:
        os.close(fd)
    with safe_open(path, "pt") as fh:
        assert torch.equal(fh.get_tensor("x"), data)
    with pytest.raises(OSError, match="sync_file_range"):
        real(10**6)  # not an open descriptor: an error, never a silent no-op
    read_end, write_end = os.pipe()  # no page cache behind it: "not supported", not a failure
    try:
        assert real(write_end) is False
    finally:
        os.close(read_end)
        os.close(write_end)


def test_read_ahead_reads_depth_units_ahead_in_order():
    """The engine's and the audit's read-ahead: units come back in order; while the consumer
    holds unit k, units up to k + depth are submitted and no further; a failed read raises
    in the consumer."""
    from concurrent.futures import ThreadPoolExecutor

    from kconvert.io.readahead import read_ahead

    consumed: list[int] = []
    submitted: list[tuple[int, int]] = []  # (unit, units consumed when it was submitted)

    class Recording(ThreadPoolExecutor):
        def submit(self, fn, unit):
            submitted.append((unit, len(consumed)))
            return super().submit(fn, unit)

    with Recording(2) as pool:
        for unit, value in read_ahead(pool, range(20), lambda u: u * 10, 4):
            assert value == unit * 10
            consumed.append(unit)
    assert consumed == list(range(20))
    assert [u for u, _ in submitted] == consumed
    assert all(u - done <= 4 for u, done in submitted)
    assert [u - done for u, done in submitted[4:16]] == [4] * 12  # always 4 ahead

    def failing(u: int) -> int:
        if u == 3:
            raise OSError("read failed")
        return u

    got = []
    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError, match="read failed"):
        for u, _ in read_ahead(pool, range(10), failing, 4):
            got.append(u)
    assert got == [0, 1, 2]


# ----------------------------------------------------------- cores set apart on a CPU run


def test_split_cores_sets_one_core_in_eight_apart():
    from kconvert.engine.execute import split_cores

    assert split_cores(range(16)) == (set(range(14)), {14, 15})
    assert split_cores(range(7)) is None  # too few: every thread shares every core
    odd = range(1, 19, 2)  # 9 cores, as a cpuset may give them
    assert split_cores(odd) == (set(range(1, 17, 2)), {17})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs thread affinity and 2 cores")
def test_cpu_run_gives_io_threads_cores_of_their_own_and_restores_every_thread(
        tmp_path, monkeypatch):
    import threading

    import numba

    from kconvert.common import events
    from kconvert.engine import execute

    allowed = os.sched_getaffinity(0)
    shared = tmp_path / "shared"
    monkeypatch.setattr(execute, "IO_CORE_EVERY", 10**6)  # no core set apart
    run_inproc("int4-to-nvfp4", BUNDLED, shared)

    monkeypatch.setattr(execute, "IO_CORE_EVERY", len(allowed))  # one core set apart
    kernel, io = execute.split_cores(allowed)
    idle = threading.Event()
    bystander = threading.Thread(target=idle.wait)  # a thread of the host program
    bystander.start()
    seen: dict[str, set] = {"read": set(), "write": set(), "hash": set(), "compute": set(),
                            "bystander": set()}
    threads = set()

    def recording(event, info):
        """A timing event's listener runs in the thread that did the step."""
        if event in ("read", "write", "hash", "compute"):
            seen[event].add(frozenset(os.sched_getaffinity(0)))
        if event == "compute":
            seen["bystander"].add(frozenset(os.sched_getaffinity(bystander.native_id)))
            threads.add((numba.get_num_threads(), torch.get_num_threads()))

    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    apart = tmp_path / "apart"
    unsubscribe = events.subscribe(recording, timings=True)
    try:
        run_inproc("int4-to-nvfp4", BUNDLED, apart)
        after = os.sched_getaffinity(bystander.native_id)
    finally:
        unsubscribe()
        idle.set()
        bystander.join()

    assert seen["read"] == seen["write"] == seen["hash"] == {frozenset(io)}
    assert seen["compute"] == seen["bystander"] == {frozenset(kernel)}
    assert threads == {(min(len(kernel), numba_threads), min(len(kernel), torch_threads))}
    assert os.sched_getaffinity(0) == after == allowed
    assert (torch.get_num_threads(), numba.get_num_threads()) == (torch_threads, numba_threads)
    assert snapshot(apart) == snapshot(shared)

    # A run that fails midway puts every thread and thread count back too.
    calls = []

    def failing(event, info):
        if event == "compute":
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("compute failed")

    unsubscribe = events.subscribe(failing, timings=True)
    try:
        with pytest.raises(RuntimeError, match="compute failed"):
            run_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "failed")
    finally:
        unsubscribe()
    assert os.sched_getaffinity(0) == allowed
    assert (torch.get_num_threads(), numba.get_num_threads()) == (torch_threads, numba_threads)


def test_reader_threads_hint_each_item_before_reading_it(tmp_path, monkeypatch):
    """A reader thread hands every byte range of its item to the kernel (will_need) before it
    reads any of them, so the disk gets the whole item at once: each range read on a reader
    thread lies in a range that thread hinted earlier, and nothing beyond the reads is hinted
    (copy items split into 4 KiB chunks included)."""
    import threading

    from kconvert.engine import work
    from kconvert.io import shards

    monkeypatch.setattr(work, "COPY_CHUNK", 4096)
    hinted: dict[str, list[tuple[str, int, int]]] = {}
    read: list[tuple[str, str, int, int]] = []
    late: list[tuple[str, int, int]] = []
    real_hint, real_read = shards.ShardReader.will_need, shards.ShardReader.read_into

    def hint(self, info, offset=0, length=None):
        name = threading.current_thread().name
        if name.startswith("kconvert-read"):
            size = info.nbytes - offset if length is None else length
            hinted.setdefault(name, []).append((info.file.name, info.start + offset, size))
        return real_hint(self, info, offset, length)

    def read_into(self, info, out, offset=0):
        name = threading.current_thread().name
        if name.startswith("kconvert-read"):
            span = (info.file.name, info.start + offset, out.numel())
            read.append((name, *span))
            if not any(f == span[0] and s <= span[1] and span[1] + span[2] <= s + n
                       for f, s, n in hinted.get(name, [])):
                late.append(span)
        return real_read(self, info, out, offset)

    monkeypatch.setattr(shards.ShardReader, "will_need", hint)
    monkeypatch.setattr(shards.ShardReader, "read_into", read_into)
    run_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out")
    assert read and not late
    assert sum(n for spans in hinted.values() for _, _, n in spans) == \
        sum(n for *_, n in read)
