"""Which source shards a run reads, in which order, and when it is done with each.

What a streamed run (kconvert.io.stream) needs from the work plan. The engine runs the items
in plan order, and `build_work_plan` lays them out shard by shard in the source's shard order
(a module's outputs land in the shard of its primary tensor, its other parameters may lie in
the next shard), so the shards are needed in that order, each by a few consecutive items. A
source shard may be deleted once every output shard that reads it is complete and recorded.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from kconvert.engine.work import WorkPlan, header_shape_values, shard_file_bytes
from kconvert.io.files import human_bytes
from kconvert.io.hub_downloads import remote_files
from kconvert.io.remote import HeaderOnlyShard
from kconvert.io.stream import ShardStream, StreamedShard, stream_of, window_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceOrder:
    """The source shards the unfinished part of a run reads."""

    shards: list[str]  # in the order the run first reads them
    readers: dict[str, set[str]]  # source shard -> the unfinished output shards that read it
    # The fewest streamed shards on disk at once that lets the run go on: the most that are
    # needed at the same time (downloaded ahead in order, released when their readers are done).
    min_window: int


def source_order(plan: WorkPlan, done: Collection[str],
                 local: Collection[str] = ()) -> SourceOrder:
    """The source shards that the items of output shards not in `done` read; `local` shards
    (already on disk, not downloaded) never count towards the window."""
    todo = [it for it in plan.items if plan.item_shards(it) - set(done)]
    shards: list[str] = []
    readers: dict[str, set[str]] = defaultdict(set)
    last: dict[str, int] = {}  # output shard -> index in `todo` of its last item
    sources_of: dict[str, set[str]] = defaultdict(set)  # output shard -> source shards
    for i, item in enumerate(todo):
        outs = plan.item_shards(item) - set(done)
        for src in sorted(plan.item_sources(item)):
            if src not in readers:
                shards.append(src)
            readers[src] |= outs
        for out in outs:
            last[out] = i
            sources_of[out] |= plan.item_sources(item)

    # The run as the downloads see it: shards come in `shards` order, each when an item needs
    # it (or an earlier one), and go when the last item of their last reader is written.
    ending: dict[int, list[str]] = defaultdict(list)
    for out, i in last.items():
        ending[i].append(out)
    waiting = {src: set(outs) for src, outs in readers.items()}
    streamed = [s for s in shards if s not in set(local)]
    position = {s: n for n, s in enumerate(streamed)}
    held: set[str] = set()
    fetched, peak = 0, 0
    for i, item in enumerate(todo):
        need = [position[s] for s in plan.item_sources(item) if s in position]
        while need and fetched <= max(need):
            held.add(streamed[fetched])
            fetched += 1
        peak = max(peak, len(held))
        for out in ending[i]:
            for src in sources_of[out]:
                waiting[src].discard(out)
                if not waiting[src]:
                    held.discard(src)
    return SourceOrder(shards, dict(readers), peak)


def start_stream(plan: WorkPlan, done: Collection[str], where: Path, window: int,
                 say) -> ShardStream | None:
    """Start fetching the shards the unfinished output shards read, into `where`, `window`
    at once or the fewest the plan needs if more (said); None when no shard is streamed."""
    stream = stream_of(plan.ckpt)
    if stream is None:
        return None
    order = source_order(plan, done, stream.local())
    if order.min_window > window:
        say(f"kconvert: note: --stream-window {window} is too small for this plan: items "
            f"read {order.min_window} shards at once; streaming {order.min_window}")
    stream.start(where, order.shards, order.readers, max(window, order.min_window),
                 header_shape_values(plan.ckpt))
    return stream


@dataclass(frozen=True)
class HubDisk:
    """Disk a run from a Hub repo id needs, streamed or cached."""

    window: int  # shards on disk at once in a streamed run
    cached_bytes: int  # shard bytes already in the Hugging Face cache
    remote_bytes: int  # shard bytes a cached run downloads
    window_bytes: int  # the most downloaded shard bytes a streamed run holds at once
    output_bytes: int  # the output's files

    def to_json(self) -> dict:
        return {"window": self.window, "cached_source_bytes": self.cached_bytes,
                "remote_source_bytes": self.remote_bytes,
                "streamed_peak_bytes": self.streamed_peak,
                "cached_peak_bytes": self.cached_peak, "output_bytes": self.output_bytes}

    @property
    def streamed_peak(self) -> int:
        return self.cached_bytes + self.window_bytes + self.output_bytes

    @property
    def cached_peak(self) -> int:
        return self.cached_bytes + self.remote_bytes + self.output_bytes

    def lines(self) -> list[str]:
        out = human_bytes(self.output_bytes)
        return [
            f"disk, streamed (--stream, {self.window} shards at once): "
            f"{human_bytes(self.streamed_peak)} at the peak = "
            f"{human_bytes(self.window_bytes)} of shards downloaded at once"
            + (f" + {human_bytes(self.cached_bytes)} already cached" if self.cached_bytes else "")
            + f" + {out} output",
            f"disk, cached (without --stream): {human_bytes(self.cached_peak)} = "
            f"{human_bytes(self.cached_bytes + self.remote_bytes)} of shards in the Hugging "
            f"Face cache + {out} output"]


def hub_disk(plan: WorkPlan, window: int, token: str | None = None) -> HubDisk | None:
    """The disk of a run of `plan` from its Hub repo (None: the source is a directory)."""
    ckpt = plan.ckpt
    if "repo" not in ckpt.identity:
        return None
    remote = [n for n in ckpt.shards
              if isinstance(ckpt.readers[n], HeaderOnlyShard | StreamedShard)]
    cached = sum((ckpt.root / n).stat().st_size for n in ckpt.shards if n not in remote)
    sizes = {}
    if remote:
        stream = stream_of(ckpt)
        files = (stream.files if stream is not None
                 else remote_files(ckpt.identity["repo"], ckpt.identity["commit"], token))
        sizes = {n: files[n].size for n in remote if n in files}
    order = source_order(plan, (), set(ckpt.shards) - set(remote))
    window = max(window, order.min_window)
    return HubDisk(window, cached, sum(sizes.values()), window_bytes(sizes.values(), window),
                   sum(shard_file_bytes(plan).values()))
