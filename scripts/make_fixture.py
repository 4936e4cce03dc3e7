"""Generate tiny, deterministic Kimi-K2-family checkpoints for kconvert's tests.

The real checkpoints are 0.6-2 TB, so tests need stand-ins that have the *exact* on-disk
layout of Kimi-K2-Thinking / K2.5 (tensor names, dtypes, shard naming, index, config blocks)
at toy dimensions. Four variants:

* ``k2-int4-kimi``: routed experts INT4 the way Moonshot ships them (QAT codes -7..7,
  scale = amax/7, ``weight_shape`` int32), packed by :func:`pack_int4` (our own code).
* ``k2-int4-ct``: routed experts INT4 produced by compressed-tensors' own compressor
  (codes -8..7, scale = amax/7.5, ``weight_shape`` int64), so a decoder is tested against
  the reference implementation, not only against our own packer.
* ``k25-int4``: the K2.5/K2.6 multimodal wrapper (``language_model.`` prefixes, vision tower and
  projector shards, tokenizer / remote-code files that must pass through untouched).
* ``bf16``: the same model unquantized (plain BF16 experts, no ``quantization_config``); it loads
  with ``transformers.DeepseekV3ForCausalLM`` and is the reference for accuracy checks.

For one seed every variant draws the same BF16 master weights in the same order (quantization
consumes no randomness and vision tensors come last), so ``k2-int4-*`` dequantize to close
approximations of the ``bf16`` fixture and ``k25-int4``'s language model equals ``k2-int4-kimi``.

CLI::

    python scripts/make_fixture.py OUT_DIR --variant k2-int4-kimi [--seed 0] [--hidden 128]
        [--experts 16] [--moe-layers 2] [--moe-intermediate 64] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "GROUP_SIZE",
    "VARIANTS",
    "FixtureDims",
    "ct_int4_scheme",
    "kimi_quantization_config",
    "make_fixture",
    "pack_int4",
    "self_check",
]

VARIANTS = ("k2-int4-ct", "k2-int4-kimi", "k25-int4", "bf16")
GROUP_SIZE = 32  # Kimi's INT4 group along the input dim (formats.md section 1)
PROJS = ("gate_proj", "up_proj", "down_proj")

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class FixtureDims:
    """Toy model dimensions; defaults keep every variant well under 1 MB and < 1 s to build."""

    hidden: int = 128
    intermediate: int = 256  # dense MLP of layer 0
    moe_intermediate: int = 64
    experts: int = 16  # n_routed_experts
    top_k: int = 4  # num_experts_per_tok
    moe_layers: int = 2  # layers 1..moe_layers are MoE; layer 0 dense (first_k_dense_replace=1)
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    heads: int = 4
    vocab: int = 512

    def validate(self) -> None:
        """Reject dims the real format cannot express (INT4 groups of 32 along the input dim)."""
        for name in ("hidden", "moe_intermediate"):
            if getattr(self, name) % GROUP_SIZE:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of {GROUP_SIZE}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..experts={self.experts}")
        if self.moe_layers < 1:
            raise ValueError("moe_layers must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (rotary pairs)")
        if self.vocab < 512:
            raise ValueError("vocab must be >= 512: the byte-level tokenizer holds the 256 "
                             "bytes below Kimi's special tokens, which start at vocab - 256")


# ----------------------------------------------------------------------------- INT4 packing


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed 4-bit codes (-8..7) along the last dim into int32 words, Kimi/CT layout.

    Nibble u = q + 8; element k of a row lands in word k // 8 at bits 4*(k % 8) (low nibble
    first). A ragged tail is padded with nibble 0, like compressed-tensors' ``pack_to_int32``.
    Words are returned as two's-complement int32, which is how safetensors stores them.
    """
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"pack_int4 needs integer codes, got {q.dtype}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("INT4 codes must lie in -8..7")
    u = q.to(torch.int64) + 8
    pad = (-u.shape[-1]) % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))  # nibble 0 == code -8 padding, as CT does
    u = u.reshape(*u.shape[:-1], -1, 8)
    words = (u << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def self_check() -> None:
    """Assert the check vector from formats.md section 1, so a layout slip fails loudly."""
    q = torch.tensor([-8, -7, -1, 0, 1, 2, 3, 7, 5, -3], dtype=torch.int8)
    got = [w & 0xFFFFFFFF for w in pack_int4(q).tolist()]
    assert got == [0xFBA98710, 0x0000005D], [hex(w) for w in got]


def _quant_kimi(w: torch.Tensor) -> Tensors:
    """Kimi-style QAT INT4: codes -7..7, bf16 scale = group amax / 7, int32 weight_shape.

    Codes are rounded against the *stored* (bf16-rounded) scale so codes * scale is exactly the
    weight a decoder reconstructs.
    """
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // GROUP_SIZE, GROUP_SIZE)
    amax = g.abs().amax(-1).clamp_min(1e-8)
    scale = (amax / 7.0).to(torch.bfloat16)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-7, 7).to(torch.int8)
    return {
        "weight_packed": pack_int4(q.reshape(out_f, in_f)),
        "weight_scale": scale,
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int32),
    }


def ct_int4_scheme() -> Any:
    """compressed-tensors' W4A16 preset (group 128 in 0.19) re-grouped to Kimi's 32.

    Exported so tests can hand the same scheme to ``PackedQuantizationCompressor.decompress``.
    """
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    weights = scheme.weights.model_copy(
        update={"group_size": GROUP_SIZE, "strategy": QuantizationStrategy.GROUP}
    )
    return scheme.model_copy(update={"weights": weights})


def _quant_ct(w: torch.Tensor, scheme: Any) -> Tensors:
    """INT4 exactly as compressed-tensors writes it: calculate_qparams (amax/7.5) + compress."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // GROUP_SIZE, GROUP_SIZE)  # min/max in the weight's dtype (bf16)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    res = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme
    )
    # calculate_qparams keeps the bf16 dtype of the min/max it is given, so this cast is a no-op
    # today; it pins Kimi's bf16 scale dtype should a future version upcast to fp32.
    res["weight_scale"] = res["weight_scale"].to(torch.bfloat16)
    assert set(res) == {"weight_packed", "weight_scale", "weight_shape"}, sorted(res)
    return {k: v.contiguous() for k, v in res.items()}


# ----------------------------------------------------------------------------- weights

# Toy vision tower; field names follow transformers' Kimi_K25VisionConfig.
_VISION: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "intermediate_size": 64,
    "merge_kernel_size": [2, 2],
    "model_type": "kimi_k25_vision",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "patch_size": 14,
    "pos_emb_height": 8,
    "pos_emb_time": 4,
    "pos_emb_width": 8,
}


class _Rng:
    """One seeded CPU generator drawn in a fixed order: same args give byte-identical files."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * std).to(torch.bfloat16)

    def linear(self, out_f: int, in_f: int) -> torch.Tensor:
        """std 1/sqrt(fan_in) keeps activations O(1) through the toy forward pass."""
        return self.normal(out_f, in_f, std=1.0 / math.sqrt(in_f))

    def norm(self, n: int) -> torch.Tensor:
        """Ones plus small noise: realistic, and a swapped norm tensor is detectable."""
        return (1.0 + torch.randn(n, generator=self.gen) * 0.02).to(torch.bfloat16)

    def bytes(self, n: int) -> bytes:
        return bytes(torch.randint(0, 256, (n,), generator=self.gen, dtype=torch.uint8).tolist())


def _attention(p: str, d: FixtureDims, rng: _Rng) -> Tensors:
    """Norms and MLA attention of one layer, all BF16 (never quantized in Kimi)."""
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    return {
        f"{p}.input_layernorm.weight": rng.norm(d.hidden),
        f"{p}.post_attention_layernorm.weight": rng.norm(d.hidden),
        f"{p}.self_attn.q_a_proj.weight": rng.linear(d.q_lora_rank, d.hidden),
        f"{p}.self_attn.q_a_layernorm.weight": rng.norm(d.q_lora_rank),
        f"{p}.self_attn.q_b_proj.weight": rng.linear(d.heads * qk, d.q_lora_rank),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": rng.linear(
            d.kv_lora_rank + d.qk_rope_head_dim, d.hidden
        ),
        f"{p}.self_attn.kv_a_layernorm.weight": rng.norm(d.kv_lora_rank),
        f"{p}.self_attn.kv_b_proj.weight": rng.linear(
            d.heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank
        ),
        f"{p}.self_attn.o_proj.weight": rng.linear(d.hidden, d.heads * d.v_head_dim),
    }


def _mlp(p: str, hidden: int, inter: int, rng: _Rng) -> Tensors:
    """A SwiGLU MLP's three BF16 weights (dense layer 0, shared experts)."""
    return {
        f"{p}.gate_proj.weight": rng.linear(inter, hidden),
        f"{p}.up_proj.weight": rng.linear(inter, hidden),
        f"{p}.down_proj.weight": rng.linear(hidden, inter),
    }


def _moe_layer(
    p: str, d: FixtureDims, rng: _Rng, quant: Callable[[torch.Tensor], Tensors] | None
) -> Tensors:
    """Attention + router (BF16 gate, F32 bias) + shared expert + routed experts."""
    t = _attention(p, d, rng)
    t[f"{p}.mlp.gate.weight"] = rng.normal(d.experts, d.hidden, std=1.0 / math.sqrt(d.hidden))
    t[f"{p}.mlp.gate.e_score_correction_bias"] = (
        torch.randn(d.experts, generator=rng.gen, dtype=torch.float32) * 0.01
    )
    t.update(_mlp(f"{p}.mlp.shared_experts", d.hidden, d.moe_intermediate, rng))
    for e in range(d.experts):
        for name, w in _mlp(f"{p}.mlp.experts.{e}", d.hidden, d.moe_intermediate, rng).items():
            if quant is None:
                t[name] = w
            else:
                base = name.removesuffix(".weight")
                t.update({f"{base}.{k}": v for k, v in quant(w).items()})
    return t


def _vision_tensors(d: FixtureDims, rng: _Rng) -> tuple[Tensors, Tensors]:
    """Small K2.5 projector and 2-block vision tower (names as in the real checkpoint)."""
    vh, vi = _VISION["hidden_size"], _VISION["intermediate_size"]
    merged = vh * _VISION["merge_kernel_size"][0] * _VISION["merge_kernel_size"][1]
    proj = {
        "mm_projector.pre_norm.weight": rng.norm(vh),
        "mm_projector.pre_norm.bias": rng.normal(vh, std=0.02),
        "mm_projector.proj.0.weight": rng.linear(merged, merged),
        "mm_projector.proj.0.bias": rng.normal(merged, std=0.02),
        "mm_projector.proj.2.weight": rng.linear(d.hidden, merged),
        "mm_projector.proj.2.bias": rng.normal(d.hidden, std=0.02),
    }
    ps, side = _VISION["patch_size"], _VISION["pos_emb_height"]
    vt = {
        "vision_tower.patch_embed.proj.weight": rng.normal(vh, 3, ps, ps, std=0.02),
        "vision_tower.patch_embed.proj.bias": rng.normal(vh, std=0.02),
        "vision_tower.patch_embed.pos_emb.weight": rng.normal(side, side, vh, std=0.02),
    }
    for b in range(_VISION["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{b}"
        for n in ("norm0", "norm1"):
            vt[f"{p}.{n}.weight"] = rng.norm(vh)
            vt[f"{p}.{n}.bias"] = rng.normal(vh, std=0.02)
        # The real K2.5 files fuse q/k/v as `wqkv` and call the output `wo` (transformers'
        # kimi_k25 conversion_mapping renames exactly these source names).
        for n, (o, i) in {
            "wqkv": (3 * vh, vh),
            "wo": (vh, vh),
            "mlp.fc0": (vi, vh),
            "mlp.fc1": (vh, vi),
        }.items():
            vt[f"{p}.{n}.weight"] = rng.linear(o, i)
            vt[f"{p}.{n}.bias"] = rng.normal(o, std=0.02)
    vt["vision_tower.encoder.final_layernorm.weight"] = rng.norm(vh)
    vt["vision_tower.encoder.final_layernorm.bias"] = rng.normal(vh, std=0.02)
    return proj, vt


# ----------------------------------------------------------------------------- configs


_KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
_K26_IGNORE_EXTRA = ["re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]


def kimi_quantization_config(multimodal: bool = False) -> dict[str, Any]:
    """The literal Kimi ``quantization_config`` (formats.md section 1), a fresh copy per call.

    ``multimodal`` adds K2.6's ignore entries for lm_head / vision tower / projector.
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
        "ignore": _KIMI_IGNORE + (_K26_IGNORE_EXTRA if multimodal else []),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _special_ids(vocab: int) -> tuple[int, int]:
    """bos/eos mirror Kimi (vocab-256, vocab-254 of 163840) but stay inside the toy vocab."""
    bos = max(vocab - 256, 0)
    return bos, min(bos + 2, vocab - 1)


def _k2_config(d: FixtureDims, quantized: bool, multimodal: bool = False) -> dict[str, Any]:
    """Kimi-K2-Thinking's config.json with toy dims (rope/yarn/router fields kept verbatim)."""
    bos, eos = _special_ids(d.vocab)
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
        "num_nextn_predict_layers": 0,
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
        cfg["quantization_config"] = kimi_quantization_config(multimodal)
    if multimodal:
        del cfg["auto_map"]  # K2.5's remote code lives at the top level
    return cfg


def _k25_config(d: FixtureDims) -> dict[str, Any]:
    """K2.5/K2.6 wrapper: text_config = the kimi_k2 config (with its quantization block).

    The quantization block is also repeated at the top level: loaders look there first and
    kimi.md requires a converter to rewrite both copies, so the fixture exercises both.
    """
    bos, eos = _special_ids(d.vocab)
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
        "projection_hidden_size": _VISION["hidden_size"],
        "projection_layer_norm_eps": 1e-05,
        "quantization_config": kimi_quantization_config(multimodal=True),
        "text_config": _k2_config(d, quantized=True, multimodal=True),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.2",
        "vision_config": dict(_VISION),
    }


# ----------------------------------------------------------------------------- side files

_STUB_PY = '''"""Stub written by kconvert's make_fixture.py.

The real checkpoint ships trust_remote_code here:
    {what}
Converters must copy this file through byte for byte, so its content only has to be
recognisable.
"""
'''

# transformers 5 loads config.json through its auto_map (this remote code) before any
# tokenizer, so the config stub must define the class it names.
_CONFIG_PY = '''"""Stand-in written by kconvert's make_fixture.py.

The real checkpoint ships trust_remote_code here:
    {what}
Converters must copy this file through byte for byte. AutoTokenizer loads the config
through it, so it defines that class (on transformers' own {base}).
"""

from transformers import {base} as _Base


class {what}(_Base):
    model_type = "{model_type}"
'''

_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_{{ message['role'] }}|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}\n"
)
# Kimi's special tokens in Kimi's order from bos (vocab - 256); eos is <|im_end|> (bos + 2).
_SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                   "<|im_system|>")


def _tokenizer_json(vocab: int) -> bytes:
    """A byte-level tokenizer that loads offline with AutoTokenizer: ids 0..255 are the bytes
    (any text encodes, nothing is unknown), reserved fillers up to bos, then the special tokens
    the chat template uses, at the ids config.json and generation_config.json give."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()  # GPT-2's byte -> printable character map (ByteLevel's)
    tok = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos, _ = _special_ids(vocab)
    reserved = [f"<|reserved_token_{i}|>" for i in range(bos - 256)]
    tok.add_special_tokens([AddedToken(t, special=True) for t in (*reserved, *_SPECIAL_TOKENS)])
    return (tok.to_str(pretty=True) + "\n").encode()


def _side_files(d: FixtureDims, rng: _Rng, multimodal: bool) -> dict[str, bytes]:
    """Tokenizer, templates and remote-code files that a converter must pass through untouched.

    `tiktoken.model` and `tokenization_kimi.py` stand in for Kimi's own tokenizer (remote code
    no test runs); the tokenizer AutoTokenizer loads is `tokenizer.json`, so the `text` and
    `messages` calibration inputs work on the fixtures, offline.
    """
    bos, eos = _special_ids(d.vocab)
    files: dict[str, bytes] = {
        "tiktoken.model": rng.bytes(1024),
        "tokenization_kimi.py": _STUB_PY.format(what="the tiktoken TikTokenTokenizer").encode(),
        "chat_template.jinja": _CHAT_TEMPLATE.encode(),
        "generation_config.json": _json(
            {"bos_token_id": bos, "do_sample": True, "eos_token_id": eos, "temperature": 1.0}
        ),
        "tokenizer.json": _tokenizer_json(d.vocab),
        "tokenizer_config.json": _json(
            {
                "bos_token": _SPECIAL_TOKENS[0],
                "eos_token": _SPECIAL_TOKENS[eos - bos],
                "model_max_length": 262144,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        ),
    }
    if multimodal:
        files["configuration_kimi_k25.py"] = _CONFIG_PY.format(
            what="KimiK25Config", base="Kimi_K25Config", model_type="kimi_k25").encode()
        files["modeling_kimi_k25.py"] = _STUB_PY.format(
            what="KimiK25ForConditionalGeneration"
        ).encode()
        files["preprocessor_config.json"] = _json(
            {
                "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "merge_kernel_size": [2, 2],
                "patch_size": _VISION["patch_size"],
            }
        )
    else:
        files["configuration_deepseek.py"] = _CONFIG_PY.format(
            what="DeepseekV3Config", base="DeepseekV3Config", model_type="kimi_k2").encode()
        files["modeling_deepseek.py"] = _STUB_PY.format(what="DeepseekV3ForCausalLM").encode()
    return files


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


# ----------------------------------------------------------------------------- assembly


def make_fixture(
    out: Path,
    variant: str,
    dims: FixtureDims = FixtureDims(),
    seed: int = 0,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a tiny checkpoint of ``variant`` into ``out`` (absent or empty) and return it.

    Shard 1 = layer 0, one shard per MoE layer, then embed/norm/lm_head; K2.5 adds a projector
    shard and a vision shard. ``overwrite`` deletes a non-empty ``out`` first.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    dims.validate()
    self_check()
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory")
        if any(out.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{out} is not empty")
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    rng = _Rng(seed)
    quant: Callable[[torch.Tensor], Tensors] | None
    if variant == "bf16":
        quant = None
    elif variant == "k2-int4-ct":
        scheme = ct_int4_scheme()
        quant = lambda w: _quant_ct(w, scheme)  # noqa: E731
    else:
        quant = _quant_kimi
    multimodal = variant == "k25-int4"
    lm = "language_model." if multimodal else ""
    mp = f"{lm}model.layers"

    shards: list[Tensors] = []
    layer0 = _attention(f"{mp}.0", dims, rng)
    layer0.update(_mlp(f"{mp}.0.mlp", dims.hidden, dims.intermediate, rng))
    shards.append(layer0)
    for layer in range(1, dims.moe_layers + 1):
        shards.append(_moe_layer(f"{mp}.{layer}", dims, rng, quant))
    shards.append(
        {
            f"{lm}model.embed_tokens.weight": rng.normal(dims.vocab, dims.hidden, std=1.0),
            f"{lm}model.norm.weight": rng.norm(dims.hidden),
            f"{lm}lm_head.weight": rng.linear(dims.vocab, dims.hidden),
        }
    )
    if multimodal:  # drawn last so the language model matches k2-int4-kimi for the same seed
        proj, vision = _vision_tensors(dims, rng)
        shards += [proj, vision]

    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:06d}.safetensors"
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_bytes(_json(index))

    config = _k25_config(dims) if multimodal else _k2_config(dims, quantized=quant is not None)
    (out / "config.json").write_bytes(_json(config))
    for fname, data in _side_files(dims, rng, multimodal).items():
        (out / fname).write_bytes(data)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI entry point; the flags override only the dims tests most often vary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output directory (must be absent or empty)")
    ap.add_argument("--variant", required=True, choices=VARIANTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--moe-layers", type=int)
    ap.add_argument("--moe-intermediate", type=int)
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    a = ap.parse_args(argv)
    over = {
        "hidden": a.hidden,
        "experts": a.experts,
        "moe_layers": a.moe_layers,
        "moe_intermediate": a.moe_intermediate,
    }
    dims = replace(FixtureDims(), **{k: v for k, v in over.items() if v is not None})
    dims = replace(dims, top_k=min(dims.top_k, dims.experts))  # --experts 2 stays valid
    try:
        path = make_fixture(a.out, a.variant, dims, a.seed, overwrite=a.overwrite)
    except (ValueError, FileExistsError) as e:
        ap.error(str(e))
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"{path}: {a.variant}, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
