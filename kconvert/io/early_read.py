"""A local source's first bytes handed to the kernel to read while the command imports torch.

A conversion spends its first seconds importing (torch, numba, kconvert's modules: about 5 s
on the H200 machine with the page cache dropped) with the disk all but idle, and then reads
the source shard by shard in their names' order (engine.work, engine.source_order)
(benchmarks/results/README.md, "Session 20"). So, before those imports, a command that
converts a local SRC asks the kernel to read the first `EARLY_BYTES` of its shards in that
order (posix_fadvise WILLNEED, on a thread: the call queues the reads and may wait for room in
the disk's queue); the engine's own reads then find them in the page cache. Nothing waits
for them and nothing depends on them: a hint the kernel ignores, or bytes the run reads
later or not at all (a resumed run), cost disk time the imports left idle.

Only the standard library is imported here: this runs before torch is.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from kconvert.io.checkpoint_files import INDEX, SINGLE

# What is read ahead at most: about 2 s of the H200 machine's disk, the part of the imports'
# idle time that a read of the first shard can fill; never more than a quarter of the memory
# available (the page cache would drop older pages for it).
EARLY_BYTES = 4 << 30


def shard_files(root: Path) -> list[Path]:
    """`root`'s shards in the order a run reads them: the index's shard names sorted, else the
    single file; [] where neither is there or the index does not parse (the run itself
    reports that)."""
    index = root / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        return [root / n for n in names if (root / n).is_file()]
    return [root / SINGLE] if (root / SINGLE).is_file() else []


def early_ranges(files: list[Path], nbytes: int) -> list[tuple[Path, int]]:
    """(file, its first bytes to read) for the first `nbytes` of `files` in order."""
    out, left = [], nbytes
    for path in files:
        if left <= 0:
            break
        size = min(path.stat().st_size, left)
        out.append((path, size))
        left -= size
    return out


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def start_early_read(src: str, nbytes: int = EARLY_BYTES) -> threading.Thread | None:
    """The thread (started) hinting the first bytes of local checkpoint `src`; None where `src`
    is not a local directory (a Hub id, a stream), the system has no such hint, there is
    nothing to read, or torchrun started this process (common.distributed.launched, not
    imported here: it imports torch): each rank reads its own share, whose first bytes are
    not the source's."""
    root = Path(src)
    if not hasattr(os, "posix_fadvise") or not root.is_dir() or "WORLD_SIZE" in os.environ:
        return None
    mem = available_bytes()
    if mem is not None:
        nbytes = min(nbytes, mem // 4)
    ranges = early_ranges(shard_files(root), nbytes)
    if not ranges:
        return None
    thread = threading.Thread(target=_hint, args=(ranges,), name="kconvert-early-read",
                              daemon=True)
    thread.start()
    return thread


def _hint(ranges: list[tuple[Path, int]]) -> None:
    for path, length in ranges:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return  # the run opens it too, and says what is wrong
        try:
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # a file system without the hint: nothing lost
        finally:
            os.close(fd)
