"""The source family (--source): CKPT against the checkpoint it was made from.

Router rows and e_score_correction_bias entries equal the source rows the plan chose, or, in
a layer whose router the plan records as repaired, the rows it records (xxh3 of each gate
row, the exact bias entries); without a plan, the mapping is inferred by matching router rows,
and the report says so. A router quantized (MXFP4, AMD's recipe) is compared through its
decode: byte for byte against a source router in its own format, else each row within
ROUTER_REL_MSE of its source row;
the config is unchanged but for what pruning / quantization must change; nothing in the
source is unaccounted for; non-weight files are identical. The tensors' bytes and decodes are
compared as they stream by (kconvert.audit.stream). Without a source, a plan's expert counts
are checked against the layers.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from kconvert.audit.bits import same_bits
from kconvert.audit.context import AuditContext, Side
from kconvert.checks.findings import short, text_config
from kconvert.formats import DenseCodec, router_format
from kconvert.formats.base import Codec
from kconvert.io.checkpoint import CONFIG
from kconvert.io.files import hash_file
from kconvert.io.shards import TensorInfo
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name
from kconvert.pruning.plan import LayerRepair
from kconvert.pruning.reap import row_hashes

SRC = "source"
# Config keys that quantization legitimately changes, and pruning's routing fallback to one
# expert group (its expert count is checked against the kept count, `check_config`).
CHANGEABLE_CONFIG_KEYS = {"quantization_config", "topk_group", "torch_dtype", "dtype",
                          "transformers_version"}
# A router row in another format than its source's (MXFP4 from BF16) must decode within this
# relative squared error of its source row: MXFP4 gives about 0.01, another expert's row ~2.
ROUTER_REL_MSE = 0.05


def _router(side: Side, info: TensorInfo, seen: set[str]) -> tuple[torch.Tensor, type[Codec]]:
    """(the router weight as compared, its format): the stored tensor when plain, the fp32
    decode when quantized; a scale tensor read is added to `seen`."""
    params = {"weight": info}
    scale = side.tensors.get(info.name.rsplit(".", 1)[0] + ".weight_scale")
    if scale is not None:
        params["weight_scale"] = scale
        seen.add(scale.name)
    found = router_format(params)
    if found is None or not found[0].quantized:
        return side.read(info), DenseCodec
    codec, shape = found
    return codec.decode({p: side.read(i).unsqueeze(0) for p, i in params.items()}, shape)[0], codec


def map_experts(ctx: AuditContext) -> None:
    """Per MoE layer, which source expert each expert of CKPT was made from: the plan's
    choice, checked on the router rows, or inferred from them."""
    r = ctx.report
    src_routers, out_routers = ctx.source.routers(), ctx.ckpt.routers()
    modes: Counter = Counter()
    for layer in ctx.moe_layers:
        w_info, b_info = out_routers.get(layer, (None, None))
        sw_info, sb_info = src_routers.get(layer, (None, None))
        if w_info is None:
            continue
        if not r.check(SRC, sw_info is not None, "router", "the source has no router for this "
                       "layer", tensor=w_info.name):
            continue
        ctx.used_source.update(i.name for i in (sw_info, sb_info) if i is not None)
        ctx.has_counterpart.update(i.name for i in (w_info, b_info) if i is not None)
        (w, codec), (sw, src_codec) = (_router(ctx.ckpt, w_info, ctx.has_counterpart),
                                       _router(ctx.source, sw_info, ctx.used_source))
        exact = codec is src_codec
        b = ctx.ckpt.read(b_info) if b_info is not None else None
        sb = ctx.source.read(sb_info) if sb_info is not None else None
        if not r.check(SRC, w.dim() == 2 and sw.dim() == 2 and w.shape[1] == sw.shape[1]
                       and (w.dtype == sw.dtype or not exact), "router",
                       f"router {w.dtype}{list(w.shape)} cannot be compared with the source's "
                       f"{sw.dtype}{list(sw.shape)}", tensor=w_info.name):
            continue
        mapping, mode = _layer_mapping(ctx, layer, w_info, w, sw, b, sb, exact)
        repair = _repair_record(ctx, layer)
        if repair is not None and b is not None:
            bad = 0
            for i, want in enumerate(repair.bias[:b.shape[0]]):
                bad += not r.check(SRC, same_bits(b[i], torch.tensor(want, dtype=b.dtype)),
                                   "bias", f"entry {i} = {float(b[i])!r} but the plan's "
                                   f"repair wrote {want!r}", layer=layer, tensor=b_info.name)
            if bad:
                r.row(layer).router += f", bias {bad} bad"
        elif b is not None and sb is not None:
            bad = 0
            for i, s in enumerate(mapping):
                if s is None or i >= b.shape[0] or s >= sb.shape[0]:
                    continue
                bad += not r.check(SRC, same_bits(b[i], sb[s]), "bias", f"entry {i} = "
                                   f"{float(b[i])!r} but source entry {s} = {float(sb[s])!r}",
                                   layer=layer, tensor=b_info.name)
            if bad:
                r.row(layer).router += f", bias {bad} bad"
        if all(s is not None for s in mapping) and mapping != sorted(mapping):
            r.warn(SRC, "router", "kept experts are not in ascending source order", layer=layer,
                   tensor=w_info.name)
        ctx.mapping[layer] = mapping
        modes[mode] += 1
        r.mapping[str(layer)] = {"mode": mode, "source_ids": mapping}
    if modes["inferred"]:
        r.notes.append(f"no plan: expert mapping of {modes['inferred']} layer(s) INFERRED by "
                       "matching router rows to source rows")
    if modes["plan"]:
        r.notes.append(f"expert mapping of {modes['plan']} layer(s) taken from the plan")


def _layer_mapping(ctx: AuditContext, layer: int, w_info: TensorInfo, w: torch.Tensor,
                   sw: torch.Tensor, b: torch.Tensor | None, sb: torch.Tensor | None,
                   exact: bool = True) -> tuple[list[int | None], str]:
    """(source id per expert, "plan" | "identity" | "inferred"), and the table's columns;
    `exact`: rows compared byte for byte, else through the decode (`_nearest`)."""
    r, row = ctx.report, ctx.report.row(layer)
    n, ns = w.shape[0], sw.shape[0]
    rows, src_rows = _row_bytes(w), _row_bytes(sw)
    by_bytes: dict[bytes, list[int]] = defaultdict(list)
    for j, rb in enumerate(src_rows):
        by_bytes[rb].append(j)
    keep = ctx.plan.keep(layer) if ctx.plan is not None else None
    if ctx.plan is not None and keep is None:
        if n == ns:
            r.warn(SRC, "plan", "the plan has no entry for this layer; assuming it was not "
                   "pruned", layer=layer)
            keep = list(range(n))
        else:
            r.add(SRC, "plan", f"the plan has no entry for this layer, which has {n} of the "
                  f"source's {ns} experts", layer=layer)
    if keep is not None and not r.check(
            SRC, len(keep) == n and keep[-1] < ns, "plan", f"the plan keeps {len(keep)} experts "
            f"(max id {keep[-1]}) but the layer has {n} and the source {ns}", layer=layer,
            tensor=w_info.name):
        keep = None
    if n != ns:
        row.experts = f"{n}/{ns}"
    if not exact:
        mapping = _nearest(ctx, layer, w_info, w, sw, keep)
        mode = ("plan" if keep is not None else
                "identity" if mapping == list(range(ns)) else "inferred")
        row.router = f"decoded, {'= plan' if keep is not None else mode} ({n}/{ns})"
        return mapping, mode
    if keep is None:
        mapping = _infer(ctx, layer, w_info, w, sw, rows, by_bytes, b, sb)
        identity = n == ns and mapping == list(range(n))
        row.router = f"= source ({n})" if identity else f"inferred ({n}/{ns})"
        return mapping, "identity" if identity else "inferred"
    repair = _repair_record(ctx, layer)
    if repair is not None:
        return _check_repaired(ctx, layer, w_info, w, repair, keep), "plan"
    bad_rows = 0
    for i, s in enumerate(keep):
        if rows[i] == src_rows[s]:
            r.ran(SRC)
            continue
        bad_rows += 1
        actual = by_bytes.get(rows[i], [])
        diff = float((w[i].float() - sw[s].float()).abs().max())
        r.add(SRC, "router", f"row {i} differs from source row {s} chosen by the plan (max abs "
              f"diff {diff:.3g}); " + (f"it equals source row {actual[0]}" if actual else
                                       "it equals no source row"), layer=layer,
              tensor=w_info.name)
    row.router = f"= plan ({n - bad_rows}/{n})"
    return list(keep), "plan"


def _repair_record(ctx: AuditContext, layer: int) -> LayerRepair | None:
    entry = ctx.plan.layers.get(str(layer)) if ctx.plan is not None else None
    return entry.repair if entry is not None else None


def _check_repaired(ctx: AuditContext, layer: int, w_info: TensorInfo, w: torch.Tensor,
                    repair: LayerRepair, keep: list[int]) -> list[int]:
    """A repaired layer's gate rows are the ones the plan's repair record hashed."""
    r, row = ctx.report, ctx.report.row(layer)
    got = row_hashes(w)
    if not r.check(SRC, len(got) == len(repair.gate_rows_xxh3), "router", f"{len(got)} router "
                   f"rows but the plan's repair recorded {len(repair.gate_rows_xxh3)}",
                   layer=layer, tensor=w_info.name):
        return list(keep)
    bad_rows = 0
    for i, (have, want) in enumerate(zip(got, repair.gate_rows_xxh3, strict=True)):
        bad_rows += not r.check(SRC, have == want, "router", f"row {i} (source expert "
                                f"{keep[i]}) has xxh3 {have}, the plan's {repair.method} repair "
                                f"wrote {want}", layer=layer, tensor=w_info.name)
    state = "repaired" if repair.applied else "repair kept source rows"
    row.router = f"= plan, {state} ({len(got) - bad_rows}/{len(got)})"
    return list(keep)


def _infer(ctx: AuditContext, layer: int, w_info: TensorInfo, w: torch.Tensor,
           sw: torch.Tensor, rows: list[bytes], by_bytes: dict[bytes, list[int]],
           b: torch.Tensor | None, sb: torch.Tensor | None) -> list[int | None]:
    """Each router row's source row, matched on bytes (ties broken by the bias entries)."""
    r = ctx.report
    n, ns = w.shape[0], sw.shape[0]
    mapping: list[int | None] = []
    taken: set[int] = set()
    for i, rb in enumerate(rows):
        cands = [j for j in by_bytes.get(rb, []) if j not in taken]
        if len(cands) > 1 and b is not None and sb is not None and i < b.shape[0]:
            cands = [j for j in cands if same_bits(b[i], sb[j])] or cands
        if not cands:
            near = (sw.float() - w[i].float()).abs().amax(1)
            j = int(near.argmin())
            r.add(SRC, "router", f"row {i} equals no source router row (nearest: source row "
                  f"{j}, max abs diff {float(near[j]):.3g})", layer=layer, tensor=w_info.name)
            mapping.append(i if n == ns else None)
            continue
        r.ran(SRC)
        if len(cands) > 1:
            r.warn(SRC, "router", f"row {i} equals source rows {cands}; took {cands[0]}",
                   layer=layer, tensor=w_info.name)
        mapping.append(cands[0])
        taken.add(cands[0])
    return mapping


def _nearest(ctx: AuditContext, layer: int, w_info: TensorInfo, w: torch.Tensor,
             sw: torch.Tensor, keep: list[int] | None) -> list[int | None]:
    """Each decoded router row's source row (the plan's, else the nearest), which it must
    match within ROUTER_REL_MSE; a source row claimed twice is a failure."""
    r = ctx.report
    w, sw = w.double(), sw.double()
    rel = torch.cdist(w, sw).square() / sw.square().sum(1).clamp_min(1e-300)  # [n, ns]
    mapping: list[int | None] = []
    for i in range(w.shape[0]):
        s = keep[i] if keep is not None else int(rel[i].argmin())
        how = "chosen by the plan" if keep is not None else "its nearest"
        ok = r.check(SRC, float(rel[i, s]) <= ROUTER_REL_MSE, "router", f"row {i} decodes "
                     f"{float(rel[i, s]):.3g} (relative squared error) away from source row "
                     f"{s}, {how}", layer=layer, tensor=w_info.name)
        if keep is None and s in mapping:
            r.add(SRC, "router", f"row {i} and row {mapping.index(s)} both match source row "
                  f"{s}", layer=layer, tensor=w_info.name)
            ok = False
        mapping.append(s if ok or keep is not None else None)
    return mapping


def _row_bytes(w: torch.Tensor) -> list[bytes]:
    raw = w.contiguous().view(torch.uint8).reshape(w.shape[0], -1)
    return [bytes(raw[i].numpy()) for i in range(w.shape[0])]


def check_plan_alone(ctx: AuditContext) -> None:
    """Without a source only the plan's shape can be checked: one entry per MoE layer,
    keeping as many experts as the layer has."""
    r, plan = ctx.report, ctx.plan
    r.notes.append("--plan without --source: only the plan's expert counts are checked")
    routers = ctx.ckpt.routers()
    for layer in ctx.moe_layers:
        keep = plan.keep(layer)
        w_info = routers.get(layer, (None, None))[0]
        n = w_info.shape[0] if w_info is not None and w_info.shape else None
        if not r.check("structure", keep is not None, "plan", "the plan has no entry for this "
                       "layer", layer=layer):
            continue
        r.check("structure", n is None or len(keep) == n, "plan", f"the plan keeps {len(keep)} "
                f"experts but the layer has {n}", layer=layer,
                tensor=w_info.name if w_info is not None else None)
    for key in plan.layers:
        r.check("structure", int(key) in ctx.moe_layers, "plan", f"the plan lists layer {key}, "
                "which is not a MoE layer here", layer=int(key))


def check_config(ctx: AuditContext) -> None:
    """The config is the source's but for the keys pruning / quantization change; the routed
    expert count (by the family's key, kconvert.model.arch) is the kept count where CKPT is
    pruned."""
    r = ctx.report
    arch = arch_of(text_config(ctx.source.ckpt.config))
    kept = _kept_count(ctx)
    a, b = _flatten(ctx.source.ckpt.config), _flatten(ctx.ckpt.ckpt.config)
    for key in sorted(set(a) | set(b)):
        last = key.rsplit(".", 1)[-1]
        if last in CHANGEABLE_CONFIG_KEYS or last == arch.groups_key:
            continue
        if last == arch.experts_key and kept is not None and key in a and key in b:
            r.check(SRC, b[key] == kept, "config", f"config {key} = {short(b[key])}, but "
                    f"CKPT keeps {kept} of the source's {short(a[key])} experts per layer",
                    file=CONFIG)
            continue
        if key not in b:
            r.add(SRC, "config", f"config key {key} (source: {short(a[key])}) was removed",
                  file=CONFIG)
        elif key not in a:
            r.warn(SRC, "config", f"config key {key} = {short(b[key])} is not in the source",
                   file=CONFIG)
        else:
            r.check(SRC, a[key] == b[key], "config", f"config {key} = {short(b[key])}, the "
                    f"source has {short(a[key])}", file=CONFIG)


def _kept_count(ctx: AuditContext) -> int | None:
    """Routed experts per MoE layer of a pruned CKPT: the manifest's record, else the plan's,
    else what the expert mapping found in every layer; None where no pruning is known."""
    prune = ctx.record.prune if ctx.record is not None else None
    if prune is not None:
        return prune.kept_per_layer
    counts = ({len(entry.keep) for entry in ctx.plan.layers.values()} if ctx.plan is not None
              else {len(m) for m in ctx.mapping.values()})
    return counts.pop() if len(counts) == 1 else None


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and k != "quantization_config":
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def check_accounting(ctx: AuditContext) -> None:
    """Every source tensor has a counterpart in CKPT (or belongs to a pruned expert, or is
    recorded as dropped), and every tensor of CKPT one in the source."""
    r, source = ctx.report, ctx.source
    kept = {layer: {s for s in ids if s is not None} for layer, ids in ctx.mapping.items()}
    dropped, pruned = ctx.dropped, 0
    for name in sorted(source.tensors):
        if name in ctx.used_source:
            continue
        tn = parse_name(name)
        if tn.role is Role.ROUTED_EXPERT and tn.layer in kept and tn.expert not in kept[tn.layer]:
            pruned += 1
        elif name not in dropped:
            r.add(SRC, "accounting", "source tensor has no counterpart in the checkpoint (not "
                  "kept, transformed, pruned by the mapping, or recorded as dropped)",
                  tensor=name)
    for name in sorted(ctx.ckpt.tensors):
        if name not in ctx.has_counterpart:
            r.add(SRC, "accounting", "tensor has no counterpart in the source", tensor=name)
    r.ran(SRC, len(source.tensors))
    if pruned:
        r.notes.append(f"{pruned} source tensors belong to pruned experts")


def check_other_files(ctx: AuditContext) -> None:
    """The source's non-weight files are here, byte for byte."""
    r, dropped = ctx.report, ctx.dropped
    theirs = ctx.source.ckpt.other_files()
    for rel in theirs:
        if rel in dropped:
            continue
        path = ctx.ckpt.root / rel
        if r.check(SRC, path.is_file(), "non-weight", "in the source but missing here",
                   file=rel):
            a, b = hash_file(ctx.source.root / rel), hash_file(path)
            r.check(SRC, a == b, "non-weight", f"differs from the source's copy (xxh3 {b} vs "
                    f"{a})", file=rel)
    for rel in sorted(set(ctx.ckpt.ckpt.other_files()) - set(theirs) - set(ctx.generated)):
        r.warn(SRC, "non-weight", "not in the source", file=rel)
