"""The writer side of the engine: planned partial files, content hashes, rename-on-complete."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from kconvert.common import events
from kconvert.engine.compute import Result
from kconvert.engine.items import WorkPlan
from kconvert.engine.work import Share
from kconvert.errors import KconvertError
from kconvert.io.files import write_json
from kconvert.io.hashing import TensorHashes
from kconvert.io.lock import STATE_DIR
from kconvert.io.shards import ShardWriter, byte_view, finish_shared, tensor_nbytes


class ShardSink:
    """The writer side: planned .partial files, hashing, and rename-on-complete.

    With a `share` (a rank's part of a run under torchrun) it writes that rank's items only;
    a shard other ranks write into too is not renamed here: once this rank's tensors of it are
    written and on disk, its record of them goes to `parts`, and the shard's owner finishes
    it with every rank's part (`finish_parts`)."""

    def __init__(self, plan: WorkPlan, dst: Path, done: dict[str, dict],
                 share: Share | None = None,
                 on_done: Callable[[str], None] | None = None):
        self.plan, self.dst = plan, dst
        self.on_done = on_done  # called with each shard once it is complete and recorded
        self.state = dst / STATE_DIR
        (self.state / "partial").mkdir(parents=True, exist_ok=True)
        (self.state / "done").mkdir(parents=True, exist_ok=True)
        self.entries = plan.shard_entries
        self.done = done  # shard -> record, for shards already complete
        self.shared = share.shared if share is not None else frozenset()
        self.parts: dict[str, dict] = {}  # shared shard -> this rank's record of its part
        # Data bytes still to write per shard this rank writes into; finished at 0.
        if share is None:
            self.remaining = {shard: sum(tensor_nbytes(d, s) for _, d, s in e)
                              for shard, e in self.entries.items()}
        else:
            outputs = {name for i in share.items
                       for name in plan.item_outputs(plan.items[i])}
            self.remaining = {shard: 0 for shard in share.owned}
            for name in outputs:
                out = plan.outputs[name]
                self.remaining[out.shard] = (self.remaining.get(out.shard, 0)
                                             + tensor_nbytes(out.dtype, out.shape))
        # Complete before this run, or another rank's: nothing is written or hashed.
        self.skipped = set(done) | (set(self.entries) - set(self.remaining))
        # A module's outputs all land in the shard of its primary source tensor.
        self.module_shard = {m.out_module: m.primary.file.name for m in plan.modules}
        self.writers: dict = {}
        self.hashes = TensorHashes()
        self.records: dict[str, dict] = defaultdict(lambda: {"tensors": {}, "modules": {}})

    def hash(self, result: Result) -> dict[str, str]:
        """Content hashes of the output tensors that `result` completes. Runs in a thread of
        its own, beside the writer, one result after another in order (a tensor may span
        results): in the writer thread, hashing kept the writer, the pipeline's busiest
        stage, busy 2.7 s longer per 15.5 GB (H200 machine; benchmarks/results/README.md)."""
        digests = {}
        with events.span("hash", item=result.index, kind=result.kind, nbytes=result.nbytes):
            for name, data, _ in result.writes:
                out = self.plan.outputs[name]
                if out.shard in self.skipped:
                    continue
                digest = self.hashes.update(name, byte_view(data),
                                            tensor_nbytes(out.dtype, out.shape))
                if digest is not None:
                    digests[name] = digest
        return digests

    def write(self, result: Result, hashed: Future) -> None:
        """Write `result`'s bytes; `hashed` is its `hash`, computed meanwhile."""
        with events.span("write", item=result.index, kind=result.kind, nbytes=result.nbytes):
            self._write(result, hashed)

    def _write(self, result: Result, hashed: Future) -> None:
        # Stats first: the writes below may complete (and close the record of) their shard.
        for module, st in result.stats.items():
            shard = self.module_shard[module]
            if shard not in self.skipped:
                self.records[shard]["modules"][module] = st.__dict__
        finished = []
        for name, data, offset in result.writes:
            shard = self.plan.outputs[name].shard
            if shard in self.skipped:
                continue
            writer = self.writers.get(shard)
            if writer is None:
                writer = self.writers[shard] = ShardWriter(
                    self.dst / shard, self.state / "partial" / shard, self.entries[shard],
                    shared=shard in self.shared)
            nbytes = data.numel() * data.element_size()
            with events.span("pwrite", item=result.index, shard=shard, tensor=name,
                             nbytes=nbytes):
                writer.write(name, data, offset)
            self.remaining[shard] -= nbytes
            if self.remaining[shard] == 0:
                finished.append(shard)
        with events.span("wait-hash", item=result.index, kind=result.kind,
                         nbytes=result.nbytes):
            digests = hashed.result()
        for name, digest in digests.items():
            self.records[self.plan.outputs[name].shard]["tensors"][name] = digest
        for shard in finished:
            if shard in self.shared:
                self._finish_part(shard)
            else:
                self._finish(shard)

    def _finish_part(self, shard: str) -> None:
        """This rank's tensors of a shared shard written and on disk: its record of them kept
        for the shard's owner."""
        writer = self.writers.pop(shard)
        with events.span("fsync", shard=shard, nbytes=writer.size):
            writer.close_part()
        self.parts[shard] = self.records.pop(shard)
        events.emit("part-done", shard=shard)

    def _finish(self, shard: str) -> None:
        writer = self.writers.pop(shard)
        with events.span("fsync", shard=shard, nbytes=writer.size):
            writer.finish()
        record = self.records.pop(shard)
        write_json(self.state / "done" / f"{shard}.json", record,
                   self.state / "tmp" / f"{shard}.json")
        self.done[shard] = record
        events.emit("shard-done", shard=shard)
        if self.on_done is not None:
            self.on_done(shard)

    def finish_empty(self) -> None:
        """Shards with no data bytes at all (possible only for zero-size tensors); a shared
        shard this rank owns but writes nothing into is finished with the others' parts."""
        for shard, left in self.remaining.items():
            if left == 0 and shard not in self.done and shard not in self.shared:
                self.writers[shard] = ShardWriter(
                    self.dst / shard, self.state / "partial" / shard, self.entries[shard])
                self._finish(shard)

    def abandon(self) -> None:
        for writer in self.writers.values():
            writer.abandon()


def finish_parts(dst: Path, shard: str, parts: list[dict], writers: int) -> dict:
    """A shared shard (every rank that writes into it has written its tensors and kept its
    record of them, `ShardSink.parts`) renamed into place and recorded: its record, every
    part's tensors and modules. Fewer parts than the shard's `writers` is an error, and the
    shard stays unfinished: a rank's tensors would be missing from a file marked done."""
    if len(parts) != writers:
        raise KconvertError(f"{len(parts)} of the {writers} ranks that write into the shard "
                            "reported their part", file=shard)
    record: dict[str, dict] = {"tensors": {}, "modules": {}}
    for part in parts:
        for key in record:
            record[key].update(part[key])
    state = dst / STATE_DIR
    finish_shared(dst / shard, state / "partial" / shard)
    write_json(state / "done" / f"{shard}.json", record, state / "tmp" / f"{shard}.json")
    events.emit("shard-done", shard=shard)
    return record
