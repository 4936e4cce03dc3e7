"""A tiny Kimi-K3-shaped checkpoint (variant ``k3-mxfp4`` of kconvert.testing.fixtures).

Tensor names, dtypes and the layout of the real release at toy dimensions (docs/kimi.md,
"Kimi-K3"): the language model under ``language_model.``, layer 0 a dense MLP, layers 1.. a
latent MoE (``block_sparse_moe``: router with e_score_correction_bias, routed_expert_down_proj
-> experts ``w1|w2|w3`` on the latent -> routed_expert_norm -> routed_expert_up_proj, two
shared experts stored fused), AttnRes tensors in every layer and at the top, KDA attention in
the layers ``linear_attn_config.kda_layers`` lists (1-based) and MLA with an output gate in
the others, a vision tower and projector. The routed experts are MXFP4 as K3 ships them:
compressed-tensors' own MXFP4 compressor (``mxfp4-pack-quantized``, group 32, uint8 E8M0) on
BF16 master weights, and the quantization_config sits in ``text_config`` only, with K3's
incomplete ignore list (the latent and ``*_res_proj`` linears are BF16 but not listed).
"""

from __future__ import annotations

from typing import Any

import torch

from kconvert.testing.fixture_weights import (
    GROUP_SIZE,
    VISION,
    FixtureDims,
    Rng,
    Tensors,
    attention_tensors,
    mlp_tensors,
    vision_tensors,
)

LATENT = 64  # routed_expert_hidden_size of the toy model (K3: 3584)
SHARED = 2  # num_shared_experts, stored as one MLP of SHARED x moe_intermediate
KDA_HEAD_DIM = 16  # linear_attn_config.head_dim (K3: 128)
CONV = 4  # short_conv_kernel_size
K3_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*",
             "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
             "re:.*vision_tower.*", "re:.*mm_projector.*"]


def mxfp4_scheme() -> Any:
    """compressed-tensors' MXFP4A16 preset: 4-bit float, group 32, uint8 E8M0 scales."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("MXFP4A16", ["Linear"])


def quant_mxfp4(w: torch.Tensor) -> Tensors:
    """MXFP4 exactly as compressed-tensors writes it: its observer's scales (calculate_qparams
    on each 32-group's min and max) and its MXFP4 compressor."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = mxfp4_scheme()
    groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert set(out) == {"weight_packed", "weight_scale"}, sorted(out)
    return {k: v.contiguous() for k, v in out.items()}


def quantization_config() -> dict[str, Any]:
    """K3's text_config.quantization_config: compressed-tensors MXFP4 W4A16, its ignore list."""
    weights = mxfp4_scheme().weights.model_dump(mode="json")
    return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "mxfp4-pack-quantized", "ignore": list(K3_IGNORE),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}


def layer_lists(layers: int) -> tuple[list[int], list[int]]:
    """(kda_layers, full_attn_layers), 1-based as K3's config lists them: every 4th layer and
    the last are MLA, the rest KDA."""
    full = [i for i in range(1, layers + 1) if i % 4 == 0 or i == layers]
    return [i for i in range(1, layers + 1) if i not in full], full


def text_config(d: FixtureDims) -> dict[str, Any]:
    layers = d.moe_layers + 1
    kda, full = layer_lists(layers)
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "hidden_size": d.hidden, "vocab_size": d.vocab, "num_hidden_layers": layers,
        "intermediate_size": d.intermediate, "moe_intermediate_size": d.moe_intermediate,
        "num_experts": d.experts, "num_experts_per_token": d.top_k,
        "num_shared_experts": SHARED, "routed_expert_hidden_size": LATENT,
        "latent_moe_use_norm": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12,
        "num_attention_heads": d.heads, "q_lora_rank": d.q_lora_rank,
        "kv_lora_rank": d.kv_lora_rank, "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim, "v_head_dim": d.v_head_dim,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full,
                               "num_heads": d.heads, "head_dim": KDA_HEAD_DIM,
                               "short_conv_kernel_size": CONV, "use_full_rank_gate": True,
                               "gate_lower_bound": -5.0},
        "rms_norm_eps": 1e-05, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
        "quantization_config": quantization_config(),
    }


def config(d: FixtureDims, bos: int, eos: int) -> dict[str, Any]:
    """The wrapper config.json: text_config (with its quantization_config) and vision_config."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos,
        "text_config": text_config(d), "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vision_config": {**VISION, "model_type": "kimi_k3_vision"},
    }


def _common(p: str, h: int, rng: Rng) -> Tensors:
    """The norms and AttnRes tensors every layer has."""
    return {f"{p}.input_layernorm.weight": rng.norm(h),
            f"{p}.post_attention_layernorm.weight": rng.norm(h),
            f"{p}.self_attention_res_norm.weight": rng.norm(h),
            f"{p}.self_attention_res_proj.weight": rng.linear(1, h),
            f"{p}.mlp_res_norm.weight": rng.norm(h),
            f"{p}.mlp_res_proj.weight": rng.linear(1, h)}


def kda_tensors(p: str, d: FixtureDims, rng: Rng) -> Tensors:
    """KDA attention: q/k/v/g/o projections, the forget gate's low-rank pair, beta, short
    convolutions, A_log and dt_bias (no parameter suffix), the gated output norm (F32)."""
    a = f"{p}.self_attn"
    width = d.heads * KDA_HEAD_DIM
    t = {f"{a}.{n}_proj.weight": rng.linear(width, d.hidden) for n in ("q", "k", "v", "g")}
    t[f"{a}.o_proj.weight"] = rng.linear(d.hidden, width)
    t[f"{a}.f_a_proj.weight"] = rng.linear(KDA_HEAD_DIM, d.hidden)
    t[f"{a}.f_b_proj.weight"] = rng.linear(width, KDA_HEAD_DIM)
    t[f"{a}.b_proj.weight"] = rng.linear(d.heads, d.hidden)
    for n in ("q", "k", "v"):
        t[f"{a}.{n}_conv1d.weight"] = rng.normal(width, 1, CONV, std=0.5).float()
    t[f"{a}.A_log"] = rng.normal(KDA_HEAD_DIM, std=1.0).float()
    t[f"{a}.dt_bias"] = rng.normal(width, std=1.0).float()
    t[f"{a}.o_norm.weight"] = rng.norm(KDA_HEAD_DIM).float()
    return t


def mla_tensors(p: str, d: FixtureDims, rng: Rng) -> Tensors:
    """K3's MLA: DeepSeek-V3's, plus the output gate g_proj (mla_use_output_gate)."""
    t = {k: v for k, v in attention_tensors(p, d, rng).items() if ".self_attn." in k}
    t[f"{p}.self_attn.g_proj.weight"] = rng.linear(d.heads * d.v_head_dim, d.hidden)
    return t


def moe_tensors(p: str, d: FixtureDims, rng: Rng) -> Tensors:
    """The latent MoE block: router, latent projections and norm, fused shared experts, and
    the routed experts in MXFP4 (w1 gate, w3 up on the latent, w2 down back to it)."""
    m = f"{p}.block_sparse_moe"
    t = {f"{m}.gate.weight": rng.linear(d.experts, d.hidden),
         f"{m}.gate.e_score_correction_bias":
             torch.randn(d.experts, generator=rng.gen, dtype=torch.float32) * 0.01,
         f"{m}.routed_expert_down_proj.weight": rng.linear(LATENT, d.hidden),
         f"{m}.routed_expert_norm.weight": rng.norm(LATENT),
         f"{m}.routed_expert_up_proj.weight": rng.linear(d.hidden, LATENT)}
    t.update(mlp_tensors(f"{m}.shared_experts", d.hidden, SHARED * d.moe_intermediate, rng))
    for e in range(d.experts):
        for proj, (rows, cols) in (("w1", (d.moe_intermediate, LATENT)),
                                   ("w3", (d.moe_intermediate, LATENT)),
                                   ("w2", (LATENT, d.moe_intermediate))):
            packed = quant_mxfp4(rng.linear(rows, cols))
            t.update({f"{m}.experts.{e}.{proj}.{k}": v for k, v in packed.items()})
    return t


def shards(d: FixtureDims, rng: Rng) -> list[Tensors]:
    """Layer 0 (dense), one shard per MoE layer, the top-level tensors, projector + vision."""
    layers = d.moe_layers + 1
    kda = {i - 1 for i in layer_lists(layers)[0]}
    out = []
    for layer in range(layers):
        p = f"language_model.model.layers.{layer}"
        t = _common(p, d.hidden, rng)
        t.update(kda_tensors(p, d, rng) if layer in kda else mla_tensors(p, d, rng))
        if layer == 0:
            t.update(mlp_tensors(f"{p}.mlp", d.hidden, d.intermediate, rng))
        else:
            t.update(moe_tensors(p, d, rng))
        out.append(t)
    out.append({"language_model.model.embed_tokens.weight": rng.normal(d.vocab, d.hidden,
                                                                       std=1.0),
                "language_model.model.norm.weight": rng.norm(d.hidden),
                "language_model.model.output_attn_res_norm.weight": rng.norm(d.hidden),
                "language_model.model.output_attn_res_proj.weight": rng.linear(1, d.hidden),
                "language_model.lm_head.weight": rng.linear(d.vocab, d.hidden)})
    _, tower = vision_tensors(d, rng)
    merged = VISION["hidden_size"] * 4
    out.append({"mm_projector.proj.0.weight": rng.linear(merged, merged),
                "mm_projector.proj.2.weight": rng.linear(d.hidden, merged),
                "mm_projector.post_norm.weight": rng.norm(d.hidden), **tower})
    return out
