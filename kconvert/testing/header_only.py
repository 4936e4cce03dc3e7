"""Header-only Kimi-K2-Thinking checkpoints: every shard's safetensors header is real (names,
dtypes, shapes, offsets as docs/kimi.md lists them), its data region a hole (a sparse file
made with truncate), so the full-size 594 GB layout costs a few MB of disk. Only readers of
headers (`kconvert inspect`, `--dry-run`) may be pointed at one: the tensors read as zeros.
A conversion's plan reads the INT4 `weight_shape` values ([out, in] int32), which
`write_header_only(..., shape_values=True)` writes (a disk block each: 330 MB at full size).

The layout is the tiny fixtures' (kconvert.testing.fixtures, variant k2-int4-kimi) at any
dims; a test holds the two equal at the fixtures' dims.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from kconvert.io.shards import plan_header
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.fixture_weights import GROUP_SIZE, PROJS, FixtureDims
from kconvert.testing.fixtures import json_bytes

# Kimi-K2-Thinking's dimensions (docs/kimi.md, Architecture).
KIMI_K2_THINKING = FixtureDims(hidden=7168, intermediate=18432, moe_intermediate=2048,
                               experts=384, top_k=8, moe_layers=60, q_lora_rank=1536,
                               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                               v_head_dim=128, heads=64, vocab=163840)

Spec = tuple[str, str, tuple[int, ...]]


def _linear(name: str, out: int, inp: int) -> list[Spec]:
    return [(f"{name}.weight", "BF16", (out, inp))]


def _int4_linear(name: str, out: int, inp: int) -> list[Spec]:
    return [(f"{name}.weight_packed", "I32", (out, inp // 8)),
            (f"{name}.weight_scale", "BF16", (out, inp // GROUP_SIZE)),
            (f"{name}.weight_shape", "I32", (2,))]


def _mlp(prefix: str, hidden: int, inter: int, linear=_linear) -> list[Spec]:
    return [s for proj in PROJS for s in linear(
        f"{prefix}.{proj}", *((hidden, inter) if proj == "down_proj" else (inter, hidden)))]


def _layer(prefix: str, d: FixtureDims) -> list[Spec]:
    h, a = d.hidden, f"{prefix}.self_attn"
    return [
        (f"{prefix}.input_layernorm.weight", "BF16", (h,)),
        (f"{prefix}.post_attention_layernorm.weight", "BF16", (h,)),
        *_linear(f"{a}.q_a_proj", d.q_lora_rank, h),
        (f"{a}.q_a_layernorm.weight", "BF16", (d.q_lora_rank,)),
        *_linear(f"{a}.q_b_proj", d.heads * (d.qk_nope_head_dim + d.qk_rope_head_dim),
                 d.q_lora_rank),
        *_linear(f"{a}.kv_a_proj_with_mqa", d.kv_lora_rank + d.qk_rope_head_dim, h),
        (f"{a}.kv_a_layernorm.weight", "BF16", (d.kv_lora_rank,)),
        *_linear(f"{a}.kv_b_proj", d.heads * (d.qk_nope_head_dim + d.v_head_dim),
                 d.kv_lora_rank),
        *_linear(f"{a}.o_proj", h, d.heads * d.v_head_dim),
    ]


def kimi_int4_shards(d: FixtureDims) -> list[list[Spec]]:
    """The tensors of each shard of Kimi-K2-Thinking at dims `d`: layer 0 (dense MLP), one
    shard per MoE layer (INT4 routed experts, BF16 rest, F32 router bias), then embeddings,
    final norm and lm_head."""
    shards = [_layer("model.layers.0", d) + _mlp("model.layers.0.mlp", d.hidden,
                                                 d.intermediate)]
    for layer in range(1, d.moe_layers + 1):
        p = f"model.layers.{layer}"
        specs = _layer(p, d)
        specs += [(f"{p}.mlp.gate.weight", "BF16", (d.experts, d.hidden)),
                  (f"{p}.mlp.gate.e_score_correction_bias", "F32", (d.experts,))]
        specs += _mlp(f"{p}.mlp.shared_experts", d.hidden, d.moe_intermediate)
        for e in range(d.experts):
            specs += _mlp(f"{p}.mlp.experts.{e}", d.hidden, d.moe_intermediate, _int4_linear)
        shards.append(specs)
    shards.append([("model.embed_tokens.weight", "BF16", (d.vocab, d.hidden)),
                   ("model.norm.weight", "BF16", (d.hidden,)),
                   ("lm_head.weight", "BF16", (d.vocab, d.hidden))])
    return shards


def write_header_only(out: Path, d: FixtureDims = KIMI_K2_THINKING, shape_values: bool = False
                      ) -> Path:
    """A header-only Kimi-K2-Thinking INT4 checkpoint at dims `d` in `out` (config.json,
    index, shards whose data regions are holes, but for the INT4 weight_shape values with
    `shape_values`: what `--dry-run` of a conversion reads)."""
    out.mkdir(parents=True, exist_ok=True)
    shards = kimi_int4_shards(d)
    weight_map, total = {}, 0
    for i, specs in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):06d}.safetensors"
        head, offsets = plan_header(specs)
        packed = {n: shape for n, _, shape in specs if n.endswith(".weight_packed")}
        shapes = {n: (packed[p][0], packed[p][1] * 8) for n, _, _ in specs
                  if shape_values and n.endswith(".weight_shape")
                  and (p := n.removesuffix("weight_shape") + "weight_packed") in packed}
        end = max(e for _, e in offsets.values())
        with open(out / name, "wb") as fh:
            fh.write(head)
            os.ftruncate(fh.fileno(), len(head) + end)
            for tensor, shape in shapes.items():
                fh.seek(len(head) + offsets[tensor][0])
                fh.write(struct.pack("<2i", *shape))
        weight_map.update(dict.fromkeys((s[0] for s in specs), name))
        total += end
    (out / "model.safetensors.index.json").write_bytes(json_bytes(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}))
    (out / "config.json").write_bytes(json_bytes(k2_config(d, quantized=True)))
    return out
