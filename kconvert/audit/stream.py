"""The streaming pass: every byte of CKPT (and, with --source, of its counterpart in the
source) is read once, in file order, and every check on data runs on what was read:
  hashes against the manifest (in order, as the pieces arrive);
  NaN/Inf in every floating tensor, scale values, the fused sets' stored scales;
  p48 chunks; against the source, bytes (same format, untouched) or decodes (re-encoded).

Work units: a plain tensor in pieces of at most `chunk` bytes, or a module's parameters
together (a quantized module, or one whose decode is compared). Several reader threads read
them ahead of the consumer, as many as fit in a window of READ_AHEAD pieces' bytes, and run
each unit's checks on the raw bits (numpy releases the interpreter lock); the consumer hashes
in order and takes the findings into the report; decode comparisons and p48 checks go to the
module worker (kconvert.audit.worker). Memory stays at about the window plus a few modules,
whatever the size of a shard or tensor.
"""

from __future__ import annotations

import functools
import queue
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kconvert.audit import cast, p48, scales
from kconvert.audit.bits import first_difference, where
from kconvert.audit.context import ROUTER_ROLES, AuditContext, StoredScales
from kconvert.audit.decode import DecodeJob, bound
from kconvert.audit.worker import ModuleWorker
from kconvert.checks.findings import Checks
from kconvert.formats.linear import ModuleWork
from kconvert.io.hashing import TensorHashes
from kconvert.io.readahead import read_ahead
from kconvert.io.shards import TensorInfo, byte_view
from kconvert.model.names import parse_name

SRC = "source"
READ_AHEAD = 8  # pieces' worth of bytes being read ahead of the consumer (both sides counted)
READERS = 8  # reader threads: enough reads in flight for a fast disk
HINT_AHEAD = 4  # read windows' worth of bytes announced to the kernel before they are read


@dataclass(frozen=True)
class Piece:
    """A byte range of a plain tensor, and the same range of its source counterpart."""

    info: TensorInfo
    offset: int
    length: int
    source: TensorInfo | None = None

    @property
    def key(self) -> tuple[str, int]:
        return str(self.info.file), self.info.start + self.offset

    @property
    def nbytes(self) -> int:
        return self.length * (2 if self.source is not None else 1)


@dataclass(frozen=True)
class ModuleUnit:
    """A module's parameters (and its source module's, when compared)."""

    module: ModuleWork
    source: ModuleWork | None
    decode: bool  # compared by decode (else, with a source, byte for byte)

    @property
    def key(self) -> tuple[str, int]:
        first = min(self.module.params.values(), key=lambda i: (str(i.file), i.start))
        return str(first.file), first.start

    @property
    def nbytes(self) -> int:
        own = sum(i.nbytes for i in self.module.params.values())
        return own + (sum(i.nbytes for i in self.source.params.values()) if self.source else 0)


Unit = Piece | ModuleUnit


@dataclass
class Read:
    """What reading and checking a unit gave the consumer."""

    checks: Checks
    hashed: list[tuple[TensorInfo, torch.Tensor]]  # the unit's bytes, per tensor in order
    buffers: list[torch.Tensor] = field(default_factory=list)  # pool buffers to give back
    stored: StoredScales | None = None
    job: DecodeJob | None = None
    p48: dict[str, torch.Tensor] | None = None  # a module's tensors, to check for p48
    cast: Callable[[], Checks] | None = None  # the exact cast's check of a module


class BufferPool:
    """Reused host buffers of `size` bytes for full-size pieces (no allocator churn, so
    resident memory stays at what is in flight); more are made when all are in use."""

    def __init__(self, size: int):
        self.size = size
        self.free: queue.SimpleQueue = queue.SimpleQueue()

    def take(self, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(a buffer of `length` bytes, the pool buffer it lies in, if it does)."""
        if length <= self.size // 2:
            return torch.empty(length, dtype=torch.uint8), None
        try:
            buf = self.free.get_nowait()
        except queue.Empty:
            buf = torch.empty(self.size, dtype=torch.uint8)
        return buf[:length], buf

    def give(self, buf: torch.Tensor) -> None:
        self.free.put(buf)


def plan_units(ctx: AuditContext) -> list[Unit]:
    """Every unit of the pass, in file order. Records which tensors have a counterpart."""
    units: list[Unit] = []
    in_modules: set[str] = set()
    source, man, refit = ctx.source, ctx.manifest, ctx.refit
    for m in ctx.ckpt.modules.values():
        names = {i.name for i in m.params.values()}
        if refit.keys() & names:
            # a re-fitted matrix: every parameter checked on the plan's hash (Stream.hash),
            # none against the source's bytes; a quantized one's scales checked as a module's
            ctx.report.check(SRC, names <= refit.keys(), "refit", "the plan's compensation "
                             f"records {sorted(refit.keys() & names)} of the module's "
                             f"parameters, not {sorted(names - refit.keys())}", tensor=m.module)
            if m.codec.quantized:
                units.append(ModuleUnit(m, None, False))
                in_modules.update(names)
                _refit_counterpart(ctx, m)
            continue
        s = ctx.source_module(m) if source is not None else None
        decode = False
        if s is not None:
            stages = {man.tensors[i.name].stage for i in m.params.values()
                      if man is not None and i.name in man.tensors}
            same = (s.codec is m.codec and set(s.params) == set(m.params) and all(
                (s.params[p].dtype, s.params[p].shape) == (i.dtype, i.shape)
                for p, i in m.params.items()))
            decode = any(st != "copy" for st in stages) or not same
            ctx.used_source.update(i.name for i in s.params.values())
            ctx.has_counterpart.update(i.name for i in m.params.values())
        if m.codec.quantized or decode:
            units.append(ModuleUnit(m, s, decode))
            in_modules.update(i.name for i in m.params.values())
    for name, info in ctx.ckpt.tensors.items():
        if name in in_modules:
            continue
        counterpart = None
        if name in refit:  # checked on its hash (Stream.hash), not on the source's bytes
            sname = ctx.source_name(name) if source is not None else None
            if sname is not None and sname in source.tensors:
                ctx.used_source.add(sname)
                ctx.has_counterpart.add(name)
        elif source is not None and parse_name(name).role not in ROUTER_ROLES:
            sname = ctx.source_name(name)
            cand = source.tensors.get(sname) if sname else None
            if cand is not None:
                ctx.used_source.add(cand.name)
                ctx.has_counterpart.add(name)
                if ctx.report.check(SRC, (cand.dtype, cand.shape) == (info.dtype, info.shape),
                                    "bytes", f"{info.dtype}{list(info.shape)} but source "
                                    f"{sname} is {cand.dtype}{list(cand.shape)}", tensor=name):
                    counterpart = cand
        for off in range(0, max(info.nbytes, 1), ctx.chunk):
            units.append(Piece(info, off, min(ctx.chunk, info.nbytes - off), counterpart))
    units.sort(key=lambda u: u.key)
    return units


def _refit_counterpart(ctx: AuditContext, m: ModuleWork) -> None:
    """A re-fitted quantized module stands for its source module (under the expert mapping)."""
    s = ctx.source_module(m) if ctx.source is not None else None
    if s is not None:
        ctx.used_source.update(i.name for i in s.params.values())
        ctx.has_counterpart.update(i.name for i in m.params.values())


class Stream:
    def __init__(self, ctx: AuditContext):
        self.ctx = ctx
        self.pool = BufferPool(ctx.chunk)
        self.hashes = TensorHashes()
        self.refit = ctx.refit
        self.cast_tally: Counter = Counter()  # exact-cast blocks checked (kconvert.audit.cast)

    def read(self, unit: Unit) -> Read:
        """Read a unit and run its checks (in a reader thread)."""
        return self._read_piece(unit) if isinstance(unit, Piece) else self._read_module(unit)

    def _read_piece(self, piece: Piece) -> Read:
        info, checks = piece.info, Checks()
        out, buf = self.pool.take(piece.length)
        self.ctx.ckpt.read_into(info, out, piece.offset)
        got = Read(checks, [(info, out)], [buf] if buf is not None else [])
        if info.nbytes % info.torch_dtype.itemsize == 0:
            scales.check_finite(checks, info, out, piece.offset)
        if piece.source is not None:
            src, buf = self.pool.take(piece.length)
            if buf is not None:
                got.buffers.append(buf)
            self.ctx.source.read_into(piece.source, src, piece.offset)
            at = first_difference(out, src)
            if at is not None:
                element = (piece.offset + at) // info.torch_dtype.itemsize
                checks.add(SRC, "bytes", f"differs from source {piece.source.name} at element "
                           f"{where(info, element)}", tensor=info.name)
            elif piece.offset + piece.length >= info.nbytes:
                checks.ran(SRC)
        return got

    def _read_module(self, unit: ModuleUnit) -> Read:
        m, s, ctx, checks = unit.module, unit.source, self.ctx, Checks()
        out = {p: ctx.ckpt.read(i) for p, i in m.params.items()}
        got = Read(checks, [(m.params[p], t) for p, t in out.items()])
        for p, info in m.params.items():
            scales.check_finite(checks, info, out[p].reshape(-1).view(torch.uint8))
        scales.check_scale_values(checks, m, out)
        if m.codec.global_scale_param is not None:
            got.stored = StoredScales(m.codec, out[m.codec.global_scale_param],
                                      out.get(m.codec.input_scale_param))
            if p48.declared_for(ctx, m):
                got.p48 = out
        if s is None:
            return got
        src = {p: ctx.source.read(i) for p, i in s.params.items()}
        if not unit.decode:
            for p, info in m.params.items():
                a, b = (t.reshape(-1).view(torch.uint8) for t in (out[p], src[p]))
                if len(a) == len(b) and first_difference(a, b) is None:
                    checks.ran(SRC)
                else:
                    checks.add(SRC, "bytes", f"differs from source {s.params[p].name} (same "
                               f"format {m.codec.name}, must be byte-identical)", tensor=info.name)
        elif checks.check(SRC, m.shape == s.shape and len(m.shape) == 2, "decode",
                          f"logical shape {list(m.shape)} but source {s.module} is "
                          f"{list(s.shape)}", tensor=m.primary.name):
            got.job = DecodeJob(m, s, out, src, bound(ctx, m))
            if cast.declared_for(ctx, m, s):
                got.cast = functools.partial(cast.check_module, ctx, m, s, out, src,
                                             self.cast_tally)
        return got

    def announce(self, units: list[Unit], window: int) -> Iterator[Unit]:
        """The units in order, each announced to the kernel `window` bytes before it is
        handed out to be read: the disk then has many requests in flight (into the page
        cache, which costs this process no memory) while the readers wait on few."""
        ahead, j = 0, 0
        for unit in units:
            while j < len(units) and ahead < window:
                self._will_need(units[j])
                ahead += units[j].nbytes
                j += 1
            ahead -= unit.nbytes
            yield unit

    def _will_need(self, unit: Unit) -> None:
        ckpt, source = self.ctx.ckpt, self.ctx.source
        if isinstance(unit, Piece):
            ckpt.will_need(unit.info, unit.offset, unit.length)
            if unit.source is not None:
                source.will_need(unit.source, unit.offset, unit.length)
            return
        for info in unit.module.params.values():
            ckpt.will_need(info)
        for info in (unit.source.params.values() if unit.source is not None else ()):
            source.will_need(info)

    def hash(self, info: TensorInfo, data: torch.Tensor) -> None:
        """Feed the next bytes of `info`; check its manifest hash, and the plan's for a
        re-fitted matrix, once the last are in."""
        man, refit = self.ctx.manifest, self.refit
        recorded = man is not None and info.name in man.tensors
        if not recorded and info.name not in refit:
            return
        digest = self.hashes.update(info.name, byte_view(data), info.nbytes)
        if digest is None:
            return
        if recorded:
            want = man.tensors[info.name].hash
            self.ctx.report.check("manifest", digest == want, "hash", f"xxh3-128 of the bytes is "
                                  f"{digest}, the manifest records {want}", tensor=info.name)
        if info.name in refit:
            self.ctx.report.check(SRC, digest == refit[info.name], "refit", f"xxh3-128 of the "
                                  f"bytes is {digest}, the plan's compensation wrote "
                                  f"{refit[info.name]}", layer=parse_name(info.name).layer,
                                  tensor=info.name)


def run(ctx: AuditContext) -> None:
    from tqdm import tqdm

    units = plan_units(ctx)
    stream = Stream(ctx)
    window = READ_AHEAD * stream.pool.size
    with tqdm(total=sum(u.nbytes for u in units), unit="B", unit_scale=True, unit_divisor=1024,
              desc="audit", disable=not ctx.progress, file=sys.stderr, smoothing=0.1) as bar, \
            ThreadPoolExecutor(READERS, thread_name_prefix="kconvert-audit-read") as pool, \
            ModuleWorker(ctx.report, ctx.device) as worker:
        announced = stream.announce(units, HINT_AHEAD * window)
        for unit, got in read_ahead(pool, announced, stream.read, window, size=lambda u: u.nbytes):
            ctx.report.merge(got.checks)
            for info, data in got.hashed:
                stream.hash(info, data)
            if got.stored is not None:
                ctx.fused[unit.module.tn.fused_set][unit.module.module] = got.stored
            if got.p48 is not None:
                worker.run(functools.partial(p48.check_module, unit.module, got.p48))
            if got.job is not None:
                worker.decode(got.job)
            if got.cast is not None:
                worker.run(got.cast)
            for buf in got.buffers:
                stream.pool.give(buf)
            worker.collect()
            bar.update(unit.nbytes)
        worker.finish()
    cast.note(ctx, stream.cast_tally)
