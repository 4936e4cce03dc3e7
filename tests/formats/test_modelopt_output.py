"""The ModelOpt NVFP4 output: tensor layout and configs (formats.md §3b), decoded against the
compressed-tensors flavour, and byte for byte ModelOpt's own NVFP4 math.

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criteria covered: F (ModelOpt flavour), J (ModelOpt's own NVFP4 math).
"""

from __future__ import annotations

import fnmatch
import json
from collections import defaultdict

import torch
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
    ModelOptNvfp4Converter,
)

from helpers import checkpoint_tensors
from oracles import (
    MODELOPT_PARAMS,
    by_module,
    ct_int4_fp32,
    ct_nvfp4_fp32,
    dicts,
    expert_modules,
    int4_scheme,
    nvfp4a16_scheme,
    raw_tensors,
    u8,
)

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
