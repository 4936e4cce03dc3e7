"""The compressed-tensors NVFP4 output checked against compressed-tensors' own code
(formats.md, kimi.md).

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criteria covered: B (compressed-tensors output decompresses like kconvert's decode,
config validates), C (--block-scale amax bit parity).
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
)
from compressed_tensors.quantization.utils import generate_gparam

from helpers import checkpoint_tensors
from oracles import (
    CT_PARAMS,
    by_module,
    ct_int4_fp32,
    ct_reference_compress,
    ct_scheme_for,
    expert_modules,
    int4_scheme,
    kconvert_nvfp4,
    nvfp4a16_scheme,
    u8,
)

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
