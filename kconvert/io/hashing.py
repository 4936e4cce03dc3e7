"""Content hashes of tensors: xxh3-128 of their raw bytes, fast enough to hash 600 GB at disk
speed. The manifest records one per output tensor; a resume re-checks the shards it keeps with
them and the audit re-hashes what it reads."""

from __future__ import annotations

import xxhash


class TensorHashes:
    """Hashes of tensors whose bytes arrive in pieces, each tensor's pieces in order."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[xxhash.xxh3_128, int]] = {}

    def update(self, name: str, piece: memoryview | bytes, size: int) -> str | None:
        """Add the next `piece` of tensor `name` (`size` bytes in all); its hex digest once
        the last byte is in, else None."""
        hasher, seen = self._open.pop(name, (None, 0))
        hasher = hasher or xxhash.xxh3_128()
        hasher.update(piece)
        seen += len(piece)
        if seen < size:
            self._open[name] = (hasher, seen)
            return None
        return hasher.hexdigest()

    @property
    def unfinished(self) -> list[str]:
        """Tensors some but not all of whose bytes were hashed."""
        return sorted(self._open)
