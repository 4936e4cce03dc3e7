"""Building the work plan (kconvert.engine.items): every output tensor and shard header, and the
work items that make them; and how a plan's items are shared among ranks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kconvert.common import events
from kconvert.engine.items import (
    Chunk,
    CopyItem,
    Item,
    OutTensor,
    TransformItem,
    WorkPlan,
)
from kconvert.engine.stage import Stage, recorded_stage
from kconvert.errors import KconvertError
from kconvert.formats.linear import ModuleWork, group_modules
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import TensorInfo, plan_header, tensor_nbytes
from kconvert.model.names import Role, parse_name, split_param

# Pass-through bytes move in pieces of this size (memory: ~8 pieces in flight).
COPY_CHUNK = 16 << 20


def shard_file_bytes(plan: WorkPlan) -> dict[str, int]:
    """Size of every output shard file as the run writes it: header, then the tensors."""
    sizes = {}
    for shard, entries in plan.shard_entries.items():
        head, offsets = plan_header(entries)
        sizes[shard] = len(head) + max((e for _, e in offsets.values()), default=0)
    return sizes


def read_shape_values(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Contents of every INT4 `weight_shape` tensor (8-16 bytes each), needed to plan shapes."""
    with events.span("phase", name="read_shape_values"):
        return ckpt.shape_values()


def header_shape_values(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Each INT4 `weight_shape` as its `weight_packed` header says: [out, 8 x words]."""
    tensors = ckpt.tensors
    values = {}
    for name in tensors:
        if name.endswith(".weight_shape"):
            packed = tensors.get(name.removesuffix("weight_shape") + "weight_packed")
            if packed is not None and len(packed.shape) == 2:
                values[name] = (packed.shape[0], packed.shape[1] * 8)
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


# Which rank must compute a module under torchrun (None: whichever rank finishes its shard);
# an expert-parallel method's routed experts go to the rank that holds their Hessians.
Part = Callable[[ModuleWork], int | None]


def build_work_plan(ckpt: Checkpoint, stages: list[Stage], work_elems: int,
                    shape_values: dict[str, tuple[int, ...]] | None = None,
                    part: Part | None = None) -> WorkPlan:
    """The plan of every output tensor. `shape_values` (the INT4 `weight_shape` contents) are
    read from the shards unless given (`kconvert inspect` derives them from the headers).
    `part`: no work item holds modules of two parts (`share_work`)."""
    with events.span("phase", name="build_work_plan"):
        if shape_values is None:
            shape_values = read_shape_values(ckpt)
        return _build_work_plan(ckpt, stages, work_elems, shape_values, part)


def _build_work_plan(ckpt: Checkpoint, stages: list[Stage], work_elems: int,
                     shape_values: dict[str, tuple[int, ...]], part: Part | None) -> WorkPlan:
    tensors = ckpt.tensors
    renames = _renames(tensors, stages)
    dropped = {n: "routed expert not kept by the plan" for n, (new, _) in renames.items()
               if new is None}
    all_modules, others = group_modules(tensors, shape_values,
                                        any(s.linear_routers for s in stages))
    modules = []
    for m in all_modules:
        new = renames[m.primary.name][0]
        if new is None:
            continue
        m.out_module = split_param(new)[0]
        for stage in stages:
            stage.claim(m)
        modules.append(m)
    _share_input_amax(modules)

    outputs: dict[str, OutTensor] = {}
    copies: list[tuple[TensorInfo, str, tuple[int, ...] | None]] = [
        (info, *renames[info.name]) for info in others if renames[info.name][0] is not None
    ]
    transformed: list[ModuleWork] = []
    for m in modules:
        if m.out_codec is None:  # rows: a pruned quantized router's
            copies += [(info, m.out_module + "." + p, renames[info.name][1])
                       for p, info in m.params.items()]
            continue
        if any(renames[info.name][1] is not None for info in m.params.values()):
            raise KconvertError("a pruned router cannot be re-encoded in the same pass: prune "
                                "first, then convert", tensor=m.module)
        transformed.append(m)
        stage = recorded_stage(m.stages)
        sources = tuple(i.name for i in m.params.values())
        for param, dtype, shape in m.out_specs():
            name = f"{m.out_module}.{param}"
            outputs[name] = OutTensor(name, dtype, tuple(shape), m.primary.file.name, sources,
                                      stage)
    values = {n: v for stage in stages for n, v in stage.replaced_rows().items()}
    for info, out_name, rows in copies:
        stage = "copy" if rows is None else "select-rows"
        shape = info.shape if rows is None else (len(rows), *info.shape[1:])
        if out_name in values:
            # rows a stage computed (a repaired router), or a whole tensor it re-fitted (a
            # parameter of a compensated down_proj, in the source's format)
            stage = "repair-rows" if rows is not None else "refit"
            _check_replacement(info, out_name, shape, values[out_name])
        outputs[out_name] = OutTensor(out_name, info.dtype, shape, info.file.name, (info.name,),
                                      stage)

    # Grouped by shard once: a full-size checkpoint has 62 shards and 208,215 tensors.
    shard_copies: dict[str, list] = defaultdict(list)
    for c in copies:
        shard_copies[c[0].file.name].append(c)
    shard_modules: dict[str, list[ModuleWork]] = defaultdict(list)
    for m in transformed:
        shard_modules[m.primary.file.name].append(m)
    items: list[Item] = []
    for shard in ckpt.shards:
        items += _copy_items(shard_copies[shard], values)
        items += _transform_items(shard_modules[shard], work_elems, part)
    if any(s.ordered_layers for s in stages):
        # A stage that streams calibration layers forward (SparseGPT) needs layer order
        # across shards too; sorted() is stable, so within a layer shard order stays.
        items.sort(key=lambda it: -1 if isinstance(it, CopyItem) else _item_layer(it))
    return WorkPlan(ckpt, stages, modules, outputs, items, dropped)


@dataclass(frozen=True)
class Share:
    """One rank's part of a run under torchrun: the items it computes and writes (indices into
    the plan's items), the shards it finishes (renames into place and records) and, of the
    shards it writes into, those other ranks write into too (each writes its own tensors'
    bytes into the same partial file; its owner finishes it once every part is written)."""

    items: frozenset[int]
    owned: frozenset[str]
    shared: frozenset[str]
    writers: dict[str, frozenset[int]]  # shared shard -> the ranks that write into it


def share_work(plan: WorkPlan, done: set[str], ranks: int, part: Part | None = None
               ) -> list[Share]:
    """The items of the output shards not in `done`, divided among `ranks`: an item whose
    modules `part` gives a rank goes to that rank; every other item goes with its shard, and
    the shards are divided balanced by the source bytes of those items (largest first, each to
    the least loaded rank; ties by name and rank). An item is whole within one shard, so a
    fused set is computed by one rank exactly as by a one-process run."""
    load = {shard: 0 for shard in plan.shard_entries if shard not in done}
    placed: dict[int, int] = {}  # item -> the rank `part` gives it
    for i, item in enumerate(plan.items):
        rank = _item_part(item, part)
        if rank is not None:
            placed[i] = rank
            continue
        for shard in plan.item_shards(item) & load.keys():
            load[shard] += item.nbytes
    owner: dict[str, int] = {}
    totals = [0] * ranks
    for shard, nbytes in sorted(load.items(), key=lambda kv: (-kv[1], kv[0])):
        least = min(range(ranks), key=lambda r: (totals[r], r))
        owner[shard] = least
        totals[least] += nbytes
    items: list[set[int]] = [set() for _ in range(ranks)]
    writers: dict[str, set[int]] = defaultdict(set)
    for i, item in enumerate(plan.items):
        shards = plan.item_shards(item) & owner.keys()
        if not shards:
            continue
        rank = placed.get(i, owner[min(shards)])
        items[rank].add(i)
        for shard in shards:
            writers[shard].add(rank)
    shared = {s: frozenset(w) for s, w in writers.items() if w != {owner[s]}}
    return [Share(frozenset(items[r]), frozenset(s for s, o in owner.items() if o == r),
                  frozenset(s for s in shared if r in writers[s] or owner[s] == r), shared)
            for r in range(ranks)]


def _item_part(item: Item, part: Part | None) -> int | None:
    if part is None or isinstance(item, CopyItem):
        return None
    return part(item.sets[0][0])


def _item_layer(item: TransformItem) -> int:
    layer = item.sets[0][0].tn.layer
    return -1 if layer is None else layer


def _share_input_amax(modules: list[ModuleWork]) -> None:
    """A fused set runs as one GEMM on one quantized input: its members share the input scale."""
    sets: dict[str, list[ModuleWork]] = defaultdict(list)
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


def _check_replacement(info: TensorInfo, out_name: str, shape: tuple[int, ...],
                       value: torch.Tensor) -> None:
    """A stage's computed tensor replaces source bytes (selected rows, or the whole tensor)
    of the same shape and dtype."""
    if tuple(value.shape) != tuple(shape) or value.dtype != info.torch_dtype:
        raise KconvertError(f"computed tensor {value.dtype}{list(value.shape)} cannot replace "
                            f"{info.dtype}{list(shape)}", tensor=out_name)
    # a dry run's placeholders (on the meta device) hold no values to check
    if value.device.type != "meta" and value.is_floating_point() \
            and not bool(torch.isfinite(value.float()).all()):
        raise KconvertError("computed tensor holds NaN/Inf", tensor=out_name)


def _copy_items(copies: list[tuple[TensorInfo, str, tuple[int, ...] | None]],
                values: dict[str, torch.Tensor]) -> list[CopyItem]:
    """Pass-through bytes in items of at most COPY_CHUNK: big tensors split, small ones merged.

    A tensor with selected rows (a pruned router) is read whole: it is small; `values` holds
    the output tensors stages computed (by output name), which are written whole instead of
    the source's bytes.
    """
    items, current, size = [], [], 0
    for info, out_name, rows in sorted(copies, key=lambda c: c[0].start):
        item_size = info.torch_dtype.itemsize
        whole = rows is not None or out_name in values
        step = info.nbytes if whole else COPY_CHUNK // item_size * item_size
        for offset in range(0, max(info.nbytes, 1), max(step, item_size)):
            length = min(step, info.nbytes - offset)
            if size + length > COPY_CHUNK and current:
                items.append(CopyItem(current))
                current, size = [], 0
            current.append(Chunk(info, out_name, offset, length, rows, values.get(out_name)))
            size += length
    if current:
        items.append(CopyItem(current))
    return items


def _transform_items(modules: list[ModuleWork], work_elems: int, part: Part | None
                     ) -> list[TransformItem]:
    """Fused sets of one layer and role (and `part`), batched up to `work_elems` decoded
    elements (beyond it where a method takes whole experts and the set is the same
    expert's)."""
    sets: dict[str, list[ModuleWork]] = {}
    for m in modules:
        sets.setdefault(m.tn.fused_set, []).append(m)

    def order(s: list[ModuleWork]) -> tuple:
        tn = s[0].tn
        return (tn.layer if tn.layer is not None else -1, tn.role.value,
                tn.expert if tn.expert is not None else -1, tn.fused_set)

    def same_expert(a: list[ModuleWork], b: list[ModuleWork]) -> bool:
        """Sets of one routed expert whose method takes whole experts (WeightTransform.unit)."""
        m = b[0]
        return (m.transform is not None and m.transform.unit == "expert"
                and m.tn.role is Role.ROUTED_EXPERT and a[0].tn.expert == m.tn.expert)

    items, current, elems, key = [], [], 0, None
    for fused in sorted(sets.values(), key=order):
        fused.sort(key=lambda m: m.module)
        n = sum(m.shape[0] * m.shape[1] for m in fused)
        this_key = (fused[0].tn.layer, fused[0].tn.role,
                    part(fused[0]) if part is not None else None)
        full = elems + n > work_elems and not (current and same_expert(current[-1], fused))
        if current and (this_key != key or full):
            items.append(TransformItem(current))
            current, elems = [], 0
        current.append(fused)
        elems += n
        key = this_key
    if current:
        items.append(TransformItem(current))
    return items


def describe(plan: WorkPlan) -> list[tuple[str, str, str, int, int, int, int]]:
    """Dry-run rows: (role, source format, output, source tensors, output tensors, source
    bytes, output bytes). A plain floating-point format is named by its dtype (BF16, F32)."""
    rows: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for m in plan.modules:
        source = m.codec.name if m.codec.quantized else m.primary.dtype
        if m.out_codec is None:
            # its parameters as written: copied, or computed by a stage (a re-fitted matrix)
            written = {plan.outputs[n].stage for p in m.params
                       if (n := f"{m.out_module}.{p}") in plan.outputs}
            out, n_out = "+".join(sorted(written)) or "copy", len(m.params)
            out_bytes = sum(i.nbytes for i in m.params.values())
        else:
            out = m.out_codec.name if m.out_codec.quantized else m.dense_dtype
            specs = m.out_specs()
            n_out, out_bytes = len(specs), sum(tensor_nbytes(d, s) for _, d, s in specs)
        row = rows[(m.tn.role.value, source, out)]
        row[0] += len(m.params)
        row[1] += n_out
        row[2] += sum(i.nbytes for i in m.params.values())
        row[3] += out_bytes
    module_params = {i.name for m in plan.modules for i in m.params.values()}
    sources = {s: t for t in plan.outputs.values()
               if t.stage in ("copy", "select-rows", "repair-rows", "refit") for s in t.sources}
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
