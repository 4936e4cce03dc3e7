"""One run at a time: DST's run lock, held with flock for the whole run.

The OS releases it if the holder dies; a second run is refused naming the holder (its pid,
start time and command line, which the holder writes into the lock file)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kconvert.errors import KconvertError

STATE_DIR = ".kconvert"
LOCK_FILE = "lock"


@contextlib.contextmanager
def locked(dst: Path, echo: Callable[[str], None]) -> Iterator[None]:
    """Hold DST's run lock (creating DST if needed); refuse if another run holds it."""
    created = not dst.exists()
    try:
        (dst / STATE_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise unwritable(dst, exc) from exc
    path = dst / STATE_DIR / LOCK_FILE
    fd = acquire(path, echo)
    try:
        yield
    finally:
        # Unlink while holding it: a run that opens the path afterwards makes a new file.
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        with contextlib.suppress(OSError):
            (dst / STATE_DIR).rmdir()  # only when nothing else is in it
        if created:
            with contextlib.suppress(OSError):
                dst.rmdir()  # a run that wrote nothing leaves no empty DST behind


def acquire(path: Path, echo: Callable[[str], None]) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise unwritable(path.parent.parent, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            raise in_use(path.parent.parent, holder) from exc
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            echo(f"note: {path.parent.parent} does not support file locks; a second run into "
                 "it at the same time would not be detected")
        # The path may have been unlinked by a finishing holder between open and flock.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        info = json.dumps({"pid": os.getpid(), "command": shlex.join(sys.argv),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        return fd


def holder_of(path: Path) -> str | None:
    """What the lock file says of the run holding it, or None if no run holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return None  # no locks on this file system: nothing to learn here
    finally:
        os.close(fd)
    return None


def in_use(dst: Path, holder: str) -> KconvertError:
    try:
        info = json.loads(holder)
        who = f"pid {info['pid']}, started {info['started']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        who = "holder unknown"
    return KconvertError(f"another kconvert run is writing into DST ({who}); wait for it to "
                         "finish or stop it", file=str(dst))


def unwritable(where: Path, exc: OSError) -> KconvertError:
    """A clear error for a DST the OS refuses to write."""
    why = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable by you",
           errno.EPERM: "is not writable by you"}.get(exc.errno, f"cannot be written ({exc})")
    return KconvertError(f"DST {why}; choose a writable DST", file=str(where))
