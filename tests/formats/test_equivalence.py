"""Model equivalence (acceptance criterion H): run the converted checkpoints as models.

Every quantized checkpoint is turned into a dense BF16 one with compressed-tensors' own
decompressors (NVFP4PackedCompressor / PackedQuantizationCompressor, looked up from the
checkpoint's quantization_config the way compressed-tensors does), then loaded with
transformers' DeepseekV3ForCausalLM. Logits are compared in fp32.

Tolerance. The tiny fixture is a random-weight model, so logits react strongly to any weight
perturbation (router top-k flips, attention): a correct NVFP4 re-encoding of the experts moves
the logits by 10-15% relative L2. A fixed number would be arbitrary; the yardstick used instead is
measured on the same tokens from the fixture alone: the logit error that the source's INT4
quantization itself causes against its BF16 master weights (Kimi-style INT4, group 32,
bf16 scales: 4.5 bits/weight). NVFP4 spends the same 4.5 bits/weight (4-bit E2M1 + an FP8 scale
per 16) and, on an INT4 grid, reaches a smaller weight error (rel. MSE ~0.006 vs INT4's ~0.009),
so a correct conversion must not move the logits further from the INT4 model than INT4 moved
them from BF16:  rel_L2(NVFP4, INT4) <= rel_L2(INT4, BF16)  (and top-1 agreement no worse by
more than 5 points, ~1.5 sigma of a 128-token agreement rate). A deliberately corrupted output
(gate/up global scale of one expert doubled in every MoE layer) must break that bound, which
shows the bound can fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.utils import generate_gparam
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.utils import logging as hf_logging

from helpers import checkpoint_tensors
from oracles import (
    PROJS,
    by_module,
    ct_int4_fp32,
    ct_reference_compress,
    ct_scheme_for,
    dicts,
    expert_modules,
    int4_scheme,
    kconvert_nvfp4,
    make_converter,
    raw_tensors,
    u8,
)

hf_logging.set_verbosity_error()

N_SEQ, SEQ_LEN = 4, 32
TOP1_SLACK = 0.05


# ------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def converted(fixture_dir, tmp_path_factory):
    return make_converter(fixture_dir, tmp_path_factory)


def densify(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None
            ) -> dict[str, torch.Tensor]:
    """A dense BF16 checkpoint of `src` made with compressed-tensors' decompressors."""
    cfg = json.loads((src / "config.json").read_text())
    block = cfg.pop("quantization_config", None)
    qc = QuantizationConfig.model_validate(block) if block else None
    dense = {}
    tensors = tensors if tensors is not None else checkpoint_tensors(src)
    for module, sd in by_module(tensors).items():
        if "weight_packed" not in sd:
            dense.update({f"{module}.{p}": t for p, t in sd.items()})
            continue
        scheme = ct_scheme_for(module, qc)
        assert scheme is not None, f"{module} is packed but not targeted by quantization_config"
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qc.format)
        w = compressor.decompress(dict(sd), scheme)["weight"]
        assert w.dtype == torch.bfloat16
        dense[f"{module}.weight"] = w
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dense


def load_model(d: Path, written: dict[str, torch.Tensor]) -> DeepseekV3ForCausalLM:
    """transformers' DeepSeek-V3, checked to hold exactly the tensors written to `d`.

    transformers 5.x fuses per-expert tensors into its 3-D expert parameters only for
    model_type "deepseek_v3" (for "kimi_k2" it leaves them random), hence the override and
    the check that every written tensor, experts included, is what the model holds.
    """
    cfg = DeepseekV3Config.from_pretrained(d)
    cfg.model_type = "deepseek_v3"
    model, info = DeepseekV3ForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    state = model.state_dict()
    experts = expert_modules(by_module(written))
    fused = {f"{p}layers.{layer}" for p, layer, _, _ in experts}
    assert len(fused) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    for (_, layer, e, proj), module in experts.items():
        ex = model.model.layers[layer].mlp.experts
        w = written[f"{module}.weight"].float()
        n = cfg.moe_intermediate_size
        held = {"gate_proj": ex.gate_up_proj[e, :n], "up_proj": ex.gate_up_proj[e, n:],
                "down_proj": ex.down_proj[e]}[proj]
        assert torch.equal(held, w), f"{module} was not loaded into the model"
    expert_names = {f"{m}.weight" for m in experts.values()}
    for name, t in written.items():
        if name not in expert_names:
            assert torch.equal(state[name], t.float()), name
    return model.eval()


def logits(model: DeepseekV3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def top1(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.argmax(-1) == ref.argmax(-1)).float().mean())


@pytest.fixture(scope="module")
def token_ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    vocab = 512  # FixtureDims().vocab
    return torch.randint(0, vocab, (N_SEQ, SEQ_LEN), generator=gen)


@pytest.fixture(scope="module")
def reference(fixture_dir, tmp_path_factory, token_ids):
    """Logits of the BF16 master and of the INT4 source (decompressed by compressed-tensors),
    and the yardstick error between them."""
    bf16, int4 = fixture_dir("bf16"), fixture_dir("k2-int4-kimi")
    # Precondition: same master weights, so the INT4 fixture quantizes exactly the BF16 one.
    raw_bf16, raw_int4 = raw_tensors(bf16), raw_tensors(int4)
    experts = set(expert_modules(by_module(raw_int4)).values())
    dense = [n for n in raw_int4 if n.rpartition(".")[0] not in experts]
    assert experts and set(raw_bf16) == {*dense, *(f"{m}.weight" for m in experts)}
    assert all(raw_int4[n] == raw_bf16[n] for n in dense)
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for name, src in (("bf16", bf16), ("int4", int4)):
        written = densify(src, root / name)
        out[name] = logits(load_model(root / name, written), token_ids)
    out["tol_rel_l2"] = rel_l2(out["int4"], out["bf16"])
    out["tol_top1"] = top1(out["int4"], out["bf16"]) - TOP1_SLACK
    assert 0 < out["tol_rel_l2"] < 0.5  # a sane yardstick: INT4 changes, but keeps, the model
    return out


def model_logits(src: Path, root: Path, ids: torch.Tensor,
                 tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    written = densify(src, root, tensors)
    return logits(load_model(root, written), ids)


# ------------------------------------------------------------------------------ H: NVFP4 model


def test_nvfp4_model_matches_int4_source(converted, reference, token_ids, tmp_path):
    _, dst = converted("k2-int4-kimi")
    got = model_logits(dst, tmp_path / "nvfp4", token_ids)
    err, agree = rel_l2(got, reference["int4"]), top1(got, reference["int4"])
    assert err <= reference["tol_rel_l2"], (err, reference["tol_rel_l2"])
    assert agree >= reference["tol_top1"], (agree, reference["tol_top1"])


def test_corrupted_global_scale_breaks_the_tolerance(converted, reference, token_ids, tmp_path):
    """The same check on an output whose expert 0 has its gate/up global scale doubled."""
    _, dst = converted("k2-int4-kimi")
    tensors = checkpoint_tensors(dst)
    doubled = 0
    for (_, _, expert, proj), module in expert_modules(by_module(tensors)).items():
        if expert == 0 and proj in ("gate_proj", "up_proj"):
            tensors[f"{module}.weight_global_scale"] = tensors[f"{module}.weight_global_scale"] * 2
            doubled += 1
    assert doubled == 2 * 2
    got = model_logits(dst, tmp_path / "corrupt", token_ids, tensors)
    assert rel_l2(got, reference["int4"]) > reference["tol_rel_l2"]


# ------------------------------------------------------------------------------ H: dequant


def test_dequant_is_int4_decode_rounded_to_bf16(converted, reference, token_ids, tmp_path):
    src, dst = converted("k2-int4-kimi", "dequant")
    cfg = json.loads((dst / "config.json").read_text())
    assert not any("quantization_config" in d for d in dicts(cfg))
    assert not (dst / "hf_quant_config.json").exists()
    scheme = int4_scheme(src)
    src_mods, out = by_module(checkpoint_tensors(src)), checkpoint_tensors(dst)
    experts = expert_modules(src_mods)
    assert len(experts) == 2 * 16 * 3
    for module in experts.values():
        w = out[f"{module}.weight"]
        assert w.dtype == torch.bfloat16
        assert set(by_module(out)[module]) == {"weight"}
        assert torch.equal(w, ct_int4_fp32(src_mods[module], scheme).to(torch.bfloat16)), module
    raw_src, raw_out = raw_tensors(src), raw_tensors(dst)
    for name, entry in raw_src.items():
        if name.rpartition(".")[0] not in set(experts.values()):
            assert raw_out[name] == entry, name
    assert len(raw_out) == len(raw_src) - 2 * len(experts)  # packed/scale/shape -> weight
    # Loaded as a model, the dequantized checkpoint IS the INT4 source model.
    got = model_logits(dst, tmp_path / "dequant", token_ids)
    assert torch.equal(got, reference["int4"])


# ------------------------------------------------------------------------------ H: quantize


def test_quantize_bf16_decompresses_correctly(converted, reference, token_ids, tmp_path):
    src, dst = converted("bf16", "quantize")
    cfg = json.loads((dst / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    src_mods, out_mods = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    experts = expert_modules(out_mods)
    assert len(experts) == 2 * 16 * 3
    for module in experts.values():
        sd = out_mods[module]
        ref = BaseCompressor.get_value_from_registry(qc.format).decompress(
            dict(sd), ct_scheme_for(module, qc))["weight"]
        assert torch.equal(ref, kconvert_nvfp4(sd).to(torch.bfloat16)), module
        w = src_mods[module]["weight"].float()
        rel = float(((ref.float() - w) ** 2).sum() / (w**2).sum())
        assert rel < 0.02, (module, rel)  # NVFP4 on Gaussian weights: ~0.007-0.01
    # As a model: no further from the BF16 master than the INT4 source is.
    got = model_logits(dst, tmp_path / "nvfp4-from-bf16", token_ids)
    assert rel_l2(got, reference["bf16"]) <= reference["tol_rel_l2"]
    assert top1(got, reference["bf16"]) >= reference["tol_top1"]


def test_quantize_bf16_amax_is_compressed_tensors_bytes(converted):
    """`quantize --block-scale amax` on BF16 experts writes what compressed-tensors' compressor
    writes for the same BF16 weight (as llm-compressor holds it) under the output's global
    scale. The global scale itself is 2688 / amax of the fused set (generate_gparam on the
    exact values; compressed-tensors' extra bf16 rounding of it is a documented quirk that
    kconvert does not copy, formats.md §2)."""
    src, dst = converted("bf16", "quantize", block_scale="amax")
    src_mods, out_mods = by_module(checkpoint_tensors(src)), by_module(checkpoint_tensors(dst))
    experts = expert_modules(out_mods)
    assert len(experts) == 2 * 16 * 3
    bad_scales = bad_bytes = 0
    first_bad = None
    for (prefix, layer, expert, proj), module in experts.items():
        w = src_mods[module]["weight"]
        assert w.dtype == torch.bfloat16
        members = [src_mods[experts[(prefix, layer, expert, p)]]["weight"].float()
                   for p in (PROJS[:2] if proj != "down_proj" else PROJS[2:])]
        fused = torch.cat(members)
        out = out_mods[module]
        assert torch.equal(out["weight_global_scale"], generate_gparam(fused.min(), fused.max()))
        ref = ct_reference_compress(w, out["weight_global_scale"])
        n_scales = int((u8(out["weight_scale"]) != u8(ref["weight_scale"])).sum())
        n_bytes = int((out["weight_packed"] != ref["weight_packed"]).sum())
        bad_scales, bad_bytes = bad_scales + n_scales, bad_bytes + n_bytes
        if (n_scales or n_bytes) and first_bad is None:
            first_bad = module
    assert (bad_scales, bad_bytes) == (0, 0), (
        f"{bad_scales} block scales and {bad_bytes} packed bytes differ from compressed-tensors' "
        f"(first: {first_bad})")
