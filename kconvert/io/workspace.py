"""Where a run writes (`Workspace`: DST itself, or a staging directory beside it for an
`--overwrite` that has room for both) and how a finished one becomes DST: the swap, and the
removal of the run state once the manifest is written (kconvert.io.output_dir prepares it)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kconvert.common import events
from kconvert.io.existing_output import RUN_FILE, accounted_files
from kconvert.io.lock import LOCK_FILE, STATE_DIR, acquire

STAGING_SUFFIX = ".kconvert-new"


@dataclass
class Workspace:
    """Where a run writes: DST itself, or (`replaces`) a staging directory swapped in for DST."""

    dst: Path
    root: Path
    replaces: bool = False

    @property
    def state(self) -> Path:
        return self.root / STATE_DIR

    def tmp(self, rel: str) -> Path:
        """The temporary name of output file `rel` while it is written."""
        return self.state / "tmp" / rel.replace("/", "%")


def staging_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}{STAGING_SUFFIX}"


def commit(ws: Workspace, echo: Callable[[str], None]) -> None:
    """Make the finished workspace DST and remove the run state (the manifest is written)."""
    if not ws.replaces:
        _clear_state(ws)
        return
    # The staging directory's own lock file becomes DST's when the two swap: held from before
    # the swap until the run state is gone, so no other run can start into DST in between.
    fd = acquire(ws.state / LOCK_FILE, echo)
    try:
        old = _exchange(ws.root, ws.dst)
        events.emit("output-committed", dst=str(ws.dst))
        shutil.rmtree(old)
        _clear_state(Workspace(ws.dst, ws.dst))
    finally:
        with contextlib.suppress(OSError):
            (ws.dst / STATE_DIR / LOCK_FILE).unlink()
        os.close(fd)


def _clear_state(ws: Workspace) -> None:
    for sub in ("partial", "done", "tmp"):
        shutil.rmtree(ws.state / sub, ignore_errors=True)
    (ws.state / RUN_FILE).unlink(missing_ok=True)


def remove_leftovers(dst: Path, echo: Callable[[str], None]) -> None:
    """Delete what an interrupted swap left beside DST: a staging directory without run state
    holds the output that was being replaced (the swap had happened)."""
    for path in (staging_dir(dst), dst.parent / f".{dst.name}.kconvert-old"):
        if path.is_dir() and not (path / STATE_DIR / RUN_FILE).is_file() \
                and accounted_files(path) is not None:
            echo(f"removing {path}, the previous output left by an interrupted replacement")
            shutil.rmtree(path)


def _exchange(new: Path, dst: Path) -> Path:
    """Put directory `new` at `dst`; returns where the old `dst` now is. Atomic where the OS
    can swap two names in one step (Linux renameat2); else two renames."""
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if _renameat2 is not None and _renameat2(at_cwd, os.fsencode(new), at_cwd,
                                             os.fsencode(dst), exchange) == 0:
        return new
    old = dst.parent / f".{dst.name}.kconvert-old"
    if old.exists():
        shutil.rmtree(old)
    os.replace(dst, old)
    os.replace(new, dst)
    return old


def _load_renameat2():
    """libc's renameat2 (Linux, glibc >= 2.28), which Python's os module does not expose."""
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()
