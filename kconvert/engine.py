"""The streaming engine: plan every output byte, then read -> compute -> write in a pipeline.

1. `build_plan` turns the source's tensors and the stages into output tensors, output shard
   headers and a list of work items: copy items (byte ranges of tensors that pass through,
   at most COPY_CHUNK each) and transform items (a few fused sets of one layer and role,
   sized so their fp32 decode fits `work_elems`).
2. `execute` runs the items: reader threads fill host buffers ahead (bounded prefetch), the
   calling thread decodes/transforms/encodes on the chosen device, one writer thread
   `pwrite`s results into planned `.partial` files while a hasher thread hashes them, and
   each shard is renamed into place the moment its last byte is written, its hashes
   recorded under `.kconvert/done/`.
Memory is bounded by (prefetch + queue) items, never by shard or model size. On a CPU run the
reader, writer and hasher threads get cores of their own (`split_cores`), the kernels the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from kconvert import events, nvfp4
from kconvert.codecs import DenseCodec, Int4Codec
from kconvert.errors import KconvertError
from kconvert.files import write_json
from kconvert.layout import Role, parse_name, split_param
from kconvert.output_dir import STATE_DIR
from kconvert.safetensors_io import (
    ShardWriter,
    TensorInfo,
    byte_view,
    read_ahead,
    tensor_nbytes,
)
from kconvert.source import Checkpoint
from kconvert.stages import ModulePlan, Quantize, Stage, group_modules

# Pass-through bytes move in pieces of this size (memory: ~8 pieces in flight).
COPY_CHUNK = 16 << 20
# On a CPU run the reader and writer threads get cores of their own, one in IO_CORE_EVERY of
# the cores this process may use (none below that many), and the kernels the rest. Sharing
# cores, an I/O thread preempts a kernel thread, and a parallel kernel waits for its slowest
# thread: on 16 cores an expert matrix took 28-32 ms end to end that way, 19 ms with two
# cores set apart (scripts/results/README.md, session 4).
IO_CORE_EVERY = 8
# Thread masks are read and set per thread through /proc/self/task: Linux only.
_CAN_PIN = sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    sources: tuple[str, ...]
    stage: str  # "copy" or the stages that produced it, e.g. "dequant+quantize"


@dataclass(frozen=True)
class Chunk:
    """A byte range of a pass-through tensor; with `rows`, the whole tensor, rows selected."""

    info: TensorInfo
    out_name: str
    offset: int
    length: int
    rows: tuple[int, ...] | None = None


@dataclass
class CopyItem:
    chunks: list[Chunk]

    @property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass
class DecodeGroup:
    """Same-codec, same-shape, same-treatment modules decoded as one batch [B, out, in]."""

    modules: list[ModulePlan]

    @property
    def codec(self):
        return self.modules[0].codec

    @property
    def params(self) -> tuple[str, ...]:
        """Source parameters read: the codec's, plus those a re-layout carries over."""
        return self.codec.params + self.modules[0].carried


@dataclass
class TransformItem:
    sets: list[list[ModulePlan]]
    groups: list[DecodeGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        by_key: dict[tuple, list[ModulePlan]] = defaultdict(list)
        for fused in self.sets:
            for m in fused:
                key = (m.codec.name, m.shape, m.out_codec.__name__, m.block, m.repack,
                       m.carried, id(m.transform))
                by_key[key].append(m)
        self.groups = [DecodeGroup(ms) for ms in by_key.values()]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for s in self.sets for m in s for i in m.params.values())


Item = CopyItem | TransformItem


@dataclass
class Plan:
    ckpt: Checkpoint
    stages: list[Stage]
    modules: list[ModulePlan]
    outputs: dict[str, OutTensor]
    items: list[Item]
    dropped: dict[str, str]  # source tensor -> why it has no output

    @property
    def shard_entries(self) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
        entries: dict[str, list] = defaultdict(list)
        for t in self.outputs.values():
            entries[t.shard].append((t.name, t.dtype, t.shape))
        return dict(sorted(entries.items()))

    @property
    def block_scale(self) -> str:
        return next((s.block_scale for s in self.stages if isinstance(s, Quantize)), "mse")

    def item_shards(self, item: Item) -> set[str]:
        if isinstance(item, CopyItem):
            return {self.outputs[c.out_name].shard for c in item.chunks}
        return {m.primary.file.name for s in item.sets for m in s}


def read_shape_values(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Contents of every INT4 `weight_shape` tensor (8-16 bytes each), needed to plan shapes."""
    values = {}
    for name, info in ckpt.tensors.items():
        if name.endswith(".weight_shape"):
            values[name] = tuple(int(v) for v in ckpt.reader_for(info).read(info).tolist())
    return values


def _renames(names, stages: list[Stage]) -> dict[str, tuple[str | None, tuple[int, ...] | None]]:
    """Source name -> (output name or None if dropped, router rows kept or None)."""
    out = {}
    for name in names:
        new, rows = name, None
        for stage in stages:
            if new is None:
                break
            new, stage_rows = stage.rename(parse_name(new))
            rows = stage_rows if stage_rows is not None else rows
        out[name] = (new, rows)
    return out


def build_plan(ckpt: Checkpoint, stages: list[Stage], work_elems: int) -> Plan:
    tensors = ckpt.tensors
    renames = _renames(tensors, stages)
    dropped = {n: "routed expert not kept by the plan" for n, (new, _) in renames.items()
               if new is None}
    all_modules, others = group_modules(tensors, read_shape_values(ckpt))
    modules = []
    for m in all_modules:
        new = renames[m.primary.name][0]
        if new is None:
            continue
        m.out_module = split_param(new)[0]
        for stage in stages:
            stage.plan(m)
        modules.append(m)
    _share_input_amax(modules)

    outputs: dict[str, OutTensor] = {}
    copies: list[tuple[TensorInfo, str, tuple[int, ...] | None]] = [
        (info, *renames[info.name]) for info in others if renames[info.name][0] is not None
    ]
    transformed: list[ModulePlan] = []
    for m in modules:
        if m.out_codec is None:
            copies += [(info, m.out_module + "." + p, None) for p, info in m.params.items()]
            continue
        transformed.append(m)
        stage = "+".join(m.stages)
        sources = tuple(i.name for i in m.params.values())
        for param, dtype, shape in m.out_specs():
            name = f"{m.out_module}.{param}"
            outputs[name] = OutTensor(name, dtype, tuple(shape), m.primary.file.name, sources,
                                      stage)
    for info, out_name, rows in copies:
        shape = info.shape if rows is None else (len(rows), *info.shape[1:])
        stage = "copy" if rows is None else "select-rows"
        outputs[out_name] = OutTensor(out_name, info.dtype, shape, info.file.name, (info.name,),
                                      stage)

    items: list[Item] = []
    for shard in ckpt.shards:
        items += _copy_items([c for c in copies if c[0].file.name == shard])
        items += _transform_items([m for m in transformed if m.primary.file.name == shard],
                                  work_elems)
    if any(s.ordered_layers for s in stages):
        # A stage that streams calibration layers forward (SparseGPT) needs layer order
        # across shards too; sorted() is stable, so within a layer shard order stays.
        items.sort(key=lambda it: -1 if isinstance(it, CopyItem) else _item_layer(it))
    return Plan(ckpt, stages, modules, outputs, items, dropped)


def _item_layer(item: TransformItem) -> int:
    layer = item.sets[0][0].tn.layer
    return -1 if layer is None else layer


def _share_input_amax(modules: list[ModulePlan]) -> None:
    """A fused set runs as one GEMM on one quantized input: its members share the input scale."""
    sets: dict[str, list[ModulePlan]] = defaultdict(list)
    for m in modules:
        sets[m.tn.fused_set].append(m)
    for members in sets.values():
        given = [m.input_amax for m in members if m.input_amax is not None]
        if given:
            if len(given) != len(members):
                raise KconvertError("activation statistics cover only part of a fused set",
                                    tensor=members[0].tn.fused_set)
            for m in members:
                m.input_amax = max(given)


def _copy_items(copies: list[tuple[TensorInfo, str, tuple[int, ...] | None]]) -> list[CopyItem]:
    """Pass-through bytes in items of at most COPY_CHUNK: big tensors split, small ones merged.

    A tensor with selected rows (a pruned router) is read whole: it is small.
    """
    items, current, size = [], [], 0
    for info, out_name, rows in sorted(copies, key=lambda c: c[0].start):
        item_size = info.torch_dtype.itemsize
        step = info.nbytes if rows is not None else COPY_CHUNK // item_size * item_size
        for offset in range(0, max(info.nbytes, 1), max(step, item_size)):
            length = min(step, info.nbytes - offset)
            if size + length > COPY_CHUNK and current:
                items.append(CopyItem(current))
                current, size = [], 0
            current.append(Chunk(info, out_name, offset, length, rows))
            size += length
    if current:
        items.append(CopyItem(current))
    return items


def _transform_items(modules: list[ModulePlan], work_elems: int) -> list[TransformItem]:
    """Fused sets of one layer and role, batched up to `work_elems` decoded elements."""
    sets: dict[str, list[ModulePlan]] = {}
    for m in modules:
        sets.setdefault(m.tn.fused_set, []).append(m)

    def order(s: list[ModulePlan]) -> tuple:
        tn = s[0].tn
        return (tn.layer if tn.layer is not None else -1, tn.role.value,
                tn.expert if tn.expert is not None else -1, tn.fused_set)

    items, current, elems, key = [], [], 0, None
    for fused in sorted(sets.values(), key=order):
        fused.sort(key=lambda m: m.module)
        n = sum(m.shape[0] * m.shape[1] for m in fused)
        this_key = (fused[0].tn.layer, fused[0].tn.role)
        if current and (this_key != key or elems + n > work_elems):
            items.append(TransformItem(current))
            current, elems = [], 0
        current.append(fused)
        elems += n
        key = this_key
    if current:
        items.append(TransformItem(current))
    return items


# ---------------------------------------------------------------- execution

@dataclass
class ModuleStats:
    amax: float
    global_scale: float | None
    err_sq: float
    ref_sq: float


@dataclass
class Result:
    """What the compute step hands the writer: out tensors (name, bytes, offset) + stats."""

    index: int
    writes: list[tuple[str, torch.Tensor, int]]
    stats: dict[str, ModuleStats]
    nbytes: int


def read_item(ckpt: Checkpoint, item: Item, pin: bool) -> list[torch.Tensor]:
    """Host buffers for an item: one per copy chunk, or one stacked tensor per group param."""
    if isinstance(item, CopyItem):
        # Pass-through bytes never reach the GPU: plain memory, and the NaN/Inf check and row
        # selection happen here in the reader threads, off the compute thread's critical path.
        bufs = []
        for c in item.chunks:
            buf = torch.empty(c.length, dtype=torch.uint8)
            ckpt.reader_for(c.info).read_into(c.info, buf, c.offset)
            _check_finite(buf, c.info)
            if c.rows is not None:
                rows = torch.tensor(c.rows, dtype=torch.long)
                buf = buf.view(c.info.torch_dtype).reshape(c.info.shape).index_select(0, rows)
            bufs.append(buf)
        return bufs
    bufs = []
    for group in item.groups:
        for param in group.params:
            first = group.modules[0].params[param]
            raw = torch.empty(len(group.modules), first.nbytes, dtype=torch.uint8, pin_memory=pin)
            for i, m in enumerate(group.modules):
                info = m.params[param]
                if info.shape != first.shape or info.dtype != first.dtype:
                    raise KconvertError(
                        f"{param} is {info.dtype}{list(info.shape)} but its siblings are "
                        f"{first.dtype}{list(first.shape)}", file=info.file.name, tensor=info.name)
                ckpt.reader_for(info).read_into(info, raw[i])
            bufs.append(raw.view(first.torch_dtype).reshape(len(group.modules), *first.shape))
    return bufs


def _nonfinite_param(ckpt: Checkpoint, m: ModulePlan) -> TensorInfo:
    """The parameter of `m` that holds the NaN/Inf (error path only: it re-reads them).

    An INT4 module's bad value is in its weight_scale, never in the int32 weight_packed.
    """
    for info in m.params.values():
        if _nonfinite(ckpt.reader_for(info).read(info).reshape(-1).view(torch.uint8),
                      info.torch_dtype):
            return info
    return m.primary


# Per float dtype: its bits as an unsigned integer, and the bits that are all ones exactly for
# Inf and NaN (the exponent field; FP8 e4m3fn has no Inf, and its NaN is exponent and mantissa
# all ones). Pass-through bytes are checked on these bits with numpy, single-threaded: torch's
# isfinite from a reader thread starts a thread pool of its own for that thread, and on a CPU
# run, with the reader threads kept to a core or two, those pools fought over them (the
# full-size set's pass-through reads took 2.6x as long).
_NONFINITE_BITS = {torch.float16: np.uint16(0x7C00), torch.bfloat16: np.uint16(0x7F80),
                   torch.float32: np.uint32(0x7F800000),
                   torch.float64: np.uint64(0x7FF0000000000000),
                   torch.float8_e4m3fn: np.uint8(0x7F), torch.float8_e5m2: np.uint8(0x7C)}


def _nonfinite(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the uint8 bytes `raw` of values of `dtype` hold a NaN or Inf (never for
    integers; safetensors is little-endian, as every machine torch runs on)."""
    ones = _NONFINITE_BITS.get(dtype)
    return ones is not None and bool(
        np.any(np.bitwise_and(raw.numpy().view(ones.dtype), ones) == ones))


def _check_finite(raw: torch.Tensor, info: TensorInfo) -> None:
    """Raise if the uint8 bytes `raw` of a piece of `info` hold a NaN or Inf."""
    if _nonfinite(raw, info.torch_dtype):
        raise KconvertError("NaN or Inf in the source weights", file=info.file.name,
                            tensor=info.name)


def compute_item(plan: Plan, item: Item, bufs: list[torch.Tensor], device: torch.device,
                 index: int, chunk_elems: int) -> Result:
    if isinstance(item, CopyItem):
        writes = [(c.out_name, buf, c.offset) for c, buf in zip(item.chunks, bufs, strict=True)]
        return Result(index, writes, {}, item.nbytes)

    # Decode every group to fp32 on the device: one batched op per (codec, shape) group.
    # A re-laid-out group (densify) is not decoded: its NVFP4 bytes go through unchanged.
    decoded: list[torch.Tensor | None] = []
    raw: list[dict[str, torch.Tensor]] = []
    amax: dict[str, torch.Tensor] = {}
    pos = 0
    for group in item.groups:
        params = {}
        for param in group.params:
            params[param] = bufs[pos].to(device, non_blocking=True)
            pos += 1
        raw.append(params)
        if group.modules[0].repack:
            decoded.append(None)
            continue
        if _fused_int4(group, device):  # decoded inside the CPU encoder, never as fp32
            group_amax = nvfp4.int4_amax(params["weight_packed"], params["weight_scale"])
            decoded.append(None)
        else:
            w = group.codec.decode(params, group.modules[0].shape)
            group_amax = torch.maximum(w.amax(dim=(1, 2)), w.amin(dim=(1, 2)).neg())  # no |w|
            decoded.append(w)
        amax.update({m.module: group_amax[i] for i, m in enumerate(group.modules)})
    checked = [m for g in item.groups if not g.modules[0].repack for m in g.modules]
    finite = _to_host(torch.isfinite(torch.stack([amax[m.module] for m in checked]))) \
        if checked else torch.ones(0, dtype=torch.bool)

    # A fused set's members share the largest amax of the set (one global scale), taken
    # from the source weights, before any transform.
    set_amax = {}
    for fused in item.sets:
        if fused[0].module in amax:
            shared = torch.stack([amax[m.module] for m in fused]).amax()
            set_amax.update({m.module: shared for m in fused})

    writes, stats, encoded = [], {}, []
    for group, w, params in zip(item.groups, decoded, raw, strict=True):
        ms = group.modules
        out_codec = ms[0].out_codec
        if ms[0].repack:
            q = _unpacked(group.codec, params)
            carried = {p: _to_host(params[p]) for p in ms[0].carried}
            encoded.append((ms, q, _to_host(nvfp4.GLOBAL_NUMERATOR / q.global_scale), carried))
            continue
        if out_codec is DenseCodec:
            enc = _to_host(DenseCodec.encode(w, ms[0].dense_dtype)["weight"])
            for i, m in enumerate(ms):
                writes.append((m.out_module + ".weight", enc[i], 0))
            continue
        a = torch.stack([set_amax[m.module] for m in ms])
        if w is None:
            q = nvfp4.quantize_int4(params["weight_packed"], params["weight_scale"], a,
                                    plan.block_scale, ms[0].block, chunk_elems)
            encoded.append((ms, q, a, {}))
            continue
        src_dtype = ms[0].primary.torch_dtype
        local = src_dtype if ms[0].codec is DenseCodec else torch.float32
        source, codes = w, None
        if ms[0].transform is not None:
            w, codes = ms[0].transform.transform(ms, w, nvfp4.global_scale(a), plan.block_scale,
                                                 local)
        q = nvfp4.quantize(w, a, plan.block_scale, chunk_elems, local_dtype=local,
                           block=ms[0].block, block_codes=codes)
        if w is not source:  # the error that matters is against the source, not the transform
            q.err_sq, q.ref_sq = _error_vs(source, q)
        q = nvfp4.Quantized(*(_to_host(t) for t in (q.packed, q.block_scale, q.global_scale,
                                                    q.err_sq, q.ref_sq)))
        encoded.append((ms, q, _to_host(a), {}))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the one wait per item: every host copy has landed
    for ok, m in zip(finite.tolist(), checked, strict=True):
        if not ok:
            bad = _nonfinite_param(plan.ckpt, m)
            raise KconvertError("NaN or Inf in the source weights", file=bad.file.name,
                                tensor=bad.name)
    for ms, q, a, carried in encoded:
        out_codec = ms[0].out_codec
        gs, err, ref, amaxes = (q.global_scale.tolist(), q.err_sq.tolist(), q.ref_sq.tolist(),
                                a.tolist())
        for i, m in enumerate(ms):
            tensors = {**out_codec.encode(q, i, m.input_amax),
                       **{p: t[i] for p, t in carried.items()}}
            for param, t in tensors.items():
                writes.append((f"{m.out_module}.{param}", t, 0))
            stats[m.out_module] = ModuleStats(amaxes[i], gs[i], err[i], ref[i])
    return Result(index, writes, stats, item.nbytes)


def _fused_int4(group: DecodeGroup, device: torch.device) -> bool:
    """INT4 -> NVFP4 with no transform, on a CPU: the fused kernel decodes while it encodes
    (about 4x faster than an fp32 decode first; same bytes, tested)."""
    m = group.modules[0]
    return (device.type == "cpu" and group.codec is Int4Codec and m.transform is None
            and not m.repack and m.out_codec is not DenseCodec)


def _unpacked(codec, params: dict[str, torch.Tensor]) -> nvfp4.Quantized:
    """NVFP4 bytes of a re-layout, host-side; it changes no value, so its error is 0."""
    packed, scales, gs = (_to_host(t) for t in codec.unpack(params))
    zero = torch.zeros(packed.shape[0], dtype=torch.float64)
    return nvfp4.Quantized(packed, scales, gs, zero, zero)


def _error_vs(source: torch.Tensor, q: nvfp4.Quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squared error of q's decode against `source`, sum of source squares) [B]."""
    err = (nvfp4.dequantize(q.packed, q.block_scale, q.global_scale) - source).square()
    return (err.sum((1, 2), dtype=torch.float64),
            source.square().sum((1, 2), dtype=torch.float64))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> pinned host copy, not waited for (compute_item synchronises once per item);
    a CPU tensor is returned as it is."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ShardSink:
    """The writer side: planned .partial files, hashing, and rename-on-complete."""

    def __init__(self, plan: Plan, dst: Path, done: dict[str, dict]):
        self.plan, self.dst = plan, dst
        self.state = dst / STATE_DIR
        (self.state / "partial").mkdir(parents=True, exist_ok=True)
        (self.state / "done").mkdir(parents=True, exist_ok=True)
        self.entries = plan.shard_entries
        self.done = done  # shard -> record, for shards already complete
        self.skipped = set(done)  # complete before this run: nothing is written or hashed
        # A module's outputs all land in the shard of its primary source tensor.
        self.module_shard = {m.out_module: m.primary.file.name for m in plan.modules}
        # Data bytes still to write per shard; the shard is finished when this reaches 0.
        self.remaining = {shard: sum(tensor_nbytes(d, s) for _, d, s in e)
                          for shard, e in self.entries.items()}
        self.writers: dict = {}
        self.hashers: dict[str, xxhash.xxh3_128] = {}
        self.records: dict[str, dict] = defaultdict(lambda: {"tensors": {}, "modules": {}})

    def _complete(self, name: str, offset: int, nbytes: int) -> bool:
        out = self.plan.outputs[name]
        return offset + nbytes == tensor_nbytes(out.dtype, out.shape)

    def hash(self, result: Result) -> dict[str, str]:
        """Content hashes of the output tensors that `result` completes. Runs in a thread of
        its own, beside the writer, one result after another in order (a tensor may span
        results). In the writer thread, hashing kept the writer, the pipeline's busiest
        stage, busy 2.7 s longer per 15.5 GB (scripts/results/README.md, session 5)."""
        digests = {}
        for name, data, offset in result.writes:
            if self.plan.outputs[name].shard in self.skipped:
                continue
            view = byte_view(data)
            hasher = self.hashers.setdefault(name, xxhash.xxh3_128())
            hasher.update(view)
            if self._complete(name, offset, len(view)):
                digests[name] = self.hashers.pop(name).hexdigest()
        return digests

    def write(self, result: Result, hashed: Future) -> None:
        """Write `result`'s bytes; `hashed` is its `hash`, computed meanwhile."""
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
                    self.dst / shard, self.state / "partial" / shard, self.entries[shard])
            writer.write(name, data, offset)
            self.remaining[shard] -= data.numel() * data.element_size()
            if self.remaining[shard] == 0:
                finished.append(shard)
        for name, digest in hashed.result().items():
            self.records[self.plan.outputs[name].shard]["tensors"][name] = digest
        for shard in finished:
            self._finish(shard)

    def _finish(self, shard: str) -> None:
        self.writers.pop(shard).finish()
        record = self.records.pop(shard)
        write_json(self.state / "done" / f"{shard}.json", record,
                   self.state / "tmp" / f"{shard}.json")
        self.done[shard] = record
        events.emit("shard-done", shard=shard)

    def finish_empty(self) -> None:
        """Shards with no data bytes at all (possible only for zero-size tensors)."""
        for shard, left in self.remaining.items():
            if left == 0 and shard not in self.done:
                self.writers[shard] = ShardWriter(
                    self.dst / shard, self.state / "partial" / shard, self.entries[shard])
                self._finish(shard)

    def abandon(self) -> None:
        for writer in self.writers.values():
            writer.abandon()



def execute(
    plan: Plan,
    dst: Path,
    device: torch.device,
    done: dict[str, dict],
    progress: Callable[[int], None],
    readers: int = 4,
    prefetch: int = 4,
) -> dict[str, dict]:
    """Run every item whose output is not already complete; returns shard -> record."""
    _fix_mmap_threshold()
    sink = ShardSink(plan, dst, done)
    todo = [(i, it) for i, it in enumerate(plan.items) if plan.item_shards(it) - set(done)]
    skipped = sum(it.nbytes for it in plan.items) - sum(it.nbytes for _, it in todo)
    if skipped:
        progress(skipped)
    pin = device.type == "cuda"
    chunk_elems = 1 << 27 if device.type == "cuda" else 1 << 22
    results: queue.Queue = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def writer(io_cores: set[int] | None) -> None:
        _pin_thread(io_cores)
        while (got := results.get()) is not None:
            if failure:
                continue
            try:
                sink.write(*got)
                progress(got[0].nbytes)
            except BaseException as exc:  # surfaced by the main thread
                failure.append(exc)

    with _cores_set_apart(device) as io_cores, \
            ThreadPoolExecutor(1, thread_name_prefix="kconvert-hash", initializer=_pin_thread,
                               initargs=(io_cores,)) as hasher:
        wthread = threading.Thread(target=writer, args=(io_cores,), name="kconvert-writer",
                                   daemon=True)
        wthread.start()
        try:
            with ThreadPoolExecutor(readers, thread_name_prefix="kconvert-read",
                                    initializer=_pin_thread, initargs=(io_cores,)) as pool:
                for (index, item), bufs in read_ahead(
                        pool, todo, lambda t: read_item(plan.ckpt, t[1], pin), prefetch):
                    if failure:
                        break
                    res = compute_item(plan, item, bufs, device, index, chunk_elems)
                    results.put((res, hasher.submit(sink.hash, res)))
        except BaseException:
            results.put(None)
            wthread.join()
            sink.abandon()
            raise
        results.put(None)
        wthread.join()
    if failure:
        sink.abandon()
        raise failure[0]
    sink.finish_empty()
    return sink.done


def split_cores(cores: Iterable[int]) -> tuple[set[int], set[int]] | None:
    """(kernel cores, I/O cores) for a CPU run on `cores`, or None (too few to set any apart)."""
    ordered = sorted(cores)
    n_io = len(ordered) // IO_CORE_EVERY
    if not n_io:
        return None
    return set(ordered[:-n_io]), set(ordered[-n_io:])


@contextlib.contextmanager
def _cores_set_apart(device: torch.device) -> Iterator[set[int] | None]:
    """On a CPU run: every thread of this process on the kernel cores (the thread pools that
    torch and numba keep may predate this run; threads they start later inherit the mask of
    this thread), kernels on as many threads as cores; yields the I/O cores for the reader and
    writer threads to pin themselves to. Every thread's mask is restored after (threads born
    during the run get this thread's former mask)."""
    own = os.sched_getaffinity(0) if _CAN_PIN else set()
    split = split_cores(own) if device.type == "cpu" and _CAN_PIN else None
    if split is None:
        yield None
        return
    kernel, io = split
    before: dict[int, set[int]] = {}
    try:
        for tid in _thread_ids():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, kernel)
        with nvfp4.cpu_threads(len(kernel)):
            yield io
    finally:
        for tid in _thread_ids():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, own))


def _thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _pin_thread(cores: set[int] | None) -> None:
    """Pin the calling (reader or writer) thread; if the system refuses (a cpuset that changed
    meanwhile), it runs unpinned: slower, never stuck."""
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)


def _fix_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Keep every host buffer of >= 1 MiB in its own mapping, unmapped when freed.

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB),
    after which item-sized buffers come from per-thread arenas that fragment: peak RSS then
    creeps up item after item (+100-260 MiB on a shard of 16+ CPU work items) and varies
    run to run. Setting the threshold explicitly turns that adjustment off.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
            ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD


def describe(plan: Plan) -> list[tuple[str, str, str, int, int, int, int]]:
    """Dry-run rows: (role, source format, output, source tensors, output tensors, source
    bytes, output bytes). A plain floating-point format is named by its dtype (BF16, F32)."""
    rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for m in plan.modules:
        source = m.primary.dtype if m.codec is DenseCodec else m.codec.name
        if m.out_codec is None:
            out, n_out = "copy", len(m.params)
            out_bytes = sum(i.nbytes for i in m.params.values())
        else:
            out = m.dense_dtype if m.out_codec is DenseCodec else m.out_codec.name
            specs = m.out_specs()
            n_out, out_bytes = len(specs), sum(tensor_nbytes(d, s) for _, d, s in specs)
        row = rows[(m.tn.role.value, source, out)]
        row[0] += len(m.params)
        row[1] += n_out
        row[2] += sum(i.nbytes for i in m.params.values())
        row[3] += out_bytes
    module_params = {i.name for m in plan.modules for i in m.params.values()}
    sources = {s: t for t in plan.outputs.values() if t.stage in ("copy", "select-rows")
               for s in t.sources}
    for name, info in plan.ckpt.tensors.items():
        if name in module_params:
            continue
        out = sources.get(name)
        tn = parse_name(name)
        fmt = "(by module)" if tn.role is Role.ROUTED_EXPERT else info.dtype
        row = rows[(tn.role.value, fmt, out.stage if out else "dropped")]
        row[0] += 1
        row[1] += out is not None
        row[2] += info.nbytes
        row[3] += tensor_nbytes(out.dtype, out.shape) if out else 0
    return [(k[0], k[1], k[2], *v) for k, v in sorted(rows.items())]
