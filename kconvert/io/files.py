"""Whole-file writes that never leave a partly written file under the final name."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import xxhash


def write_atomically(path: Path, write: Callable[[BinaryIO], None], tmp: Path | None = None,
                     sync: bool = False, staged: Callable[[], None] | None = None) -> None:
    """Write `path` through `write(file)` on a temporary name, then rename it into place.

    `tmp` is the temporary name (default: a hidden name beside `path`); it must be on the same
    file system. With `sync`, the data and then the directory entry are flushed to disk, so a
    crash can never leave the new name pointing at missing data. `staged()` runs between the
    complete temporary file and the rename.
    """
    tmp = tmp or path.with_name(f".{path.name}.kconvert-tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        if staged is not None:
            staged()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)


def write_text(path: Path, text: str, tmp: Path | None = None, **kw) -> None:
    write_atomically(path, lambda fh: fh.write(text.encode()), tmp, **kw)


def write_json(path: Path, data: object, tmp: Path | None = None, **kw) -> None:
    write_text(path, json.dumps(data, indent=1, sort_keys=True), tmp, **kw)


def write_small_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """A whole safetensors file of `tensors` (a fixture's shard, held in memory whole),
    atomically and with the mode a new file gets under the umask (safetensors' save_file
    writes a private 0600 file of its own)."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    write_atomically(path, lambda fh: fh.write(data))


def copy_file(src: Path, dst: Path, tmp: Path | None = None) -> None:
    """Copy src's bytes to dst (contents only, like shutil.copyfile), atomically."""
    def write(fh: BinaryIO) -> None:
        with open(src, "rb") as sf:
            shutil.copyfileobj(sf, fh, 16 << 20)

    write_atomically(dst, write, tmp)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames into it) to disk; a no-op where the OS cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not fsync directories; the rename itself stands
    finally:
        os.close(fd)


def hash_file(path: Path, chunk: int = 16 << 20) -> str:
    """xxh3-128 hex digest of a file's bytes."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def human_bytes(n: int) -> str:
    """1234567 -> '1.2 MB', 123456789012 -> '123.46 GB' (decimal units, as disk sizes)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
