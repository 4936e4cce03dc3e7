"""One work item: read its bytes, decode, transform and encode on the device."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kconvert.engine.work import CopyItem, DecodeGroup, Item, WorkPlan
from kconvert.errors import KconvertError
from kconvert.formats import DenseCodec, Int4Codec, nvfp4
from kconvert.formats.linear import ModuleWork
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
            encoded.append((ms, q, _to_host(nvfp4.GLOBAL_NUMERATOR / q.global_scale), carried,
                            None))
            continue
        if out_codec is DenseCodec:
            enc = _to_host(DenseCodec.encode(w, ms[0].dense_dtype)["weight"])
            for i, m in enumerate(ms):
                writes.append((m.out_module + ".weight", enc[i], 0))
            continue
        if out_codec.encodes_itself:  # MXFP4: its own block scales, no per-tensor scale
            q = out_codec.quantize(w, plan.scale_rule, chunk_elems)
            q = type(q)(*(_to_host(getattr(q, f.name)) for f in fields(q)))
            encoded.append((ms, q, _to_host(torch.stack([amax[m.module] for m in ms])), {},
                            None))
            continue
        a = torch.stack([set_amax[m.module] for m in ms])
        arithmetic = out_codec.arithmetic
        if w is None:
            q = nvfp4.quantize_int4(params["weight_packed"], params["weight_scale"], a,
                                    plan.scale_rule, ms[0].group_size, chunk_elems,
                                    arithmetic=arithmetic)
            encoded.append((ms, q, a, {}, None))
            continue
        src_dtype = ms[0].primary.torch_dtype
        local = src_dtype if ms[0].codec is DenseCodec else torch.float32
        source, codes, choices = w, None, None
        if ms[0].transform is not None:
            w, codes, choices = ms[0].transform.transform(
                ms, w, nvfp4.tensor_scale(a, arithmetic), plan.scale_rule, local, arithmetic)
        q = nvfp4.quantize(w, a, plan.scale_rule, chunk_elems, local_dtype=local,
                           group_size=ms[0].group_size, block_codes=codes, arithmetic=arithmetic)
        if w is not source:  # the error that matters is against the source, not the transform
            q.err_sq, q.ref_sq = _error_vs(source, q, arithmetic)
        q = nvfp4.Quantized(*(_to_host(t) for t in (q.packed, q.block_scales, q.global_scale,
                                                    q.err_sq, q.ref_sq)))
        encoded.append((ms, q, _to_host(a), {}, choices))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the one wait per item: every host copy has landed
    for ok, m in zip(finite.tolist(), checked, strict=True):
        if not ok:
            bad = _nonfinite_param(plan.ckpt, m)
            raise KconvertError("NaN or Inf in the source weights", file=bad.file.name,
                                tensor=bad.name)
    for ms, q, a, carried, choices in encoded:
        out_codec = ms[0].out_codec
        # The manifest records compressed-tensors' form, 2688 / amax, whatever the flavour
        # (none for a format without a per-tensor scale).
        gs = ([None] * len(ms) if out_codec.encodes_itself
              else nvfp4.recorded_scale(q.global_scale, a, out_codec.arithmetic).tolist())
        err, ref, amaxes = q.err_sq.tolist(), q.ref_sq.tolist(), a.tolist()
        for i, m in enumerate(ms):
            tensors = {**out_codec.encode(q, i, m.input_amax),
                       **{p: t[i] for p, t in carried.items()}}
            for param, t in tensors.items():
                writes.append((f"{m.out_module}.{param}", t, 0))
            stats[m.out_module] = ModuleStats(amaxes[i], gs[i], err[i], ref[i],
                                              choices[i] if choices else None)
    return Result(index, item.kind, writes, stats, item.nbytes)


def _fused_int4(group: DecodeGroup, device: torch.device) -> bool:
    """INT4 -> NVFP4 with no transform, on a CPU: the fused kernel decodes while it encodes
    (about 4x faster than an fp32 decode first; same bytes, tested)."""
    m = group.modules[0]
    return (device.type == "cpu" and group.codec is Int4Codec and m.transform is None
            and not m.repack and m.out_codec is not DenseCodec and not m.out_codec.encodes_itself)


def _unpacked(codec, params: dict[str, torch.Tensor]) -> nvfp4.Quantized:
    """NVFP4 bytes of a re-layout, host-side; it changes no value, so its error is 0."""
    packed, scales, gs = (_to_host(t) for t in codec.unpack(params))
    zero = torch.zeros(packed.shape[0], dtype=torch.float64)
    return nvfp4.Quantized(packed, scales, gs, zero, zero)


def _error_vs(source: torch.Tensor, q: nvfp4.Quantized, arithmetic: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squared error of q's decode against `source`, sum of source squares) [B]."""
    decoded = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale, arithmetic)
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
