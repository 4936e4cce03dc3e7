"""Where a command writes, against what it reads: a directory it writes never overlaps a
checkpoint it reads, and one it cannot write is refused before any work (conversions' DST:
kconvert.io.output_dir; `calibrate -o`, `eval -o`: `check_output_dir`)."""

from __future__ import annotations

import os
from pathlib import Path

from kconvert.errors import KconvertError


def overlaps(a: Path, b: Path) -> bool:
    """Whether directories a and b are the same, or one is inside the other."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def check_output_dir(out: Path, sources: list[Path], what: str) -> None:
    """Refuse, before any work, a directory a command writes (`calibrate -o`, `eval -o`) that
    overlaps a checkpoint it reads, is not a directory, or cannot be written."""
    for src in sources:
        if overlaps(src, out):
            raise KconvertError(f"{what} must not be {src}, inside it, or contain it (a "
                                "checkpoint is never modified)", file=str(out))
    probe = out.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise KconvertError(f"{what} is below {probe}, which is not a directory", file=str(out))
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise KconvertError(f"{what} is on a read-only file system; choose a writable "
                            "directory", file=str(out))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise KconvertError(f"{what} is not writable by you ({probe}); choose a writable "
                            "directory", file=str(out))
