"""On-disk formats, checked against the ecosystem's own code (formats.md, kimi.md).

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criteria covered: A (INT4 decode), B (compressed-tensors output decompresses like
kconvert's decode, config validates), C (--block-scale amax bit parity), D (fused gate/up
global scale), E (mse vs amax, manifest error numbers), F (ModelOpt flavour), G (K2.5 wrapper),
I (NVFP4 check vector and E2M1 tie points), J (ModelOpt's own NVFP4 math, when installed).
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
)
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
    ModelOptNvfp4Converter,
)
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.utils import generate_gparam

from helpers import checkpoint_tensors, run_inproc
from kconvert.formats import nvfp4
from kconvert.formats.int4 import Int4Codec
from oracles import (
    CT_PARAMS,
    E2M1,
    EXPERT_RE,
    INT4_CHECK_CODES,
    INT4_CHECK_WORDS,
    MODELOPT_PARAMS,
    NVFP4_CHECK_BYTES,
    NVFP4_CHECK_VALUES,
    PROJS,
    TIE_POINTS,
    by_module,
    ct_int4_fp32,
    ct_nvfp4_fp32,
    ct_reference_compress,
    ct_scheme_for,
    dicts,
    expert_modules,
    int4_scheme,
    kconvert_nvfp4,
    nvfp4a16_scheme,
    raw_tensors,
    u8,
)

# ------------------------------------------------------------------------------ helpers


# ------------------------------------------------------------------------------ A: INT4 decode


def test_int4_check_vector_words():
    """formats.md §1: the codes pack to 0xfba98710, 0x0000005d; CT and kconvert read them back."""
    words = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in INT4_CHECK_WORDS]],
                         dtype=torch.int32)
    codes = torch.tensor([INT4_CHECK_CODES], dtype=torch.int8)
    # compressed-tensors' own packer agrees with the documented words (it pads with nibble 0).
    assert torch.equal(pack_to_int32(codes, 4), words)
    # A 16-wide row: the 6 padding nibbles are 0, i.e. code -8.
    expected = torch.tensor([INT4_CHECK_CODES + [-8] * 6], dtype=torch.int8)
    for shape_dtype in (torch.int32, torch.int64):
        shape = torch.tensor([1, 16], dtype=shape_dtype)
        assert torch.equal(unpack_from_int32(words, 4, shape), expected)
    scale = torch.tensor([[1.0]], dtype=torch.bfloat16)  # one group of 16
    got = Int4Codec.decode({"weight_packed": words[None], "weight_scale": scale[None]}, (1, 16))
    assert got.dtype == torch.float32
    assert torch.equal(got[0], expected.float())


def int4_scheme_from_fixture_config() -> QuantizationScheme:
    """Kimi's literal INT4 block (formats.md §1) as compressed-tensors parses it."""
    from kconvert.testing.fixture_config import kimi_quantization_config

    return QuantizationConfig.model_validate(kimi_quantization_config()).config_groups["group_0"]


@pytest.mark.parametrize("shape_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_int4_decode_all_codes_before_bf16_rounding(shape_dtype):
    """Int4Codec.decode == compressed-tensors' fp32 q*scale for all 16 codes, bit for bit."""
    out_f, in_f, group = 12, 128, 32
    gen = torch.Generator().manual_seed(7)
    # Every row holds each code -8..7 exactly 8 times, in a random order.
    rows = [torch.arange(-8, 8).repeat(in_f // 16)[torch.randperm(in_f, generator=gen)]
            for _ in range(out_f)]
    codes = torch.stack(rows).to(torch.int8)
    # bf16 scales with full mantissas, so that q*scale is often not a bf16 value.
    scale = (torch.rand(out_f, in_f // group, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    packed = pack_to_int32(codes, 4)
    sd = {"weight_packed": packed, "weight_scale": scale,
          "weight_shape": torch.tensor([out_f, in_f], dtype=shape_dtype)}
    scheme = int4_scheme_from_fixture_config()

    assert torch.equal(unpack_from_int32(packed, 4, sd["weight_shape"]), codes)
    reference = ct_int4_fp32(sd, scheme)
    # The same reference written out: fp32 product of CT's unpacked codes and the scale.
    product = unpack_from_int32(packed, 4, sd["weight_shape"]).float() * \
        scale.float().repeat_interleave(group, dim=1)
    assert torch.equal(reference, product)

    got = Int4Codec.decode({"weight_packed": packed[None], "weight_scale": scale[None]},
                           (out_f, in_f))[0]
    assert got.dtype == torch.float32
    assert torch.equal(got, reference)
    # The comparison is made before bf16 rounding: CT's default (bf16) decompression differs.
    ct_bf16 = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    assert ct_bf16.dtype == torch.bfloat16
    assert not torch.equal(ct_bf16.float(), reference)
    assert torch.equal(ct_bf16, reference.to(torch.bfloat16))


@pytest.mark.parametrize("variant,shape_dtype", [("k2-int4-kimi", torch.int32),
                                                 ("k2-int4-ct", torch.int64)])
def test_int4_decode_of_fixture_checkpoint(fixture_dir, variant, shape_dtype):
    """kconvert's planner reads int32 and int64 weight_shape; its decode equals CT's in fp32."""
    from kconvert.engine.work import read_shape_values
    from kconvert.formats.linear import group_modules
    from kconvert.io.checkpoint import open_checkpoint

    src = fixture_dir(variant)
    scheme = int4_scheme(src)
    mods = by_module(checkpoint_tensors(src))
    ckpt = open_checkpoint(str(src))
    try:
        modules, _ = group_modules(ckpt.tensors, read_shape_values(ckpt))
    finally:
        ckpt.close()
    int4 = [m for m in modules if m.codec is Int4Codec]
    assert len(int4) == len(expert_modules(mods)) > 0
    for m in int4:
        sd = mods[m.module]
        assert sd["weight_shape"].dtype == shape_dtype
        assert m.shape == tuple(sd["weight_shape"].tolist())
        got = Int4Codec.decode({p: sd[p][None] for p in ("weight_packed", "weight_scale")},
                               m.shape)[0]
        assert torch.equal(got, ct_int4_fp32(sd, scheme)), m.module


# ------------------------------------------------------------------------------ I: NVFP4 math


def test_nvfp4_check_vector_packing():
    """formats.md §2: [.5,-1,6,0,-0,3,-6,1.5] -> A1 07 58 3F (even element in the low nibble)."""
    values = torch.tensor(NVFP4_CHECK_VALUES)
    nibbles = torch.tensor([E2M1.index(abs(v)) for v in NVFP4_CHECK_VALUES], dtype=torch.uint8)
    nibbles |= torch.signbit(values).to(torch.uint8) << 3  # -0 is written 0x8
    packed = nvfp4.pack_codes(nibbles)
    assert bytes(packed.tolist()) == NVFP4_CHECK_BYTES
    # compressed-tensors packs the same values to the same bytes.
    assert bytes(pack_fp4_to_uint8(values[None]).flatten().tolist()) == NVFP4_CHECK_BYTES
    assert torch.equal(nvfp4.unpack_codes(packed), nibbles)


def _tie_rows(step: float) -> torch.Tensor:
    """Blocks whose values divided by the block's step land exactly on E2M1 cut points."""
    ties = list(TIE_POINTS)
    block0 = [6.0, *ties, *[-t for t in ties], -0.0]  # block amax 6 -> scale 448, y = x / step
    near = [6.0, -0.1, 0.1, -0.25, 0.2, 4.9, 5.1, -5.1, 0.3, 0.7, 1.3, 1.7, 2.4, 2.6, 3.4, 3.6]
    row = torch.tensor(block0) * step
    # row/4: scale 112, same y; an all-zero block gets CT's 0.125 scale (formats.md §2).
    blocks = [row, -row, row / 4, torch.tensor(near) * step, torch.zeros(16)]
    return torch.stack([torch.cat(blocks), torch.cat(blocks[::-1])])


def _quantize_paths() -> list:
    """nvfp4.quantize's CPU paths: the fused numba kernel and the torch path (the GPU's)."""
    if "fused_cpu" in inspect.signature(nvfp4.quantize).parameters:
        return [pytest.param({"fused_cpu": True}, id="fused"),
                pytest.param({"fused_cpu": False}, id="torch")]
    return [pytest.param({}, id="default")]


@pytest.mark.parametrize("path", _quantize_paths())
@pytest.mark.parametrize("amax", [6.0, 0.75, 96.0])
def test_nvfp4_tie_points_match_compressed_tensors(amax, path):
    """E2M1 rounding on every cut point (and its negative) equals CT's cast_to_fp4, byte for byte.

    With amax = 6*2^k the global scale is 448/2^k and a block of amax 6*2^k gets the scale
    448 exactly, so x / (scale/gs) = x / 2^k is exact and lands on the cut points.
    """
    step = amax / 6.0
    w = _tie_rows(step)
    assert w.abs().max().item() == amax
    q = nvfp4.quantize(w[None], torch.tensor([amax]), scale_rule="amax", **path)
    gs = generate_gparam(w.min(), w.max())
    assert torch.equal(q.global_scale.reshape(1), gs)
    ref = ct_reference_compress(w, gs)
    assert torch.equal(u8(q.block_scales[0]), u8(ref["weight_scale"]))
    assert torch.equal(q.packed[0], ref["weight_packed"])
    # And the decoded tie points are where formats.md says they go.
    decoded = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale)[0]
    first = decoded[0, 1:8] / step
    assert first.tolist() == list(TIE_POINTS.values())
    assert (decoded[0, 8:15] / step).tolist() == [-v for v in TIE_POINTS.values()]


# ------------------------------------------------------------------------------ B: CT output


@pytest.mark.parametrize("block_scale", ["mse", "amax"])
def test_ct_quantization_config_validates(converted, block_scale):
    """config.json's block parses as compressed-tensors' QuantizationConfig, NVFP4A16 exactly,
    and its targets/ignore select exactly the modules that are NVFP4 on disk."""
    _, dst = converted("k2-int4-kimi", block_scale=block_scale)
    cfg = json.loads((dst / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.quant_method == "compressed-tensors"
    assert qc.format == "nvfp4-pack-quantized"
    assert qc.quantization_status == "compressed"
    preset = nvfp4a16_scheme().weights
    for scheme in qc.config_groups.values():
        assert scheme.format == "nvfp4-pack-quantized"
        assert scheme.input_activations is None and scheme.output_activations is None
        for field in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic",
                      "scale_dtype"):
            assert getattr(scheme.weights, field) == getattr(preset, field), field
    mods = by_module(checkpoint_tensors(dst))
    for module, sd in mods.items():
        targeted = ct_scheme_for(module, qc) is not None
        is_nvfp4 = "weight_packed" in sd
        if is_nvfp4 or (sd.get("weight") is not None and sd["weight"].ndim == 2):
            assert targeted == is_nvfp4, module
    assert not any("weight_shape" in sd for sd in mods.values())


@pytest.mark.parametrize("block_scale", ["mse", "amax"])
def test_ct_output_decompresses_like_kconvert(converted, block_scale):
    """NVFP4PackedCompressor.decompress (scheme from config.json) == bf16(kconvert decode)."""
    _, dst = converted("k2-int4-kimi", block_scale=block_scale)
    qc = QuantizationConfig.model_validate(
        json.loads((dst / "config.json").read_text())["quantization_config"])
    mods = by_module(checkpoint_tensors(dst))
    nvfp4_mods = {m: sd for m, sd in mods.items() if "weight_packed" in sd}
    assert set(nvfp4_mods) == set(expert_modules(mods).values())
    assert len(nvfp4_mods) == 2 * 16 * 3
    for module, sd in nvfp4_mods.items():
        assert set(sd) == CT_PARAMS, module
        out_f, half = sd["weight_packed"].shape
        assert sd["weight_packed"].dtype == torch.uint8
        assert sd["weight_scale"].dtype == torch.float8_e4m3fn
        assert sd["weight_scale"].shape == (out_f, 2 * half // 16)
        assert sd["weight_global_scale"].dtype == torch.float32
        assert sd["weight_global_scale"].shape == (1,)
        scheme = ct_scheme_for(module, qc)
        ref = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
        assert ref.dtype == torch.bfloat16
        assert torch.equal(ref, kconvert_nvfp4(sd).to(torch.bfloat16)), module


# ------------------------------------------------------------------------------ C: amax parity


@pytest.mark.parametrize("variant", ["k2-int4-ct", "k2-int4-kimi"])
def test_amax_output_is_compressed_tensors_bytes(converted, variant):
    """--block-scale amax: weight_packed / weight_scale are what CT's compressor writes for the
    fp32 INT4 decode under the output's global scale, which is CT's generate_gparam of the
    fused set's (gate+up) or the module's (down) range."""
    src, dst = converted(variant, block_scale="amax")
    scheme = int4_scheme(src)
    src_mods, out_mods = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    experts = expert_modules(out_mods)
    assert experts and set(experts) == set(expert_modules(src_mods))
    sets: dict[tuple, dict[str, str]] = defaultdict(dict)
    for (prefix, layer, expert, proj), module in experts.items():
        sets[(prefix, layer, expert)][proj] = module
    for members in sets.values():
        w = {p: ct_int4_fp32(src_mods[m], scheme) for p, m in members.items()}
        fused = torch.cat([w["gate_proj"], w["up_proj"]])
        expected_gs = {"gate_proj": generate_gparam(fused.min(), fused.max()),
                       "up_proj": generate_gparam(fused.min(), fused.max()),
                       "down_proj": generate_gparam(w["down_proj"].min(), w["down_proj"].max())}
        for proj, module in members.items():
            out = out_mods[module]
            gs = out["weight_global_scale"]
            assert torch.equal(gs, expected_gs[proj]), module
            ref = ct_reference_compress(w[proj], gs)
            assert torch.equal(u8(out["weight_scale"]), u8(ref["weight_scale"])), module
            assert torch.equal(out["weight_packed"], ref["weight_packed"]), module


def test_mse_block_scales_round_elements_like_compressed_tensors(converted):
    """Under the FP8 block scales the mse rule picked, every element is rounded exactly as
    CT's compressor rounds it (only the block-scale choice differs from amax)."""
    src, dst = converted("k2-int4-kimi", block_scale="mse")
    scheme = int4_scheme(src)
    src_mods, out_mods = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    for module in expert_modules(out_mods).values():
        out = out_mods[module]
        w = ct_int4_fp32(src_mods[module], scheme)
        ref = ct_reference_compress(w, out["weight_global_scale"],
                                    scale=out["weight_scale"].float())
        assert torch.equal(out["weight_packed"], ref["weight_packed"]), module
        # mse scales stay valid FP8 codes inside [2^-9, 448].
        s = out["weight_scale"].float()
        assert bool(torch.isfinite(s).all()) and float(s.min()) >= 2**-9 and float(s.max()) <= 448


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


# ------------------------------------------------------------------------------ F: ModelOpt


def test_modelopt_tensor_layout(converted):
    """formats.md §3b: weight U8 [out,in/2], weight_scale F8_E4M3 [out,in/16],
    weight_scale_2 F32 scalar []; no compressed-tensors parameter names."""
    src, dst = converted("k2-int4-kimi", format="modelopt")
    raw = raw_tensors(dst)
    src_mods = by_module(checkpoint_tensors(src))
    mods: dict[str, dict[str, tuple]] = defaultdict(dict)
    for name, entry in raw.items():
        module, _, param = name.rpartition(".")
        mods[module][param] = entry
    experts = expert_modules(mods)
    assert len(experts) == 2 * 16 * 3
    for module in experts.values():
        out_f, in_f = src_mods[module]["weight_shape"].tolist()
        p = mods[module]
        assert set(p) == MODELOPT_PARAMS, module
        assert p["weight"][:2] == ("U8", [out_f, in_f // 2])
        assert p["weight_scale"][:2] == ("F8_E4M3", [out_f, in_f // 16])
        assert p["weight_scale_2"][:2] == ("F32", [])
        assert len(p["weight_scale_2"][2]) == 4
    assert not any(n.rpartition(".")[2] in {"weight_packed", "weight_global_scale",
                                             "weight_shape"} for n in raw)


def test_modelopt_configs(converted):
    """hf_quant_config.json says weight-only NVFP4 (W4A16_NVFP4: no input scales were written;
    ModelOpt's plain "NVFP4" means W4A4) / group 16; excluded modules carry no scales and every
    unquantized linear is excluded (vLLM matches with fnmatch); config.json holds the block
    ModelOpt's own export makes of that hf_quant_config.json, and no compressed-tensors block
    anywhere."""
    _, dst = converted("k2-int4-kimi", format="modelopt")
    hf = json.loads((dst / "hf_quant_config.json").read_text())
    q = hf["quantization"]
    assert q["quant_algo"] == "W4A16_NVFP4"
    assert q["group_size"] == 16
    exclude = q["exclude_modules"]
    mods = by_module(checkpoint_tensors(dst))
    scale_params = {"weight_scale", "weight_scale_2", "input_scale"}
    for module, sd in mods.items():
        excluded = any(fnmatch.fnmatchcase(module, pat) for pat in exclude)
        has_scales = bool(scale_params & set(sd))
        if excluded:
            assert not has_scales, f"{module} is excluded but carries {sorted(sd)}"
        elif has_scales:
            assert set(sd) == MODELOPT_PARAMS, module
        elif "weight" in sd and sd["weight"].ndim == 2 and not module.endswith("embed_tokens"):
            raise AssertionError(f"unquantized linear {module} is not excluded")
    cfg = json.loads((dst / "config.json").read_text())
    block = cfg["quantization_config"]
    assert block["quant_method"] == "modelopt" and block["quant_algo"] == "W4A16_NVFP4"
    assert block["ignore"] == exclude
    for d in dicts(cfg):
        assert d.get("quant_method") != "compressed-tensors"
    assert "compressed-tensors" not in (dst / "config.json").read_text()
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    assert block == convert_hf_quant_config_format(hf)


def test_modelopt_decodes_like_compressed_tensors_flavour(converted):
    """CT's own ModelOpt->CT converter maps the ModelOpt output onto CT names; decoded (fp32,
    CT's dequantize) it equals the compressed-tensors flavour but where the two tools' scale
    arithmetic rounds a value on a boundary the other way: at most 1 in 1,000 bytes and block
    scales differ, and each module decodes within 2% (norm) of the other flavour (a block
    whose scale rounds to the neighbouring FP8 code moves its 16 values by up to 1/8)."""
    _, dst_mo = converted("k2-int4-kimi", format="modelopt", block_scale="amax")
    _, dst_ct = converted("k2-int4-kimi", format="compressed-tensors", block_scale="amax")
    ct_mods = by_module(checkpoint_tensors(dst_ct))
    targets = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    converter = ModelOptNvfp4Converter(targets=targets)
    mapped = by_module(converter.validate(checkpoint_tensors(dst_mo)))  # raises on orphan scales
    weights = nvfp4a16_scheme()
    experts = expert_modules(ct_mods)
    assert set(expert_modules(mapped).values()) == set(experts.values())
    bytes_differ = scales_differ = n_bytes = n_scales = 0
    for module in experts.values():
        a, b = mapped[module], ct_mods[module]
        bytes_differ += int((a["weight_packed"] != b["weight_packed"]).sum())
        scales_differ += int((u8(a["weight_scale"]) != u8(b["weight_scale"])).sum())
        n_bytes += b["weight_packed"].numel()
        n_scales += b["weight_scale"].numel()
        assert torch.allclose(a["weight_global_scale"].reshape(1), b["weight_global_scale"],
                              rtol=1e-6, atol=0)
        wa = ct_nvfp4_fp32({**a, "weight_global_scale": a["weight_global_scale"].reshape(1)},
                           weights)
        wb = ct_nvfp4_fp32(b, weights)
        assert float((wa - wb).norm() / wb.norm()) <= 0.02, module
    assert bytes_differ <= n_bytes * 1e-3 and scales_differ <= n_scales * 1e-3


# ------------------------------------------------------------------------------ G: K2.5 wrapper


def test_k25_experts_quantized_under_language_model_prefix(converted):
    _, dst = converted("k25-int4")
    mods = by_module(checkpoint_tensors(dst))
    experts = expert_modules(mods)
    assert len(experts) == 2 * 16 * 3
    assert {k[0] for k in experts} == {"language_model.model."}
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config  # where the source had it: text_config only
    qc = QuantizationConfig.model_validate(config["text_config"]["quantization_config"])
    for module in experts.values():
        sd = mods[module]
        assert set(sd) == CT_PARAMS, module
        scheme = ct_scheme_for(module, qc)
        assert scheme is not None, f"{module} is not targeted by the config"
        ref = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
        assert torch.equal(ref, kconvert_nvfp4(sd).to(torch.bfloat16)), module
    # The K2.5 language model is the k2-int4-kimi model (same seed): same NVFP4 bytes.
    _, dst_k2 = converted("k2-int4-kimi")
    k2 = raw_tensors(dst_k2)
    k25 = raw_tensors(dst)
    for (_, layer, expert, proj), module in experts.items():
        for p in CT_PARAMS:
            k2_name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.{p}"
            assert k25[f"{module}.{p}"] == k2[k2_name], k2_name
    assert "language_model.lm_head.weight" in k25
    assert not any(n.startswith("lm_head") or n.startswith("model.") for n in k25)


def test_k25_passthrough_tensors_and_files_are_byte_identical(converted):
    src, dst = converted("k25-int4")
    before, after = raw_tensors(src), raw_tensors(dst)
    passthrough = [n for n in before if not EXPERT_RE.match(n.rpartition(".")[0])]
    vision = [n for n in passthrough if n.startswith(("vision_tower.", "mm_projector."))]
    assert any(n.startswith("vision_tower.") for n in vision)
    assert any(n.startswith("mm_projector.") for n in vision)
    for name in passthrough:
        assert after.get(name) == before[name], name
    generated = {"config.json", "model.safetensors.index.json"}
    files = [p for p in src.rglob("*") if p.is_file() and p.suffix != ".safetensors"
             and p.name not in generated]
    assert {p.name for p in files} >= {"tiktoken.model", "tokenization_kimi.py",
                                       "chat_template.jinja", "preprocessor_config.json",
                                       "modeling_kimi_k25.py", "configuration_kimi_k25.py",
                                       "generation_config.json", "tokenizer_config.json"}
    for p in files:
        rel = p.relative_to(src)
        assert (dst / rel).read_bytes() == p.read_bytes(), rel


def test_k25_config_blocks_replaced_everywhere(fixture_dir, tmp_path):
    """A wrapper whose INT4 block sits at the top level as well as in text_config (Moonshot
    ships it in text_config only): both copies become the NVFP4 block, nothing else changes."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("k25-int4"), src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = config["text_config"]["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "out"
    run_inproc("int4-to-nvfp4", src, dst)
    before = json.loads((src / "config.json").read_text())
    after = json.loads((dst / "config.json").read_text())
    for cfg in (after, after["text_config"]):
        qc = QuantizationConfig.model_validate(cfg["quantization_config"])
        assert qc.format == "nvfp4-pack-quantized"
        for scheme in qc.config_groups.values():
            assert scheme.weights.type == "float" and scheme.weights.group_size == 16
    for d in dicts(after):
        assert d.get("format") != "pack-quantized", "stale INT4 block left in config.json"
        assert d.get("type") != "int"
    # Everything but the two quantization blocks is unchanged.
    for cfg in (before, after):
        cfg.pop("quantization_config")
        cfg["text_config"].pop("quantization_config")
    assert after == before


# ------------------------------------------------------------------------------ J: ModelOpt


def test_nvfp4_matches_modelopt_reference_math(converted):
    """`--format modelopt --block-scale amax` writes ModelOpt's own NVFP4QTensor bytes, block
    scales and weight_scale_2 (amax / 2688 of the fused set, as ModelOpt computes it), exactly,
    for every routed expert."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    src, dst = converted("k2-int4-kimi", format="modelopt", block_scale="amax")
    scheme = int4_scheme(src)
    src_mods, out_mods = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    experts = expert_modules(out_mods)
    by_set: dict[tuple, list[str]] = defaultdict(list)
    for (prefix, layer, expert, proj), module in experts.items():
        by_set[(prefix, layer, expert, proj == "down_proj")].append(module)
    compared = 0
    for modules in by_set.values():
        weights = {m: ct_int4_fp32(src_mods[m], scheme) for m in modules}
        amax = max(w.abs().max() for w in weights.values()).float()  # the fused set's
        for module, w in weights.items():
            out = out_mods[module]
            qt, wsf, wsf2 = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=amax / 2688.0)
            assert torch.equal(wsf2.reshape(()), out["weight_scale_2"].reshape(())), module
            assert torch.equal(u8(wsf), u8(out["weight_scale"])), module
            assert torch.equal(qt._quantized_data, out["weight"]), module
            compared += 1
    assert compared == 2 * 16 * 3

