"""The manifest family: DST/kconvert-manifest.json against the checkpoint.

What the run that made CKPT recorded must hold in the data: the tensor and file lists (a file
nothing accounts for warns, an unlisted *.safetensors or a kconvert temporary fails), the
hashes of carried-over and generated files, the output format, the parameters its stages
recorded in the typed RunRecord (kept experts, the plan's hash; the p48 pattern is checked by
kconvert.audit.p48), the fused-set scales and per-layer counts, and (with a source) which
source tensors each output tensor was made from. The tensors' hashes are checked as their
bytes stream by (kconvert.audit.stream).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import torch
from pydantic import ValidationError

from kconvert.audit.bits import short_float
from kconvert.audit.context import AuditContext
from kconvert.checks.findings import text_config
from kconvert.checks.quant_config import quant_blocks
from kconvert.engine.stage import QUANTIZE, stages_of
from kconvert.errors import KconvertError, invalid_fields
from kconvert.formats import SOURCE_CODECS
from kconvert.io.checkpoint import CONFIG
from kconvert.io.files import hash_file
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name
from kconvert.pruning.plan import PLAN_FILE, load_plan
from kconvert.records.manifest import MANIFEST, read_manifest
from kconvert.stages.records import RunRecord

M = "manifest"
# Names kconvert writes under before a rename: one left behind is a write that never finished.
TEMP_SUFFIXES = (".kconvert-tmp", ".tmp", ".partial")
RUN_STATE = ".kconvert"  # the run-state folder of a run into the directory


def load(ctx: AuditContext) -> None:
    """The manifest and its RunRecord, and the plan the run wrote (unless --plan gave one)."""
    r, root = ctx.report, ctx.ckpt.root
    if (root / RUN_STATE).exists():
        r.add("structure", "incomplete", f"a {RUN_STATE}/ run-state folder is present: a "
              "kconvert run into this directory did not finish", file=RUN_STATE)
    if not (root / MANIFEST).is_file():
        r.notes.append(f"no {MANIFEST}: manifest checks skipped")
    else:
        try:
            ctx.manifest = read_manifest(root / MANIFEST)
            r.ran(M)
        except ValidationError as exc:
            r.add(M, "manifest", f"invalid manifest: {invalid_fields(exc)}", file=MANIFEST)
            return
        except (ValueError, OSError) as exc:
            r.add(M, "manifest", f"unreadable or invalid manifest: {exc}", file=MANIFEST)
            return
        try:
            ctx.record = RunRecord.model_validate(ctx.manifest.options)
        except ValidationError as exc:
            problems = invalid_fields(exc)
            r.warn(M, "options", f"the options are not a kconvert RunRecord ({problems}): an "
                   "older or another tool's manifest; the parameters its stages recorded "
                   "(p48 pattern, kept experts, plan hash) are not checked", file=MANIFEST)
        if ctx.p48_roles is not None:
            r.notes.append(f"manifest declares p48 sparsity: checking roles "
                           f"{sorted(ctx.p48_roles)}")
    path = root / PLAN_FILE
    if ctx.plan is not None or not path.is_file():
        return
    if PLAN_FILE not in ctx.generated:
        # Carried over from an earlier pruning: it maps THAT run's source, not this one's.
        r.notes.append(f"CKPT/{PLAN_FILE} was not written by the run that made CKPT (not in "
                       "the manifest's generated files): not used; pass --plan to use it")
        return
    try:
        ctx.plan = load_plan(path)
        r.notes.append(f"using the plan in CKPT/{PLAN_FILE}")
    except KconvertError as exc:
        r.add("structure", "plan", str(exc), file=PLAN_FILE)


def check_files(ctx: AuditContext) -> None:
    """Files nothing accounts for: a kconvert temporary (a write that never finished) fails;
    with a manifest, an unlisted *.safetensors fails (a loader may read its tensors) and any
    other unlisted file warns."""
    r, man, ckpt = ctx.report, ctx.manifest, ctx.ckpt.ckpt
    carried = man.non_weight_files if man is not None else {}
    listed = {*carried, *ctx.generated, *(man.files if man is not None else ())}
    indexed = {*ckpt.shards, *((ckpt.index or {}).get("weight_map") or {}).values()}
    unindexed = [p.name for p in sorted(ckpt.root.glob("*.safetensors"))
                 if p.name not in indexed]
    others = [rel for rel in ckpt.other_files() if rel not in indexed]
    for rel in dict.fromkeys(unindexed + others):
        if rel in carried:
            continue
        if rel.endswith(TEMP_SUFFIXES):
            r.add("structure", "incomplete", "a kconvert temporary file: a write into this "
                  "directory did not finish", file=rel)
        elif man is None or rel in listed:
            continue
        elif rel.endswith(".safetensors"):
            r.add(M, "files", "a .safetensors file no manifest entry accounts for (a loader "
                  "may read its tensors)", file=rel)
        else:
            r.warn(M, "non-weight", "file not in the manifest (added after conversion?)",
                   file=rel)


def check_recorded(ctx: AuditContext) -> None:
    """What the manifest lists and records, against the files (before the data is read)."""
    r, man, side = ctx.report, ctx.manifest, ctx.ckpt
    have, listed = set(side.tensors), set(man.tensors)
    for name in sorted(listed - have):
        r.add(M, "tensors", "listed in the manifest but not in the checkpoint", tensor=name)
    for name in sorted(have - listed):
        r.add(M, "tensors", "in the checkpoint but not in the manifest", tensor=name)
    for name in sorted(have & listed):
        info, entry = side.tensors[name], man.tensors[name]
        rel = os.path.relpath(info.file, side.root)
        r.check(M, (entry.file, entry.dtype, tuple(entry.shape))
                == (rel, info.dtype, tuple(info.shape)), "tensors",
                f"manifest says {entry.dtype}{entry.shape} in {entry.file}, checkpoint has "
                f"{info.dtype}{list(info.shape)} in {rel}", tensor=name)
    per_file = Counter(os.path.relpath(i.file, side.root) for i in side.tensors.values())
    for fn in sorted(set(man.files) | set(side.ckpt.shards)):
        entry = man.files.get(fn)
        if entry is None:
            r.add(M, "files", "shard not listed in the manifest", file=fn)
            continue
        path = side.root / fn
        if not r.check(M, path.is_file(), "files", "manifest lists a shard that is not here",
                       file=fn):
            continue
        size = path.stat().st_size
        r.check(M, size == entry.bytes, "files", f"file is {size} bytes, manifest says "
                f"{entry.bytes}", file=fn)
        r.check(M, per_file[fn] == entry.tensors, "files", f"shard holds {per_file[fn]} "
                f"tensors, manifest says {entry.tensors}", file=fn)
    r.check(M, man.summary.get("tensors", len(man.tensors)) == len(man.tensors), "summary",
            f"summary.tensors {man.summary.get('tensors')} != {len(man.tensors)} entries",
            file=MANIFEST)
    for rel, digest in sorted(man.non_weight_files.items()):
        path = side.root / rel
        if r.check(M, path.is_file(), "non-weight", "listed in the manifest but missing",
                   file=rel):
            got = hash_file(path)
            r.check(M, got == digest, "non-weight", f"content changed: xxh3 {got}, manifest "
                    f"says {digest}", file=rel)
    for rel, digest in sorted(ctx.generated.items()):
        path = side.root / rel
        got = hash_file(path) if path.is_file() else "missing"
        r.check(M, got == digest, "generated", f"xxh3 {got}, manifest says {digest} (edited "
                "after conversion?)", file=rel)
    _check_output_format(ctx)
    _check_record(ctx)
    if ctx.source is not None:
        _check_source_identity(ctx)


def _check_source_identity(ctx: AuditContext) -> None:
    """--source is the checkpoint the output was made from: its content fingerprint (or Hub
    commit) is the one the manifest records; a source at another path with the same content
    is noted. With --plan the source may be one upstream of the recorded one (the checkpoint a
    pruning step pruned, audited through the plan): another one is then noted, as it is where
    the manifest records neither."""
    r, recorded, src = ctx.report, ctx.manifest.source, ctx.source.ckpt
    moved = bool(recorded.path) and Path(recorded.path).resolve() != src.root
    if recorded.fingerprint is not None and (got := src.fingerprint()) is not None:
        why = "its content fingerprint (config, shard headers, first and last MiB of each shard)"
        want = recorded.fingerprint
    elif recorded.commit and src.identity.get("commit"):
        why, got, want = "its Hub commit", src.identity["commit"], recorded.commit
    else:
        if moved:
            r.notes.append(f"the manifest's source is {recorded.path}; auditing against "
                           f"{r.source} (recorded errors refer to the former)")
        return
    made_from = recorded.path or f"{recorded.repo}@{recorded.commit}"
    if got != want and r.plan is not None:
        r.notes.append(f"the manifest's source is {made_from}; {r.source} is another "
                       "checkpoint, audited through --plan as one upstream of it")
        return
    if r.check(M, got == want, "source", f"--source is not the checkpoint this output was "
               f"made from ({made_from}): {why} is {got[:16]}..., the manifest records "
               f"{want[:16]}...", file=str(src.root)) and moved:
        r.notes.append(f"the manifest's source is {recorded.path}; {r.source} has the same "
                       "content")


def _check_output_format(ctx: AuditContext) -> None:
    """An output in a format family (compressed-tensors, modelopt) names that family as its
    config's quant_method; a bf16 output has no quantization_config."""
    fmt = ctx.manifest.output_format
    methods = {b.get("quant_method") for _, b in quant_blocks(ctx.ckpt.ckpt.config)}
    families = {c.config_family for c in SOURCE_CODECS if c.config_family}
    ok = not methods if fmt == "bf16" else fmt not in families or methods == {fmt}
    named = sorted(m or "-" for m in methods) or "absent"
    ctx.report.check(M, ok, "output-format", f"manifest output_format {fmt!r} but config.json's "
                     f"quantization_config method is {named}", file=CONFIG)


def _check_record(ctx: AuditContext) -> None:
    """The pruning stage's record: the kept expert count is the config's, and the plan file
    is the one it hashed."""
    prune = ctx.record.prune if ctx.record is not None else None
    if prune is None:
        return
    r = ctx.report
    arch = arch_of(text_config(ctx.ckpt.ckpt.config))
    n = arch.get("experts")
    r.check(M, n == prune.kept_per_layer, "keep", f"manifest records keep="
            f"{prune.kept_per_layer} but {arch.experts_key} is {n}", file=CONFIG)
    path = ctx.ckpt.root / PLAN_FILE
    got = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
    r.check(M, got == prune.plan, "plan", f"the manifest records plan sha256 "
            f"{prune.plan[:16]}... but {PLAN_FILE} is {got[:16]}...", file=PLAN_FILE)


def check_after_stream(ctx: AuditContext) -> None:
    """The recorded fused-set scales are the stored ones, and each layer has as many
    quantized modules as recorded."""
    r, man = ctx.report, ctx.manifest
    stored = {module: s for members in ctx.fused.values() for module, s in members.items()}
    for fused_name, entry in man.fused_sets.items():
        sets = sorted({parse_name(f"{m}.weight").fused_set for m in entry.members})
        if sets != [fused_name]:
            r.warn(M, "fused-sets", f"the manifest files members {entry.members} under "
                   f"{fused_name}, but they form {sets}", file=MANIFEST)
        for member in entry.members:
            if member not in stored:
                r.add(M, "fused-sets", f"manifest lists member {member} of {fused_name} but it "
                      "has no NVFP4 scale here", tensor=member)
                continue
            got = stored[member]
            want = got.codec.stored_global_scale(entry.global_scale, entry.amax)
            r.check(M, bool(torch.equal(got.global_scale.reshape(-1).float(), want.reshape(-1))),
                    "fused-sets", f"stored global scale {short_float(got.global_scale)} but the "
                    f"manifest records {entry.global_scale} (2688/amax, amax {entry.amax}) for "
                    f"{fused_name}",
                    tensor=member)
    quantized: Counter = Counter()
    for m in ctx.ckpt.modules.values():
        entry = man.tensors.get(m.primary.name)
        if entry is not None and QUANTIZE in stages_of(entry.stage):
            quantized[str(m.tn.layer)] += 1
    for layer, entry in man.layers.items():
        r.check(M, quantized[layer] == entry.quantized_modules, "layers",
                f"manifest records {entry.quantized_modules} quantized modules, the checkpoint "
                f"has {quantized[layer]}", file=MANIFEST,
                layer=int(layer) if layer.isdigit() else None)


def check_sources(ctx: AuditContext) -> None:
    """Each output tensor's recorded sources, against the source and the expert mapping
    (only when the audit's source is the one the manifest records)."""
    r, man, source = ctx.report, ctx.manifest, ctx.source
    if not man.source.path or Path(man.source.path).resolve() != source.root:
        return
    for name, entry in man.tensors.items():
        if name not in ctx.ckpt.tensors:
            continue
        tn = parse_name(name)
        for sname in entry.sources:
            ok = sname in source.tensors
            if ok and tn.role is Role.ROUTED_EXPERT and tn.layer in ctx.mapping:
                ids = ctx.mapping[tn.layer]
                ok = parse_name(sname).expert == (ids[tn.expert] if tn.expert < len(ids)
                                                  else None)
            r.check(M, ok, "sources", f"manifest says it was made from {sname}, which disagrees "
                    "with the source / expert mapping", tensor=name)
