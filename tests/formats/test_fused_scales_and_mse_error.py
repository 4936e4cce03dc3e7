"""NVFP4 outputs' scale choices: one global scale per fused gate/up set, and the mse block
scale rule's error against amax's, as the manifest reports it and as recomputed here.

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criteria covered: D (fused gate/up global scale), E (mse vs amax, manifest error
numbers).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from helpers import checkpoint_tensors
from oracles import (
    EXPERT_RE,
    PROJS,
    by_module,
    ct_int4_fp32,
    ct_nvfp4_fp32,
    expert_modules,
    int4_scheme,
    nvfp4a16_scheme,
)

# ------------------------------------------------------------------------------ D: fused sets


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_gate_and_up_share_one_global_scale(converted, fmt):
    """formats.md §2: gate_proj and up_proj of every expert carry the same global scale."""
    _, dst = converted("k2-int4-kimi", format=fmt)
    tensors = checkpoint_tensors(dst)
    mods = by_module(tensors)
    param = "weight_global_scale" if fmt == "compressed-tensors" else "weight_scale_2"
    scales: dict[tuple, dict[str, torch.Tensor]] = defaultdict(dict)
    for (prefix, layer, expert, proj), module in expert_modules(mods).items():
        scales[(prefix, layer, expert)][proj] = mods[module][param]
    assert len(scales) == 2 * 16
    down_differs = 0
    for key, s in scales.items():
        assert set(s) == set(PROJS), key
        assert torch.equal(s["gate_proj"], s["up_proj"]), key
        down_differs += not torch.equal(s["down_proj"], s["gate_proj"])
    assert down_differs > len(scales) // 2  # down is its own set: in general a different scale


# ------------------------------------------------------------------------------ E: mse vs amax


def _recomputed_rel_mse(src: Path, dst: Path) -> dict[str, float]:
    """module -> sum((w'-w)^2)/sum(w^2), w' decoded by CT from the output bytes, w by CT from
    the INT4 source, both in fp32; sums in fp64."""
    scheme_src, weights = int4_scheme(src), nvfp4a16_scheme()
    src_mods, out_mods = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    rel = {}
    for module in expert_modules(out_mods).values():
        w = ct_int4_fp32(src_mods[module], scheme_src).double()
        wq = ct_nvfp4_fp32(out_mods[module], weights).double()
        rel[module] = float(((wq - w) ** 2).sum() / (w**2).sum())
    return rel


def test_mse_block_scales_cut_error_vs_amax(converted):
    """On Kimi-style INT4 (codes -7..7) mse must reach <= 0.65x the amax rule's error, both as
    the manifest reports it and as recomputed from the output bytes."""
    summaries, recomputed = {}, {}
    for bs in ("mse", "amax"):
        src, dst = converted("k2-int4-kimi", block_scale=bs)
        summaries[bs] = json.loads((dst / "kconvert-manifest.json").read_text())["summary"]
        rel = _recomputed_rel_mse(src, dst)
        recomputed[bs] = sum(rel.values()) / len(rel)
    assert summaries["mse"]["rel_mse_mean"] <= 0.65 * summaries["amax"]["rel_mse_mean"]
    assert recomputed["mse"] <= 0.65 * recomputed["amax"]


@pytest.mark.parametrize("block_scale", ["mse", "amax"])
def test_manifest_rel_mse_matches_recomputed(converted, block_scale):
    src, dst = converted("k2-int4-kimi", block_scale=block_scale)
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    rel = _recomputed_rel_mse(src, dst)
    per_layer: dict[str, list[float]] = defaultdict(list)
    for module, r in rel.items():
        per_layer[str(int(EXPERT_RE.match(module)["layer"]))].append(r)
    assert set(manifest["layers"]) == set(per_layer)
    for layer, rels in per_layer.items():
        entry = manifest["layers"][layer]
        assert entry["quantized_modules"] == len(rels)
        assert entry["rel_mse_mean"] == pytest.approx(sum(rels) / len(rels), rel=1e-5)
        assert entry["rel_mse_max"] == pytest.approx(max(rels), rel=1e-5)
    summary = manifest["summary"]
    assert summary["quantized_modules"] == len(rel)
    assert summary["rel_mse_mean"] == pytest.approx(sum(rel.values()) / len(rel), rel=1e-5)
    assert summary["rel_mse_max"] == pytest.approx(max(rel.values()), rel=1e-5)
