"""The manifest of a finished run (kconvert.records.manifest is its schema), from the work plan, the
records every shard's writer returned and the files written: per tensor its hash and the
stages that made it, per fused set its scales, per layer the quantization error, and the run's
summary in numbers."""

from __future__ import annotations

from pathlib import Path

from kconvert.common import distributed
from kconvert.driver.run_summary import learned_line, learned_outcome
from kconvert.engine.work import WorkPlan
from kconvert.formats import OUTPUT_CODECS
from kconvert.formats.linear import ModuleWork
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.files import human_bytes
from kconvert.model.names import Role, parse_name
from kconvert.records.manifest import (
    CastEntry,
    FileEntry,
    FusedSetEntry,
    LayerEntry,
    Manifest,
    SourceEntry,
    TensorEntry,
    matrix_entry,
)
from kconvert.stages import KINDS
from kconvert.stages.prune import GUARDS
from kconvert.version import __version__


def build_manifest(ckpt: Checkpoint, plan: WorkPlan, records: dict[str, dict], command: str,
              options: dict, fmt: str, dropped: dict[str, str], non_weight: dict[str, str],
              generated: dict[str, str], root: Path) -> Manifest:
    tensors = {}
    for t in plan.outputs.values():
        tensors[t.name] = TensorEntry(file=t.shard, dtype=t.dtype, shape=list(t.shape),
                                      hash=records[t.shard]["tensors"][t.name], stage=t.stage,
                                      sources=list(t.sources))
    stats = {m: s for rec in records.values() for m, s in rec["modules"].items()}
    fused_sets, layers = {}, {}
    by_layer: dict[str, list[float]] = {}
    for m in plan.modules:
        if m.out_module not in stats:
            continue
        st = stats[m.out_module]
        # Keyed by the OUTPUT's fused set: after pruning, m.tn names the source expert.
        out_set = parse_name(f"{m.out_module}.{m.tn.param}").fused_set
        if st["global_scale"] is not None:  # a shared per-tensor scale (NVFP4; MXFP4 has none)
            entry = fused_sets.setdefault(
                out_set, FusedSetEntry(members=[], amax=st["amax"],
                                       global_scale=st["global_scale"]))
            entry.members.append(m.out_module)
        if not _made_by(m, "quantizes") or m.tn.role is Role.ROUTER_WEIGHT:
            # re-laid out (densify): bytes unchanged, nothing quantized; a router is checked
            # row by row by the audit, not by its layer's decode bound
            continue
        rel = st["err_sq"] / st["ref_sq"] if st["ref_sq"] else 0.0
        by_layer.setdefault(str(m.tn.layer), []).append(rel)
    # A module's record: its method's choice (GPTQ against RTN, learned against the one-shot:
    # the model its declaration names), or its encoder's ("cast").
    records = {m: st["obs"] for m, st in sorted(stats.items()) if st.get("obs")}
    obs = {m: matrix_entry(r) for m, r in records.items() if "cast" not in r}
    cast = {m: CastEntry(**r["cast"]) for m, r in records.items() if "cast" in r}
    for layer, rels in sorted(by_layer.items()):
        layers[layer] = LayerEntry(quantized_modules=len(rels), rel_mse_mean=sum(rels) / len(rels),
                                   rel_mse_max=max(rels))
    for fused in fused_sets.values():
        fused.members.sort()
    files = {shard: FileEntry(bytes=(root / shard).stat().st_size, tensors=len(e))
             for shard, e in plan.shard_entries.items()}
    summary = {**summary_numbers(plan, by_layer, files), **learned_outcome(obs)}
    if cast:
        summary["cast_exact_blocks"] = sum(c.exact_blocks for c in cast.values())
        summary["cast_blocks"] = sum(c.blocks for c in cast.values())
    if distributed.launched():  # how the run was spread; the bytes are the same on any count
        summary["world_size"] = distributed.world()
    return Manifest(
        tool={"name": "kconvert", "version": __version__}, command=command, options=options,
        source=SourceEntry(**ckpt.identity, fingerprint=ckpt.fingerprint()),
        output_format=fmt, files=files,
        non_weight_files=non_weight, generated_files=generated,
        tensors=dict(sorted(tensors.items())),
        fused_sets=dict(sorted(fused_sets.items())), layers=layers,
        summary=summary, dropped=dropped, obs=obs, cast=cast,
    )


def _made_by(m: ModuleWork, what: str) -> bool:
    """Whether a stage whose kind `what` (a StageKind flag: quantizes, sparsifies) claimed
    module `m`."""
    return any(getattr(KINDS[name], what) for name in m.stages)


def summary_numbers(plan: WorkPlan, by_layer: dict[str, list[float]],
                    files: dict[str, FileEntry]) -> dict:
    """What the run did, in numbers (the CLI's closing line is made from it)."""
    modules = {"quantized": 0, "dequantized": 0, "relaid": 0, "sparsified": 0}
    for m in plan.modules:
        if m.out_codec is None:
            continue
        if _made_by(m, "quantizes"):
            modules["quantized"] += 1
        elif m.repack:
            modules["relaid"] += 1
        else:
            modules["dequantized"] += 1
        modules["sparsified"] += _made_by(m, "sparsifies")
    rels = [r for rs in by_layer.values() for r in rs]
    stages = {k: v for stage in plan.stages for k, v in stage.summary().items()}
    return {**stages, "tensors": len(plan.outputs), "bytes": sum(f.bytes for f in files.values()),
            "shards": len(files), "quantized_modules": modules["quantized"],
            "dequantized_modules": modules["dequantized"], "relaid_modules": modules["relaid"],
            "sparsified_modules": modules["sparsified"],
            "pruned_experts": len({parse_name(n).module.rsplit(".", 1)[0]
                                   for n in plan.dropped}),
            "rel_mse_mean": sum(rels) / len(rels) if rels else 0.0,
            "rel_mse_max": max(rels, default=0.0)}


def summary_line(manifest: Manifest, dst: str) -> str:
    """One line that says what a run did: tensors and bytes written, and per stage how many
    modules it changed (only what happened is mentioned)."""
    s = manifest.summary
    parts = [f"wrote {dst}: {s['tensors']} tensors in {s['shards']} shard(s), "
             f"{human_bytes(s['bytes'])}"]
    if s.get("pruned_experts"):
        parts.append(f"{s['pruned_experts']} routed experts pruned")
    for guard in GUARDS:
        if f"{guard.key}_applied_layers" in s:
            applied, refused = s[f"{guard.key}_applied_layers"], s[f"{guard.key}_refused_layers"]
            parts.append(f"{guard.name} applied in {applied} of {applied + refused} MoE layers"
                         + (f" (refused by its guard in {refused}: {guard.kept} kept)"
                            if refused else ""))
    if (learned := learned_line(s)) is not None:
        parts.append(learned)
    if s.get("sparsified_modules"):
        parts.append(f"{s['sparsified_modules']} modules made paired-4:8 sparse")
    if s.get("quantized_modules"):
        fmt = next((manifest.options[name]["format"] for name, kind in KINDS.items()
                    if kind.quantizes and manifest.options.get(name)), "compressed-tensors")
        written = OUTPUT_CODECS[fmt].description if fmt in OUTPUT_CODECS else fmt
        parts.append(f"{s['quantized_modules']} modules quantized to {written} (relative squared "
                     f"error mean {s['rel_mse_mean']:.2e}, max {s['rel_mse_max']:.2e})")
    if s.get("cast_blocks"):
        parts.append(f"{s['cast_exact_blocks']} of {s['cast_blocks']} MXFP4 blocks cast "
                     "exactly")
    if s.get("dequantized_modules"):
        parts.append(f"{s['dequantized_modules']} modules dequantized")
    if s.get("relaid_modules"):
        parts.append(f"{s['relaid_modules']} modules re-laid out (bytes unchanged)")
    if len(parts) == 1:
        parts.append("every tensor copied unchanged")
    return "; ".join(parts)
