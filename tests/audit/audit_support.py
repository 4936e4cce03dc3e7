"""What the `kconvert audit` test modules share: independent file I/O (headers parsed with
struct + json, bytes patched in place, or safetensors; never kconvert's own readers), the
assertions on a report's failures, and the commands and recipes whose outputs are audited."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT
from helpers import st_header
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.pruning.plan import load_plan
from kconvert.stages.prune import prune_stage

INDEX = "model.safetensors.index.json"


# ------------------------------------------------------------------ helpers (independent I/O)


def locate(ckpt: Path, name: str) -> tuple[Path, int, int, dict]:
    shard = json.loads((ckpt / INDEX).read_text())["weight_map"][name]
    header, base = st_header(ckpt / shard)
    start, end = header[name]["data_offsets"]
    return ckpt / shard, base + start, base + end, header[name]


def read_raw(ckpt: Path, name: str) -> bytes:
    path, start, end, _ = locate(ckpt, name)
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(end - start)


def write_raw(ckpt: Path, name: str, data: bytes) -> None:
    path, start, end, _ = locate(ckpt, name)
    assert len(data) == end - start
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(data)


def tensor(ckpt: Path, name: str) -> torch.Tensor:
    path, _, _, _ = locate(ckpt, name)
    with safe_open(str(path), "pt") as fh:
        return fh.get_tensor(name)


def rewrite_shard(ckpt: Path, shard: str, edit, update_index: bool = True) -> None:
    """Load one shard with safetensors, let `edit` change the dict, save it (and the index)."""
    with safe_open(str(ckpt / shard), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors = edit(tensors)
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    if update_index:
        index = json.loads((ckpt / INDEX).read_text())
        wm = {k: v for k, v in index["weight_map"].items() if v != shard}
        wm.update({k: shard for k in tensors})
        index["weight_map"] = dict(sorted(wm.items()))
        (ckpt / INDEX).write_text(json.dumps(index, indent=2))


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def failures(report: dict, group: str, check: str | None = None) -> list[dict]:
    return [f for f in report["failures"] if f["group"] == group
            and (check is None or f["check"] == check)]


def assert_named(report: dict, group: str, check: str, *, layer: int | None = None,
                 tensor: str | None = None, file: str | None = None, text: str = "") -> dict:
    """A failure of this group/check names the layer, the tensor/file and says `text`."""
    found = failures(report, group, check)
    for f in found:
        if (layer is None or f.get("layer") == layer) and (
                tensor is None or tensor in f.get("tensor", "")) and (
                file is None or f.get("file") == file) and text in f["message"]:
            return f
    got = json.dumps(report["failures"], indent=1)
    raise AssertionError(f"no {group}/{check} failure with layer={layer} tensor~{tensor} "
                         f"file={file} text~{text!r}; got {got}")


def rehash_generated(ckpt: Path) -> None:
    """After deliberately editing config files, record their new hashes in the manifest (so
    that only the check under test can object)."""
    path = ckpt / "kconvert-manifest.json"
    man = json.loads(path.read_text())
    for name in man.get("generated_files", {}):
        man["generated_files"][name] = xxhash.xxh3_128((ckpt / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(man))


def run(src: Path, dst: Path, recipe: str, plan: Path | None = None, **options) -> Path:
    prepare = None
    if plan is not None:  # the reap command's path for a given --plan
        prepare = lambda ckpt: {"prune": prune_stage(load_plan(plan), ckpt)}  # noqa: E731
    convert(str(src), str(dst), load_recipe(recipe), options, RunControl(quiet=True),
            prepare=prepare)
    return dst


# A REAP plan for the 16-expert fixtures: kept source ids per MoE layer, ascending.
REAP_KEEP = {"1": [0, 2, 3, 5, 8, 9, 12, 15], "2": [1, 2, 4, 6, 7, 10, 11, 14]}


# ------------------------------------------------------------------ outputs audited


RECIPES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.toml"))
# Every command (with the options that change what it writes) and every built-in recipe.
OUTPUTS = [
    "int4-to-nvfp4-ct", "int4-to-nvfp4-amax", "int4-to-nvfp4-modelopt", "k25-int4-to-nvfp4-ct",
    "quantize-ct", "quantize-modelopt-all", "dequant-int4", "dequant-int4-f32", "dequant-nvfp4",
    "reap", "reap-int4-to-nvfp4", "sparsify-dense-16", "sparsify-dense-32",
    "sparsify-pair-bitmask-16", "sparsify-pair-bitmask-32", "densify",
    *(f"run-{r}" for r in RECIPES)]
