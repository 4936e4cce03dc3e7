"""Where bytes are read from and written to safetensors files.

Reading: safetensors' own `safe_open` validates every header (offsets, dtypes, file length);
the tensor bytes are then read with `os.preadv` into buffers we own, so a 10 GB shard never
gets mapped into the process (mmap'd pages count towards RSS) and only what a work item needs
is in memory.

Writing: an output shard's header is planned before any data exists (names, dtypes and shapes
follow from the plan), so tensors are written with `os.pwrite` at their final offsets as they
are produced, into `<shard>.partial`, then fsync'd and renamed into place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kconvert.errors import KconvertError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


WRITEBACK_BYTES = 256 << 20


SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


ST_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: absolute byte range in `file`."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _mis_sized(path: Path) -> str | None:
    """The first tensor whose header's byte range is not its dtype x shape (what safetensors'
    InvalidOffset / offsets-size errors do not name), or None."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, struct.error):
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > os.fstat(fh.fileno()).st_size:  # an absurd length: nothing to name
                return None
            header = json.loads(fh.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__" or entry["dtype"] not in DTYPES:
                continue
            start, end = entry["data_offsets"]
            if end - start != math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize:
                return name
    return None


# struct's little-endian codes of safetensors' integer dtypes (ShardReader.read_ints)
INT_CODES = {"I8": "b", "U8": "B", "I16": "h", "I32": "i", "I64": "q"}


class ShardReader:
    """Header-validated, lazily read safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            # safe_open checks the header JSON, the offsets and that the file is long enough.
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError, ValueError) as exc:
            raise KconvertError(f"unreadable safetensors file: {exc}", file=str(path),
                                tensor=_mis_sized(path)) from exc
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        base = 8 + header_len
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            dtype = entry["dtype"]
            if dtype not in DTYPES:
                raise KconvertError(f"unsupported dtype {dtype}", file=str(path), tensor=name)
            start, end = entry["data_offsets"]
            self.tensors[name] = TensorInfo(
                name, path, dtype, tuple(entry["shape"]), base + start, base + end
            )
        self._fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self._fd)

    def read_into(self, info: TensorInfo, out: torch.Tensor, offset: int = 0) -> None:
        """Fill the uint8 tensor `out` with the tensor's bytes starting at `offset`."""
        self._fill(info, memoryview(out.numpy()).cast("B"), offset)

    def _fill(self, info: TensorInfo, view: memoryview, offset: int) -> None:
        """`view` filled with the tensor's bytes from `offset` on, however the OS splits the
        reads."""
        pos, want = info.start + offset, len(view)
        done = 0
        while done < want:
            n = os.preadv(self._fd, [view[done:]], pos + done)
            if n == 0:
                raise KconvertError("file ended early", file=str(info.file), tensor=info.name)
            done += n

    def will_need(self, info: TensorInfo, offset: int = 0, length: int | None = None) -> None:
        """Tell the kernel these bytes of the tensor will be read soon, so that it starts
        reading them into the page cache now (a hint, where the OS takes one)."""
        if hasattr(os, "posix_fadvise"):
            length = info.nbytes - offset if length is None else length
            os.posix_fadvise(self._fd, info.start + offset, length, os.POSIX_FADV_WILLNEED)

    def read_ints(self, info: TensorInfo) -> tuple[int, ...]:
        """The values of a small tensor (an INT4 `weight_shape`) as ints. An integer one is
        unpacked from its bytes without a torch tensor: a full-size checkpoint has 69,120 of
        them, read while planning (docs/performance.md, planning a full-size Kimi)."""
        code = INT_CODES.get(info.dtype)
        if code is None:
            return tuple(int(v) for v in self.read(info).reshape(-1).tolist())
        data = bytearray(info.nbytes)
        self._fill(info, memoryview(data), 0)
        return struct.unpack(f"<{info.nbytes // struct.calcsize(code)}{code}", data)

    def read(self, info: TensorInfo, pin: bool = False) -> torch.Tensor:
        """The tensor, typed and shaped, in a fresh (optionally pinned) CPU buffer."""
        raw = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.read_into(info, raw)
        return raw.view(info.torch_dtype).reshape(info.shape)


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Byte size of a tensor of safetensors dtype `dtype` and `shape`."""
    n = DTYPES[dtype].itemsize
    for dim in shape:
        n *= dim
    return n


def plan_header(entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, dict]:
    """Header bytes and per-tensor (start, end) data offsets for a file of these tensors.

    Tensors are laid out largest element size first, then by name, so every tensor starts
    aligned to its element size; the header is padded to 8 bytes as safetensors does.
    """
    ordered = sorted(entries, key=lambda e: (-DTYPES[e[1]].itemsize, e[0]))
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, dtype, shape in ordered:
        n = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[name] = (pos, pos + n)
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offsets


def byte_view(data: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, as stored (no copy if it is contiguous)."""
    return memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


class ShardWriter:
    """Writes one planned safetensors file; tensors may arrive in any order and in pieces.

    With `shared`, other processes write other tensors of the same partial file (ranks under
    torchrun): it is opened without truncation (every byte of it is written again by this run:
    the header, the same bytes, by every writer, each tensor by one), each writer ends with
    `close_part` and one of them renames the file (`finish_shared`)."""

    def __init__(self, final: Path, partial: Path, entries: list[tuple[str, str, tuple[int, ...]]],
                 shared: bool = False):
        self.final, self.partial = final, partial
        head, offsets = plan_header(entries)
        self.base = len(head)
        self.offsets = offsets
        self.size = self.base + (max((e for _, e in offsets.values()), default=0))
        self._fd = os.open(partial, os.O_WRONLY | os.O_CREAT | (0 if shared else os.O_TRUNC),
                           0o644)
        self._unflushed = 0
        os.ftruncate(self._fd, self.size)
        os.pwrite(self._fd, head, 0)

    def write(self, name: str, data: torch.Tensor, offset: int = 0) -> None:
        """Write `data` (any dtype, contiguous CPU) at byte `offset` inside tensor `name`."""
        start, end = self.offsets[name]
        view = byte_view(data)
        if start + offset + len(view) > end:
            raise AssertionError(f"{name}: write past the planned end of the tensor")
        pos, done = self.base + start + offset, 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], pos + done)
        self._unflushed += len(view)
        if self._unflushed >= WRITEBACK_BYTES:
            # Start writeback now instead of leaving gigabytes dirty for the final fsync, which
            # would then stall the disk (and the reads) for seconds at the end of each shard.
            start_writeback(self._fd)
            self._unflushed = 0

    def finish(self) -> None:
        """fsync and rename: the final name only ever holds a complete file."""
        os.fsync(self._fd)
        os.close(self._fd)
        os.replace(self.partial, self.final)

    def close_part(self) -> None:
        """A shared file: this writer's bytes on disk (fsync), the file left for its owner."""
        os.fsync(self._fd)
        os.close(self._fd)

    def abandon(self) -> None:
        os.close(self._fd)


def finish_shared(final: Path, partial: Path) -> None:
    """Rename a shared partial file into place once every writer's `close_part` returned."""
    os.replace(partial, final)


def _sync_file_range():
    """libc's sync_file_range (Linux only; Python's os module does not expose it)."""
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


# What a sandbox or a file system without the call answers (seccomp, pipes, some FUSE mounts).
_NOT_SUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP}


def start_writeback(fd: int) -> bool:
    """Queue the file's dirty pages for writing, without waiting; False where the OS or the
    file system has no such call (the final fsync then writes everything, only slower). A real
    error (a bad descriptor, an I/O error) raises."""
    if _SYNC_FILE_RANGE is None:
        return False
    if _SYNC_FILE_RANGE(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        if err in _NOT_SUPPORTED:
            return False
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")
    return True


def read_header(path: Path) -> bytes:
    """The raw header of a safetensors file (8-byte length + JSON), for resume checks."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return b""
        (n,) = struct.unpack("<Q", head)
        return head + fh.read(n)
