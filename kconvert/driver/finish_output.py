"""The files a conversion writes after its shards, in the order that lets an interrupted run
never pass for a complete one: non-weight files -> index -> config.json (+ the format's and the
stages' files) -> kconvert-manifest.json (kconvert.driver.convert runs it once every shard is
done)."""

from __future__ import annotations

import json

from kconvert.common import events
from kconvert.driver.manifest_writer import build_manifest
from kconvert.engine.work import WorkPlan
from kconvert.formats import HF_QUANT_CONFIG
from kconvert.formats.quant_config import output_config, rewrite_config
from kconvert.io.checkpoint import GENERATED_FILES, INDEX, Checkpoint
from kconvert.io.files import copy_file, hash_file, write_text
from kconvert.io.shards import tensor_nbytes
from kconvert.io.workspace import Workspace
from kconvert.records.manifest import MANIFEST, Manifest, render_manifest


def finish_output(ckpt: Checkpoint, ws: Workspace, plan: WorkPlan, records: dict[str, dict],
                  command: str, options: dict) -> Manifest:
    """Everything a finished run writes after its shards, in the order that says "done" last:
    the non-weight files, the index, config.json, the format's and the stages' files, then
    the manifest."""
    root = ws.root
    non_weight = {}
    for rel in ckpt.other_files():
        copy_file(ckpt.root / rel, root / rel, ws.tmp(rel))
        non_weight[rel] = hash_file(root / rel)
        events.emit("file-copied", file=rel)

    generated: list[str] = []

    def write(name: str, text: str, event: str = "file-written") -> None:
        write_text(root / name, text, ws.tmp(name))
        generated.append(name)
        events.emit(event, file=name)

    if ckpt.has_index:
        total = sum(tensor_nbytes(t.dtype, t.shape) for t in plan.outputs.values())
        weight_map = {t.name: t.shard for t in sorted(plan.outputs.values(), key=lambda t: t.name)}
        write(INDEX, _json({"metadata": {"total_size": total}, "weight_map": weight_map}),
              "index-written")

    shapes = {name: t.shape for name, t in plan.outputs.items()}
    fmt, qconfig, format_files = output_config(plan.modules, shapes, ckpt.config)
    dropped = dict(plan.dropped)
    if (ckpt.root / HF_QUANT_CONFIG).is_file() and HF_QUANT_CONFIG not in format_files:
        dropped[HF_QUANT_CONFIG] = "ModelOpt quantization file; output is not ModelOpt"
    for name in sorted(GENERATED_FILES - {"config.json", HF_QUANT_CONFIG, INDEX}):
        if (ckpt.root / name).is_file():
            dropped[name] = "written by an earlier kconvert run about ITS source; not carried"
    config = rewrite_config(ckpt.config, qconfig)
    for stage in plan.stages:
        stage.edit_config(config.get("text_config", config))
    write("config.json", _json(config), "config-written")
    for name, data in format_files.items():
        write(name, _json(data))
    for stage in plan.stages:
        for name, text in stage.output_files().items():
            write(name, text)

    manifest = build_manifest(ckpt, plan, records, command, options, fmt, dropped, non_weight,
                              {name: hash_file(root / name) for name in sorted(generated)}, root)
    write_text(root / MANIFEST, render_manifest(manifest), ws.tmp(MANIFEST), sync=True,
               staged=lambda: events.emit("manifest-staged", file=MANIFEST))
    events.emit("manifest-written", file=MANIFEST)
    return manifest


def _json(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True)
