"""`kconvert mxfp4-to-nvfp4` (quantize --cast exact, docs/formats.md §7) end to end: an MXFP4
tiny MoE (compressed-tensors and Quark layouts) cast to NVFP4 in both output formats decodes to
its source bit for bit, `kconvert eval` sees the same model (KL 0), `audit --source` checks
every exact block and catches a flipped code and a -0 written +0, and fails a manifest whose
exact-block counts differ from its recount (a module's, a missing or an extra one, the
summary's); a block 2^-20 below the tensor's largest is counted inexact; what the cast cannot
do is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import BUNDLED, ROOT
from helpers import (
    INDEX,
    MANIFEST,
    assert_audit_passes,
    assert_user_error,
    audit_json,
    checkpoint_tensors,
    cli_inproc,
    edit_tensor,
    write_input_ids,
)
from kconvert.formats import Mxfp4Codec, QuarkMxfp4Codec, mxfp4
from oracles import by_module

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
LAYOUTS = {"mxfp4-pack-quantized": Mxfp4Codec, "quark-mxfp4": QuarkMxfp4Codec}
NVFP4_DECODE = {"compressed-tensors": ("weight_packed", "weight_global_scale"),
                "modelopt": ("weight", "weight_scale_2")}


@pytest.fixture(scope="module")
def mx_source(tmp_path_factory):
    """layout -> the trained tiny MoE's routed experts quantized to MXFP4 in that layout."""
    made = {}

    def make(layout: str):
        if layout not in made:
            dst = tmp_path_factory.mktemp(layout) / "mx"
            res = cli_inproc("quantize", TINY_MOE, dst, "--format", layout, "--device", "cpu",
                             "--quiet")
            assert res.exit_code == 0, res.output
            made[layout] = dst
        return made[layout]

    return make


def cast_to(src, dst, fmt: str, *args) -> None:
    res = cli_inproc("mxfp4-to-nvfp4", src, dst, "--format", fmt, "--device", "cpu", "--quiet",
                     *args)
    assert res.exit_code == 0, res.output


def nvfp4_decode(params: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    from kconvert.formats import nvfp4

    packed, scale_2 = NVFP4_DECODE[fmt]
    return nvfp4.dequantize(params[packed].unsqueeze(0), params["weight_scale"].unsqueeze(0),
                            params[scale_2].reshape(1), fmt)[0]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_block_of_the_tiny_moe_casts_exactly(mx_source, tmp_path, layout, fmt):
    src = mx_source(layout)
    dst = tmp_path / "nv"
    cast_to(src, dst, fmt)
    codec = LAYOUTS[layout]
    source, out = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    experts = [m for m in source if ".experts." in m]
    assert len(experts) == 3 * 3 * 24
    for module in experts:
        want = mxfp4.dequantize(*(source[module][p].unsqueeze(0) for p in codec.params))[0]
        got = nvfp4_decode(out[module], fmt)
        assert torch.equal(want.view(torch.int32), got.view(torch.int32)), module
    report = assert_audit_passes(dst, "--source", src)
    blocks = sum(source[m][codec.params[1]].numel() for m in experts)
    assert f"exact MXFP4 cast: {blocks} of {blocks} blocks" in " ".join(report["notes"])
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    assert manifest["options"]["quantize"]["cast"] == "exact"
    assert manifest["layers"]["1"]["rel_mse_max"] == 0.0
    # gate and up of an expert share one per-tensor scale, a power of two
    for e in range(24):
        expert = f"model.layers.2.mlp.experts.{e}"
        scale = {p: out[f"{expert}.{p}"][NVFP4_DECODE[fmt][1]] for p in ("gate_proj", "up_proj")}
        assert torch.equal(scale["gate_proj"], scale["up_proj"])
        assert float(torch.frexp(scale["gate_proj"].float())[0].reshape(())) == 0.5


def test_the_manifest_records_each_modules_exact_blocks(mx_source, tmp_path):
    src, dst = mx_source("mxfp4-pack-quantized"), tmp_path / "nv"
    cast_to(src, dst, "compressed-tensors")
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    entry = manifest["cast"]["model.layers.1.mlp.experts.0.gate_proj"]
    assert entry == {"exact_blocks": 64 * 128 // 32, "blocks": 64 * 128 // 32}
    assert manifest["summary"]["cast_exact_blocks"] == manifest["summary"]["cast_blocks"]


def test_kl_of_the_cast_against_its_source_is_zero(mx_source, tmp_path):
    src, dst = mx_source("mxfp4-pack-quantized"), tmp_path / "nv"
    cast_to(src, dst, "modelopt")
    data = write_input_ids(tmp_path / "d.jsonl", ([(11 * i + 5 * j) % 250 for j in range(32)]
                                                  for i in range(2)))
    res = cli_inproc("eval", src, dst, "--data", data, "--seq-len", "32", "--samples", "2",
                     "--device", "cpu", "--dtype", "float32", "-o", tmp_path / "ev", "--quiet")
    assert res.exit_code == 0, res.output
    logits = json.loads((tmp_path / "ev" / "eval.json").read_text())["candidates"][0]["logits"]
    assert logits["kl_mean"] == 0.0 and logits["top1_agreement"] == 1.0


def tensor_file(d, name: str):
    """The shard of checkpoint `d` that holds tensor `name`."""
    return d / json.loads((d / INDEX).read_text())["weight_map"][name]


@pytest.mark.parametrize("flip", [0x01, 0x08], ids=["code", "sign-of-zero"])
def test_audit_catches_a_flipped_code(mx_source, tmp_path, flip):
    """A code changed by one step, or a -0 written +0 (no error at all: only the bit-for-bit
    check sees it), in a block the cast holds exactly."""
    src, dst = mx_source("mxfp4-pack-quantized"), tmp_path / "nv"
    cast_to(src, dst, "compressed-tensors")
    module = "model.layers.1.mlp.experts.3.down_proj"
    packed = checkpoint_tensors(src)[f"{module}.weight_packed"]
    # a byte whose low nibble is a zero code (0x0 or 0x8): flipping bit 3 keeps its value 0
    row, col = ((packed & 0x7) == 0).nonzero()[0].tolist()
    edit_tensor(tensor_file(dst, f"{module}.weight_packed"), f"{module}.weight_packed",
                lambda t: t.index_put_((torch.tensor(row), torch.tensor(col)), t[row, col] ^ flip))
    code, report = audit_json(dst, "--source", src)
    assert code == 1
    cast = [f for f in report["failures"] if f["check"] == "cast"]
    assert len(cast) == 1 and cast[0]["tensor"] == f"{module}.weight_packed", report["failures"]
    assert f"row {row}, elements {col * 2 // 32 * 32}.." in cast[0]["message"]


def test_a_block_2_to_the_minus_20_below_casts_inexactly(mx_source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(mx_source("mxfp4-pack-quantized"), src)
    module = "model.layers.2.mlp.experts.5.up_proj"
    scale = checkpoint_tensors(src)[f"{module}.weight_scale"]
    top = int(scale.max())
    edit_tensor(tensor_file(src, f"{module}.weight_scale"), f"{module}.weight_scale",
                lambda t: t.index_put_((torch.tensor(3), torch.tensor(1)),
                                       torch.tensor(top - 20, dtype=torch.uint8)))
    dst = tmp_path / "nv"
    cast_to(src, dst, "modelopt")
    report = assert_audit_passes(dst, "--source", src)
    blocks = 3 * 3 * 24 * 64 * 128 // 32
    assert f"exact MXFP4 cast: {blocks - 1} of {blocks} blocks" in " ".join(report["notes"])
    out = by_module(checkpoint_tensors(dst))[module]
    source = by_module(checkpoint_tensors(src))[module]
    want = mxfp4.dequantize(source["weight_packed"][None], source["weight_scale"][None])[0]
    got = nvfp4_decode(out, "modelopt")
    same = (want.view(torch.int32) == got.view(torch.int32)).view(-1, 4, 32).all(-1)
    assert int(same.sum()) == same.numel() - 1 and not same[3, 1]


def test_what_the_cast_cannot_do_is_refused(mx_source, tmp_path):
    assert_user_error(cli_inproc("mxfp4-to-nvfp4", BUNDLED, tmp_path / "a", "--device", "cpu"),
                      "--cast exact casts MXFP4 modules", "INT4")
    src = mx_source("mxfp4-pack-quantized")
    assert_user_error(cli_inproc("mxfp4-to-nvfp4", src, tmp_path / "b", "--format",
                                 "quark-mxfp4", "--device", "cpu"),
                      "--cast exact writes dense NVFP4")
    assert_user_error(cli_inproc("mxfp4-to-nvfp4", src, tmp_path / "c", "--targets",
                                 "experts,attention", "--device", "cpu"),
                      "--cast exact casts MXFP4 modules", "model.layers.0.self_attn")


def test_a_nan_exponent_stops_the_cast(mx_source, tmp_path):
    """E8M0 255 is MXFP4's NaN: the cast's amax is NaN, and the run stops naming the module."""
    src = tmp_path / "src"
    shutil.copytree(mx_source("mxfp4-pack-quantized"), src)
    module = "model.layers.2.mlp.experts.4.gate_proj"
    edit_tensor(tensor_file(src, f"{module}.weight_scale"), f"{module}.weight_scale",
                lambda t: t.index_put_((torch.tensor(1), torch.tensor(1)),
                                       torch.tensor(255, dtype=torch.uint8)))
    res = cli_inproc("mxfp4-to-nvfp4", src, tmp_path / "nv", "--device", "cpu", "--quiet")
    assert_user_error(res, "NaN or Inf in the source weights", module)


EDITED = "model.layers.2.mlp.experts.5.up_proj"


@pytest.fixture(scope="module")
def cast(mx_source, tmp_path_factory) -> tuple[Path, Path]:
    """(the MXFP4 source, its exact cast to compressed-tensors NVFP4)."""
    src = mx_source("mxfp4-pack-quantized")
    dst = tmp_path_factory.mktemp("cast") / "nv"
    cast_to(src, dst, "compressed-tensors")
    return src, dst


def _edited(cast: tuple[Path, Path], tmp_path: Path, edit) -> tuple[int, dict]:
    """audit --source of a copy of the cast whose manifest `edit` changed."""
    src, nv = cast
    out = tmp_path / "nv"
    shutil.copytree(nv, out)
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    return audit_json(out, "--source", src)


def _lower(manifest: dict) -> None:
    manifest["cast"][EDITED]["exact_blocks"] -= 1
    manifest["summary"]["cast_exact_blocks"] -= 1  # the totals still add up


def _drop(manifest: dict) -> None:
    del manifest["cast"][EDITED]


def _extra(manifest: dict) -> None:
    manifest["cast"]["model.layers.2.self_attn.o_proj"] = {"exact_blocks": 4, "blocks": 4}


def _summary(manifest: dict) -> None:
    manifest["summary"]["cast_exact_blocks"] -= 1


@pytest.mark.parametrize("edit, names_module", [(_lower, True), (_drop, True), (_extra, False),
                                                (_summary, False)],
                         ids=["lower", "missing", "extra", "summary"])
def test_a_manifest_whose_count_differs_fails(cast, tmp_path, edit, names_module):
    code, report = _edited(cast, tmp_path, edit)
    assert code == 1
    failures = [f for f in report["failures"] if f["check"] == "cast"]
    assert failures, report["failures"]
    if names_module:
        assert any((f["tensor"] or "").startswith(EDITED) for f in failures), failures
