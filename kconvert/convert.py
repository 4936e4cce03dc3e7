"""One conversion run, start to finish: checks, plan, execute, then the files that say "done".

Order of writes, so that an interrupted run is never mistaken for a complete one:
shards (each renamed into place when complete) -> non-weight files -> index -> config.json
(+ hf_quant_config.json) -> kconvert-manifest.json. `.kconvert/` holds resume state until the
manifest is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kconvert import __version__
from kconvert.engine import (
    STATE_DIR,
    Plan,
    _atomic_json,
    atomic_write_text,
    build_plan,
    describe,
    execute,
)
from kconvert.errors import KconvertError
from kconvert.layout import parse_name
from kconvert.manifest import (
    MANIFEST,
    FileEntry,
    FusedSetEntry,
    LayerEntry,
    Manifest,
    SourceEntry,
    TensorEntry,
    hash_file,
    write_manifest,
)
from kconvert.pipeline import Recipe, build_stages
from kconvert.quant_config import (
    compressed_tensors_block,
    modelopt_blocks,
    output_format,
    rewrite_config,
)
from kconvert.safetensors_io import tensor_nbytes
from kconvert.source import GENERATED_FILES, INDEX, Checkpoint, open_checkpoint
from kconvert.structure import validate_source


@dataclass(frozen=True)
class RunControl:
    """Options that change how a run goes, never what it writes."""

    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = False
    readers: int = 4


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KconvertError(f"--device {spec}: no CUDA device is available")
    return device


def _check_dst(src: Path, dst: Path, run: RunControl) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise KconvertError("DST must not be SRC, inside it, or contain it (the source is "
                            "never modified)", file=str(dst))
    if dst.exists() and not dst.is_dir():
        raise KconvertError("DST exists and is not a directory", file=str(dst))
    if dst.exists() and any(dst.iterdir()) and not (run.resume or run.overwrite):
        raise KconvertError("DST is not empty; pass --resume to continue an interrupted run "
                            "or --overwrite to replace it", file=str(dst))


def _fingerprint(ckpt: Checkpoint, command: str, options: dict) -> str:
    """Identifies what a run writes: same source layout + same command/options -> same bytes."""
    layout = sorted((n, i.dtype, list(i.shape), i.file.name) for n, i in ckpt.tensors.items())
    blob = json.dumps([__version__, command, options, ckpt.identity, layout], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _stats_hash(stages) -> str | None:
    paths = [s.act_stats for s in stages if getattr(s, "act_stats", None)]
    return hash_file(Path(paths[0])) if paths else None


def _load_done(dst: Path, plan: Plan, fingerprint: str) -> dict[str, dict]:
    """Records of shards a previous run of the same conversion finished (and that still hold)."""
    from kconvert.safetensors_io import plan_header, read_header

    state = dst / STATE_DIR
    run_file = state / "run.json"
    if not run_file.is_file():
        if (dst / MANIFEST).is_file():
            raise KconvertError("DST is already a complete output (it has a manifest); use "
                                "--overwrite to redo it", file=str(dst))
        if any(p.name != STATE_DIR for p in dst.iterdir()):
            raise KconvertError("--resume: DST holds files but no kconvert run state",
                                file=str(dst))
        return {}
    if json.loads(run_file.read_text()).get("fingerprint") != fingerprint:
        raise KconvertError("--resume: DST was started by a different command, options or "
                            "source; use --overwrite", file=str(dst))
    done = {}
    entries = plan.shard_entries
    for shard, shard_entries in entries.items():
        rec = state / "done" / f"{shard}.json"
        final = dst / shard
        if not (rec.is_file() and final.is_file()):
            continue
        head, offsets = plan_header(shard_entries)
        size = len(head) + max((e for _, e in offsets.values()), default=0)
        # A shard counts as complete only if its header is the planned one and its size right.
        if read_header(final) == head and final.stat().st_size == size:
            done[shard] = json.loads(rec.read_text())
    return done


def convert(src: str, dst: str, recipe: Recipe, options: dict, run: RunControl,
            revision: str | None = None, echo=print,
            prepare: Callable[[Checkpoint], dict] | None = None) -> Manifest | None:
    """Run `recipe` on SRC into DST; `options` override its stages' options.

    `prepare(ckpt)` may add options that need the opened source, e.g. the pruning stage,
    whose plan is checked against (or computed from) the checkpoint.
    """
    ckpt = open_checkpoint(src, revision)
    try:
        if prepare is not None:
            options = {**options, **prepare(ckpt)}
        return _convert(ckpt, Path(dst), recipe, options, run, echo)
    finally:
        ckpt.close()


def _convert(ckpt: Checkpoint, dst: Path, recipe: Recipe, options: dict, run: RunControl,
             echo) -> Manifest | None:
    _check_dst(ckpt.root, dst, run)
    stages = build_stages(recipe, options)
    device = pick_device(run.device)
    # GPU items of 2^28 decoded elements (~18 Kimi expert matrices): large enough to keep
    # the GPU busy, small enough that prefetch + queued results stay within ~4 GB of host RAM.
    # On a CPU, items of 2^24 elements (~one expert matrix; the fused kernel is per row anyway)
    # keep the decode temporaries to ~200 MB (measured in tests/test_robustness.py).
    work_elems = 1 << 28 if device.type == "cuda" else 1 << 24
    plan = build_plan(ckpt, stages, work_elems)
    for warning in validate_source(ckpt.config, ckpt.tensors, plan.modules, ckpt.root):
        echo(f"kconvert: warning: {warning}")
    if recipe.requires_source and not any(m.codec.name == recipe.requires_source
                                          for m in plan.modules):
        raise KconvertError(f"{recipe.name} needs a source with {recipe.requires_source} modules "
                            "and this one has none", file=str(ckpt.root / "config.json"))
    if run.dry_run:
        _print_plan(plan, echo)
        return None

    recorded = {**{s.name: s.recorded() for s in stages}, "recipe": recipe.name}
    fingerprint = _fingerprint(ckpt, recipe.name, {**recorded, "act_stats": _stats_hash(stages)})
    if run.overwrite and dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True, exist_ok=True)
    done = _load_done(dst, plan, fingerprint) if run.resume else {}
    (dst / STATE_DIR).mkdir(exist_ok=True)
    _atomic_json(dst / STATE_DIR / "run.json", {"fingerprint": fingerprint})

    total = sum(item.nbytes for item in plan.items)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=run.quiet,
                  desc=recipe.name, smoothing=0.1) as bar:
            records = execute(plan, dst, device, done, bar.update, readers=run.readers)
    finally:
        for stage in stages:
            stage.close()
    manifest = _finish(ckpt, dst, plan, records, recipe.name, recorded)
    shutil.rmtree(dst / STATE_DIR)
    return manifest


def _print_plan(plan: Plan, echo) -> None:
    rows = describe(plan)
    echo(f"{'role':<15} {'source':<26} {'output':<26} {'tensors':>8} {'in MB':>10} {'out MB':>10}")
    for role, fmt, out, count, nin, nout in rows:
        echo(f"{role:<15} {fmt:<26} {out:<26} {count:>8} {nin / 1e6:>10.1f} {nout / 1e6:>10.1f}")
    nin = sum(r[4] for r in rows)
    nout = sum(r[5] for r in rows)
    echo(f"{'total':<69} {sum(r[3] for r in rows):>8} {nin / 1e6:>10.1f} {nout / 1e6:>10.1f}")
    echo(f"output format: {output_format(plan.modules)}; {len(plan.shard_entries)} shards, "
         f"{len(plan.outputs)} tensors")


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".kconvert-tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _finish(ckpt: Checkpoint, dst: Path, plan: Plan, records: dict[str, dict], command: str,
            options: dict) -> Manifest:
    non_weight = {}
    for rel in ckpt.other_files():
        _copy_file(ckpt.root / rel, dst / rel)
        non_weight[rel] = hash_file(dst / rel)

    entries = plan.shard_entries
    if ckpt.has_index:
        total = sum(tensor_nbytes(t.dtype, t.shape) for t in plan.outputs.values())
        weight_map = {t.name: t.shard for t in sorted(plan.outputs.values(), key=lambda t: t.name)}
        _atomic_json(dst / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})

    fmt = output_format(plan.modules)
    names = list(plan.outputs)
    dropped = dict(plan.dropped)
    if fmt == "modelopt":
        block, hf_quant = modelopt_blocks(plan.modules, names)
        _atomic_json(dst / "hf_quant_config.json", hf_quant)
    else:
        has_vision = any(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
        block = (compressed_tensors_block(plan.modules, has_vision)
                 if fmt == "compressed-tensors" else None)
        if fmt == "source":
            block = ckpt.config.get("quantization_config") or ckpt.text_config.get(
                "quantization_config")
        elif block is not None:
            for stage in plan.stages:
                stage.edit_quant_config(block)
        if (ckpt.root / "hf_quant_config.json").is_file():
            dropped["hf_quant_config.json"] = "ModelOpt quantization file; output is not ModelOpt"
    for name in sorted(GENERATED_FILES - {"config.json", "hf_quant_config.json", INDEX}):
        if (ckpt.root / name).is_file():
            dropped[name] = "written by an earlier kconvert run about ITS source; not carried"
    config = rewrite_config(ckpt.config, block)
    for stage in plan.stages:
        stage.edit_config(config.get("text_config", config))
    _atomic_json(dst / "config.json", config)
    for stage in plan.stages:
        for name, text in stage.output_files().items():
            atomic_write_text(dst / name, text)
    generated = {p.name: hash_file(p) for p in sorted(dst.iterdir())
                 if p.is_file() and p.suffix != ".safetensors" and p.name not in non_weight
                 and p.name != MANIFEST}

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
        entry = fused_sets.setdefault(
            out_set, FusedSetEntry(members=[], amax=st["amax"],
                                          global_scale=st["global_scale"]))
        entry.members.append(m.out_module)
        rel = st["err_sq"] / st["ref_sq"] if st["ref_sq"] else 0.0
        if "quantize" in m.stages:  # re-laid-out modules (densify) were not re-encoded
            by_layer.setdefault(str(m.tn.layer), []).append(rel)
    for layer, rels in sorted(by_layer.items()):
        layers[layer] = LayerEntry(quantized_modules=len(rels), rel_mse_mean=sum(rels) / len(rels),
                                   rel_mse_max=max(rels))
    all_rel = [r for rels in by_layer.values() for r in rels]
    summary = {"tensors": len(tensors), "quantized_modules": len(all_rel),
               "rel_mse_mean": sum(all_rel) / len(all_rel) if all_rel else 0.0,
               "rel_mse_max": max(all_rel, default=0.0)}
    for fused in fused_sets.values():
        fused.members.sort()
    files = {shard: FileEntry(bytes=(dst / shard).stat().st_size, tensors=len(e))
             for shard, e in entries.items()}
    manifest = Manifest(
        tool={"name": "kconvert", "version": __version__}, command=command, options=options,
        source=SourceEntry(**ckpt.identity), output_format=fmt, files=files,
        non_weight_files=non_weight, generated_files=generated,
        tensors=dict(sorted(tensors.items())),
        fused_sets=dict(sorted(fused_sets.items())), layers=layers, summary=summary,
        dropped=dropped,
    )
    write_manifest(dst, manifest)
    return manifest
