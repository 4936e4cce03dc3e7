"""The tensors of the tiny fixtures: toy dimensions, BF16 master weights drawn in a fixed
order, and Kimi's and compressed-tensors' INT4 quantization of the routed experts (see
kconvert.testing.fixtures)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
    # DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers), stored after the
    # decoder layers: layers moe_layers + 1 .. moe_layers + mtp_layers.
    mtp_layers: int = 0
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
        if self.mtp_layers < 0:
            raise ValueError("mtp_layers must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (rotary pairs)")
        if self.vocab < 512:
            raise ValueError("vocab must be >= 512: the byte-level tokenizer holds the 256 "
                             "bytes below Kimi's special tokens, which start at vocab - 256")


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


def quant_kimi(w: torch.Tensor) -> Tensors:
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


def quant_ct(w: torch.Tensor, scheme: Any) -> Tensors:
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


# Toy vision tower; field names follow transformers' Kimi_K25VisionConfig.
VISION: dict[str, Any] = {
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


class Rng:
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


def attention_tensors(p: str, d: FixtureDims, rng: Rng) -> Tensors:
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


def mlp_tensors(p: str, hidden: int, inter: int, rng: Rng) -> Tensors:
    """A SwiGLU MLP's three BF16 weights (dense layer 0, shared experts)."""
    return {
        f"{p}.gate_proj.weight": rng.linear(inter, hidden),
        f"{p}.up_proj.weight": rng.linear(inter, hidden),
        f"{p}.down_proj.weight": rng.linear(hidden, inter),
    }


def moe_layer_tensors(
    p: str, d: FixtureDims, rng: Rng, quant: Callable[[torch.Tensor], Tensors] | None
) -> Tensors:
    """Attention + router (BF16 gate, F32 bias) + shared expert + routed experts."""
    t = attention_tensors(p, d, rng)
    t[f"{p}.mlp.gate.weight"] = rng.normal(d.experts, d.hidden, std=1.0 / math.sqrt(d.hidden))
    t[f"{p}.mlp.gate.e_score_correction_bias"] = (
        torch.randn(d.experts, generator=rng.gen, dtype=torch.float32) * 0.01
    )
    t.update(mlp_tensors(f"{p}.mlp.shared_experts", d.hidden, d.moe_intermediate, rng))
    for e in range(d.experts):
        expert = mlp_tensors(f"{p}.mlp.experts.{e}", d.hidden, d.moe_intermediate, rng)
        for name, w in expert.items():
            if quant is None:
                t[name] = w
            else:
                base = name.removesuffix(".weight")
                t.update({f"{base}.{k}": v for k, v in quant(w).items()})
    return t


def mtp_layer_tensors(
    p: str, d: FixtureDims, rng: Rng, quant: Callable[[torch.Tensor], Tensors] | None
) -> Tensors:
    """One multi-token-prediction layer as DeepSeek-V3 stores it (`model.layers.61.*`): a full
    MoE decoder layer plus its own embedding copy, enorm/hnorm (RMSNorms of the embedding and of
    the previous hidden state), eh_proj ([hidden, 2 x hidden], the projection of the two
    concatenated) and shared_head (norm and head, the layer's own output head); all BF16."""
    t = moe_layer_tensors(p, d, rng, quant)
    t[f"{p}.embed_tokens.weight"] = rng.normal(d.vocab, d.hidden, std=1.0)
    t[f"{p}.enorm.weight"] = rng.norm(d.hidden)
    t[f"{p}.hnorm.weight"] = rng.norm(d.hidden)
    t[f"{p}.eh_proj.weight"] = rng.linear(d.hidden, 2 * d.hidden)
    t[f"{p}.shared_head.norm.weight"] = rng.norm(d.hidden)
    t[f"{p}.shared_head.head.weight"] = rng.linear(d.vocab, d.hidden)
    return t


def vision_tensors(d: FixtureDims, rng: Rng) -> tuple[Tensors, Tensors]:
    """Small K2.5 projector and 2-block vision tower (names as in the real checkpoint)."""
    vh, vi = VISION["hidden_size"], VISION["intermediate_size"]
    merged = vh * VISION["merge_kernel_size"][0] * VISION["merge_kernel_size"][1]
    proj = {
        "mm_projector.pre_norm.weight": rng.norm(vh),
        "mm_projector.pre_norm.bias": rng.normal(vh, std=0.02),
        "mm_projector.proj.0.weight": rng.linear(merged, merged),
        "mm_projector.proj.0.bias": rng.normal(merged, std=0.02),
        "mm_projector.proj.2.weight": rng.linear(d.hidden, merged),
        "mm_projector.proj.2.bias": rng.normal(d.hidden, std=0.02),
    }
    ps, side = VISION["patch_size"], VISION["pos_emb_height"]
    vt = {
        "vision_tower.patch_embed.proj.weight": rng.normal(vh, 3, ps, ps, std=0.02),
        "vision_tower.patch_embed.proj.bias": rng.normal(vh, std=0.02),
        "vision_tower.patch_embed.pos_emb.weight": rng.normal(side, side, vh, std=0.02),
    }
    for b in range(VISION["num_hidden_layers"]):
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
