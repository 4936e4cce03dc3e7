"""What the `kconvert audit` test modules share: independent file I/O (headers parsed with
struct + json, bytes patched in place, or safetensors; never kconvert's own readers), the
assertions on a report's failures, and the fixtures every module audits (a pytest plugin of
those modules: `pytest_plugins = ["audit_support"]`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT
from helpers import cli_inproc, st_header
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.pruning.plan import load_plan
from kconvert.stages.prune import prune_stage
from third_party_prune import prune

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


# ------------------------------------------------------------------ fixtures


RECIPES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.toml"))
# Every command (with the options that change what it writes) and every built-in recipe.
OUTPUTS = [
    "int4-to-nvfp4-ct", "int4-to-nvfp4-amax", "int4-to-nvfp4-modelopt", "k25-int4-to-nvfp4-ct",
    "quantize-ct", "quantize-modelopt-all", "dequant-int4", "dequant-int4-f32", "dequant-nvfp4",
    "reap", "reap-int4-to-nvfp4", "sparsify-dense-16", "sparsify-dense-32",
    "sparsify-pair-bitmask-16", "sparsify-pair-bitmask-32", "densify",
    *(f"run-{r}" for r in RECIPES)]


@pytest.fixture(scope="session")
def outputs(fixture_dir, tmp_path_factory):
    """Every command and recipe, on the fixtures: name -> (output, source)."""
    root = tmp_path_factory.mktemp("audit-outputs")
    kimi, ct, k25, bf16 = (fixture_dir(v) for v in ("k2-int4-kimi", "k2-int4-ct", "k25-int4",
                                                    "bf16"))
    made = {
        "int4-to-nvfp4-ct": (run(kimi, root / "a", "int4-to-nvfp4"), kimi),
        "int4-to-nvfp4-amax": (run(kimi, root / "a2", "int4-to-nvfp4", block_scale="amax"),
                               kimi),
        "int4-to-nvfp4-modelopt": (run(ct, root / "b", "int4-to-nvfp4", format="modelopt"), ct),
        "k25-int4-to-nvfp4-ct": (run(k25, root / "c", "int4-to-nvfp4"), k25),
        "quantize-ct": (run(bf16, root / "e", "quantize"), bf16),
        "quantize-modelopt-all": (run(bf16, root / "f", "quantize", format="modelopt",
                                      targets="experts,shared_experts,dense_mlp,attention"),
                                  bf16),
        "dequant-int4": (run(ct, root / "g", "dequant"), ct),
        "dequant-int4-f32": (run(kimi, root / "g2", "dequant", dtype="F32"), kimi),
    }
    made["dequant-nvfp4"] = (run(made["int4-to-nvfp4-ct"][0], root / "h", "dequant"),
                             made["int4-to-nvfp4-ct"][0])
    plan = root / "reap-plan.json"
    plan.write_text(json.dumps({"criterion": "manual", "layers": {
        k: {"keep": v} for k, v in REAP_KEEP.items()}}))
    made["reap"] = (run(kimi, root / "i", "reap", plan=plan), kimi)
    made["reap-int4-to-nvfp4"] = (run(k25, root / "j", "reap-int4-to-nvfp4", plan=plan), k25)
    for storage in ("dense", "pair-bitmask"):
        for group in (16, 32):
            name = f"sparsify-{storage}-{group}"
            made[name] = (run(kimi, root / name, "sparsify", storage=storage, group_size=group),
                          kimi)
    bitmask = made["sparsify-pair-bitmask-16"][0]
    made["densify"] = (run(bitmask, root / "densify", "densify"), bitmask)
    for recipe in RECIPES:  # as `kconvert run NAME` runs them
        spec = load_recipe(recipe)
        src = {"nvfp4-pair-bitmask": bitmask,
               "mxfp4": made.get("run-int4-to-mxfp4", (kimi,))[0]}.get(spec.requires_source, kimi)
        prunes = any(s.get("stage") == "prune" for s in spec.stages)
        dst = root / f"run-{recipe}"
        res = cli_inproc("run", recipe, src, dst, "--quiet",
                         *(["--plan", str(plan)] if prunes else []))
        assert res.exit_code == 0, res.output
        made[f"run-{recipe}"] = (dst, src)
    assert sorted(made) == sorted(OUTPUTS)
    return made


@pytest.fixture(scope="session")
def pruned(fixture_dir, tmp_path_factory):
    """The third-party pruned checkpoint (8 of 16 experts per layer) and its plan."""
    src = fixture_dir("k2-int4-kimi")
    root = tmp_path_factory.mktemp("pruned")
    plan = prune(src, root / "pruned", keep=8, rule="router-l2")
    (root / "plan.json").write_text(json.dumps(plan))
    return root / "pruned", src, root / "plan.json", plan
