"""One work item: read its bytes, decode, transform and encode on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kconvert.engine.items import CopyItem, Item, TransformItem, WorkPlan
from kconvert.errors import KconvertError
from kconvert.formats.linear import Batch, ModuleWork, Transformed
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.finite import check_finite, has_nonfinite
from kconvert.io.shards import TensorInfo


@dataclass
class ModuleStats:
    amax: float
    global_scale: float | None
    err_sq: float
    ref_sq: float
    # GPTQ's choice against RTN (kconvert.methods.obs.Choice as a dict), when it was made.
    obs: dict | None = None


@dataclass
class Result:
    """What the compute step hands the writer: out tensors (name, bytes, offset) + stats."""

    index: int
    kind: str  # the item's: "copy" or "transform"
    writes: list[tuple[str, torch.Tensor, int]]
    stats: dict[str, ModuleStats]
    nbytes: int


def read_item(ckpt: Checkpoint, item: Item, pin: bool) -> list[torch.Tensor]:
    """Host buffers for an item: one per copy chunk, or one stacked tensor per group param."""
    _will_need_item(ckpt, item)
    if isinstance(item, CopyItem):
        # Pass-through bytes never reach the GPU: plain memory, and the NaN/Inf check and row
        # selection happen here in the reader threads, off the compute thread's critical path.
        bufs = []
        for c in item.chunks:
            if c.values is not None:  # a stage's computed tensor, checked when planned
                bufs.append(c.values)
                continue
            buf = torch.empty(c.length, dtype=torch.uint8)
            ckpt.reader_for(c.info).read_into(c.info, buf, c.offset)
            check_finite(buf, c.info)
            if c.rows is not None:
                rows = torch.tensor(c.rows, dtype=torch.long)
                buf = buf.view(c.info.torch_dtype).reshape(c.info.shape).index_select(0, rows)
            bufs.append(buf)
        return bufs
    return _group_buffers(item, pin, lambda info, out: ckpt.reader_for(info).read_into(info, out))


def zero_buffers(item: TransformItem, pin: bool) -> list[torch.Tensor]:
    """Host buffers laid out as `read_item` lays out `item`'s, zero-filled: what
    engine.warm_up computes on."""
    return _group_buffers(item, pin, None)


def _group_buffers(item: TransformItem, pin: bool,
                   fill: Callable[[TensorInfo, torch.Tensor], None] | None
                   ) -> list[torch.Tensor]:
    """One stacked tensor per group parameter, [modules, *shape] in its source dtype, each
    module's bytes put in place by `fill` (None: zeros)."""
    bufs = []
    alloc = torch.empty if fill is not None else torch.zeros
    for group in item.groups:
        for param in group.params:
            first = group.modules[0].params[param]
            raw = alloc(len(group.modules), first.nbytes, dtype=torch.uint8, pin_memory=pin)
            for i, m in enumerate(group.modules):
                info = m.params[param]
                if info.shape != first.shape or info.dtype != first.dtype:
                    raise KconvertError(
                        f"{param} is {info.dtype}{list(info.shape)} but its siblings are "
                        f"{first.dtype}{list(first.shape)}", file=info.file.name, tensor=info.name)
                if fill is not None:
                    fill(info, raw[i])
            bufs.append(raw.view(first.torch_dtype).reshape(len(group.modules), *first.shape))
    return bufs


def _will_need_item(ckpt: Checkpoint, item: Item) -> None:
    """Every byte range of `item` handed to the kernel at once (will_need), before the reads
    that wait for each in turn: the disk then has the whole item in flight instead of one
    tensor per reader thread (an item's ranges are scattered over its shard: an expert's
    tensors lie between the other experts')."""
    if isinstance(item, CopyItem):
        for c in item.chunks:
            if c.values is None:
                ckpt.reader_for(c.info).will_need(c.info, c.offset, c.length)
        return
    for group in item.groups:
        for param in group.params:
            for m in group.modules:
                info = m.params[param]
                ckpt.reader_for(info).will_need(info)


def _nonfinite_param(ckpt: Checkpoint, m: ModuleWork) -> TensorInfo:
    """The parameter of `m` that holds the NaN/Inf (error path only: it re-reads them).

    An INT4 module's bad value is in its weight_scale, never in the int32 weight_packed.
    """
    for info in m.params.values():
        if has_nonfinite(ckpt.reader_for(info).read(info).reshape(-1).view(torch.uint8),
                      info.torch_dtype):
            return info
    return m.primary


def compute_item(plan: WorkPlan, item: Item, bufs: list[torch.Tensor], device: torch.device,
                 index: int, chunk_elems: int) -> Result:
    if isinstance(item, CopyItem):
        writes = [(c.out_name, buf, c.offset) for c, buf in zip(item.chunks, bufs, strict=True)]
        return Result(index, item.kind, writes, {}, item.nbytes)

    # Decode every group to fp32 on the device: one batched op per (codec, shape) group. A
    # group whose output codec reads its source packed is decoded inside that encoder, and a
    # re-laid-out group (densify) not at all: its output codec lays its bytes out unchanged.
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
        m = group.modules[0]
        if m.repack:
            decoded.append(None)
            continue
        if _reads_packed(m, device):
            group_amax = m.out_codec.packed_amax(group.codec, params)
            decoded.append(None)
        else:
            w = group.codec.decode(params, m.shape)
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

    # Each method sees every batch of the item it transforms at once (an expert's gate, up and
    # down together where it trains whole experts).
    made: dict[int, Transformed] = {}
    by_method: dict[int, list[int]] = {}
    batches: dict[int, Batch] = {}
    for i, (group, w) in enumerate(zip(item.groups, decoded, strict=True)):
        ms = group.modules
        if ms[0].repack or w is None:
            continue
        spec = ms[0].encode_spec(plan.scale_rule, chunk_elems)
        batches[i] = Batch(ms, w, ms[0].out_codec, spec,
                           torch.stack([set_amax[m.module] for m in ms]))
        if ms[0].transform is None:
            made[i] = Transformed(w)
        else:
            by_method.setdefault(id(ms[0].transform), []).append(i)
    for members in by_method.values():
        method = item.groups[members[0]].modules[0].transform
        for i, out in zip(members, method.transform([batches[i] for i in members]),
                          strict=True):
            made[i] = out

    writes, stats, encoded = [], {}, []
    for i, (group, params) in enumerate(zip(item.groups, raw, strict=True)):
        ms = group.modules
        if ms[0].repack:
            enc, relaid_amax = ms[0].out_codec.relayout(group.codec, params)
            # the parameters a re-layout carries over unchanged (W4A4 input scales)
            enc.params.update({p: params[p] for p in ms[0].carried})
            encoded.append((ms, enc.map(_to_host), _to_host(relaid_amax), None))
            continue
        out_codec, a = ms[0].out_codec, torch.stack([set_amax[m.module] for m in ms])
        # The manifest records the amax a per-tensor scale was made for, else each matrix's.
        recorded = a if out_codec.global_scale_param else torch.stack([amax[m.module]
                                                                        for m in ms])
        if i not in batches:  # read packed by its encoder
            enc = out_codec.encode_packed(group.codec, params,
                                          ms[0].encode_spec(plan.scale_rule, chunk_elems), a)
            encoded.append((ms, enc.map(_to_host), _to_host(recorded), enc.records))
            continue
        batch, out = batches[i], made[i]
        enc = out_codec.encode(out.weights, batch.spec, amax=a, codes=out.codes)
        if out.weights is not batch.weights and enc.err_sq is not None:
            # the error that matters is against the source, not the transform
            enc.err_sq, enc.ref_sq = _error_vs(batch.weights,
                                               out_codec.decode(enc.params, ms[0].shape))
        encoded.append((ms, enc.map(_to_host), _to_host(recorded), out.records))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the one wait per item: every host copy has landed
    for ok, m in zip(finite.tolist(), checked, strict=True):
        if not ok:
            bad = _nonfinite_param(plan.ckpt, m)
            raise KconvertError("NaN or Inf in the source weights", file=bad.file.name,
                                tensor=bad.name)
    for ms, enc, recorded, records in encoded:
        gs = enc.recorded_scale.tolist() if enc.recorded_scale is not None else [None] * len(ms)
        amaxes = recorded.tolist()
        for i, m in enumerate(ms):
            tensors = enc.module(i)
            if m.input_amax is not None:
                tensors.update(m.out_codec.input_scale(m.input_amax))
            for param, t in tensors.items():
                writes.append((f"{m.out_module}.{param}", t, 0))
            if enc.err_sq is not None:
                stats[m.out_module] = ModuleStats(amaxes[i], gs[i], float(enc.err_sq[i]),
                                                  float(enc.ref_sq[i]),
                                                  records[i] if records else None)
    return Result(index, item.kind, writes, stats, item.nbytes)


def _reads_packed(m: ModuleWork, device: torch.device) -> bool:
    """Whether the module's output codec encodes its source as stored (no transform to run
    on decoded values)."""
    return (m.transform is None and m.out_codec is not None
            and m.out_codec.reads_packed(m.codec, device))


def _error_vs(source: torch.Tensor, decoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squared error of `decoded` against `source`, sum of source squares) [B]."""
    err = (decoded - source).square()
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
