"""The config.json of the tiny fixtures (kconvert.testing.fixtures): Kimi-K2-Thinking's at toy
dimensions, the K2.5/K2.6 multimodal wrapper around it, and the literal Kimi
``quantization_config`` they carry."""

from __future__ import annotations

from typing import Any

from kconvert.testing.fixture_weights import GROUP_SIZE, VISION, FixtureDims

_KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]


_K26_IGNORE_EXTRA = ["re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]


def kimi_quantization_config(k26: bool = False) -> dict[str, Any]:
    """The literal Kimi ``quantization_config`` (formats.md section 1), a fresh copy per call:
    K2-Thinking's, which K2.5 ships verbatim in its ``text_config``; ``k26`` adds K2.6's ignore
    entries for lm_head / vision tower / projector.
    """
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": _KIMI_IGNORE + (_K26_IGNORE_EXTRA if k26 else []),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def special_ids(vocab: int) -> tuple[int, int]:
    """bos/eos mirror Kimi (vocab-256, vocab-254 of 163840) but stay inside the toy vocab."""
    bos = max(vocab - 256, 0)
    return bos, min(bos + 2, vocab - 1)


def k2_config(d: FixtureDims, quantized: bool, multimodal: bool = False,
              k26: bool = False) -> dict[str, Any]:
    """Kimi-K2-Thinking's config.json with toy dims (rope/yarn/router fields kept verbatim)."""
    bos, eos = special_ids(d.vocab)
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "kv_lora_rank": d.kv_lora_rank,
        "max_position_embeddings": 262144,
        "model_type": "kimi_k2",
        "moe_intermediate_size": d.moe_intermediate,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": d.experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": d.heads,
        "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.moe_layers + 1,
        "num_key_value_heads": d.heads,
        "num_nextn_predict_layers": d.mtp_layers,
        "pretraining_tp": 1,
        "q_lora_rank": d.q_lora_rank,
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "rms_norm_eps": 1e-06,
        # K2-Thinking: factor 64 over 4096 = 262144 positions (K2-Instruct had 32 / 131072).
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.2",
        "use_cache": True,
        "v_head_dim": d.v_head_dim,
        "vocab_size": d.vocab,
    }
    if quantized:
        cfg["quantization_config"] = kimi_quantization_config(k26)
    if multimodal:
        del cfg["auto_map"]  # K2.5's remote code lives at the top level
    return cfg


def k25_config(d: FixtureDims, k26: bool) -> dict[str, Any]:
    """K2.5/K2.6 wrapper: text_config = the kimi_k2 config with its quantization block, which
    Moonshot ships only there (K2.6's with its extra ignore entries)."""
    bos, eos = special_ids(d.vocab)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "bos_token_id": bos,
        "eos_token_id": eos,
        "ignore_index": -100,
        "media_placeholder_token_id": max(d.vocab - 235, 0),
        "model_type": "kimi_k25",
        "pad_token_id": eos,
        "projection_hidden_size": VISION["hidden_size"],
        "projection_layer_norm_eps": 1e-05,
        "text_config": k2_config(d, quantized=True, multimodal=True, k26=k26),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.2",
        "vision_config": dict(VISION),
    }
