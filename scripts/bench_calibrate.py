"""Benchmark: layer-streamed calibration of one full-size synthetic Kimi MoE layer.

Builds a Kimi-K2-Thinking-shaped checkpoint with real shapes (layer 0 dense, layer 1 MoE with
384 INT4 experts, MLA attention, a reduced 16k vocabulary since only the embedding lookup
touches it) and times `kconvert.calibrate.calibrate` on TOKENS sequences of SEQ tokens.
Reports seconds per layer, tokens/s, peak GPU memory and peak host RSS as JSON in $OUT.

Env: ROOT (scratch dir), OUT (result dir), SEQS (256), SEQ (2048), BATCH (8).
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(os.environ.get("ROOT", "/tmp/kbench"))
OUT = Path(os.environ.get("OUT", "/tmp/kbench-out"))
SEQS, SEQ, BATCH = (int(os.environ.get(k, d)) for k, d in
                    (("SEQS", 256), ("SEQ", 2048), ("BATCH", 8)))
H, I_MOE, I_DENSE, E, V, QL, KVL, NH = (int(x) for x in os.environ.get(
    "DIMS", "7168,2048,18432,384,16384,1536,512,64").split(","))
dev = "cuda" if torch.cuda.is_available() else "cpu"


def bf16(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(torch.bfloat16).cpu()


def int4(out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    """Kimi-style INT4: codes -7..7 packed low nibble first, bf16 group-32 scales."""
    q = torch.randint(-7, 8, (out_f, in_f), device=dev, dtype=torch.int32) + 8
    shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int32)
    packed = (q.view(out_f, in_f // 8, 8) << shifts).sum(-1, dtype=torch.int64)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    scale = torch.full((out_f, in_f // 32), (in_f ** -0.5) / 4, device=dev).to(torch.bfloat16)
    return {"weight_packed": packed.cpu(), "weight_scale": scale.cpu(),
            "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int32)}


def attention(p: str) -> dict[str, torch.Tensor]:
    return {f"{p}.self_attn.q_a_proj.weight": bf16(QL, H),
            f"{p}.self_attn.q_a_layernorm.weight": torch.ones(QL, dtype=torch.bfloat16),
            f"{p}.self_attn.q_b_proj.weight": bf16(NH * 192, QL),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": bf16(KVL + 64, H),
            f"{p}.self_attn.kv_a_layernorm.weight": torch.ones(KVL, dtype=torch.bfloat16),
            f"{p}.self_attn.kv_b_proj.weight": bf16(NH * 256, KVL),
            f"{p}.self_attn.o_proj.weight": bf16(H, NH * 128),
            f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)}


def make_checkpoint(src: Path) -> None:
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    names = [f"model-{i:05d}-of-000003.safetensors" for i in (1, 2, 3)]
    weight_map: dict[str, str] = {}

    def put(i: int, t: dict[str, torch.Tensor]) -> None:
        save_file(t, str(src / names[i]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, names[i]))

    t = attention("model.layers.0")
    for proj, shape in (("gate_proj", (I_DENSE, H)), ("up_proj", (I_DENSE, H)),
                        ("down_proj", (H, I_DENSE))):
        t[f"model.layers.0.mlp.{proj}.weight"] = bf16(*shape)
    put(0, t)
    p = "model.layers.1"
    t = attention(p)
    t[f"{p}.mlp.gate.weight"] = bf16(E, H)
    t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(E) * 0.01
    for proj, shape in (("gate_proj", (I_MOE, H)), ("up_proj", (I_MOE, H)),
                        ("down_proj", (H, I_MOE))):
        t[f"{p}.mlp.shared_experts.{proj}.weight"] = bf16(*shape)
        for e in range(E):
            for param, v in int4(*shape).items():
                t[f"{p}.mlp.experts.{e}.{proj}.{param}"] = v
    put(1, t)
    put(2, {"model.embed_tokens.weight": bf16(V, H), "lm_head.weight": bf16(V, H),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
              "strategy": "group", "dynamic": False}}},
          "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                     r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
              "hidden_size": H, "intermediate_size": I_DENSE, "moe_intermediate_size": I_MOE,
              "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": E,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
              "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.827,
              "norm_topk_prob": True, "q_lora_rank": QL, "kv_lora_rank": KVL,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
              "num_attention_heads": NH, "num_key_value_heads": NH, "vocab_size": V,
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
              "rope_theta": 50000.0, "tie_word_embeddings": False,
              "rope_scaling": {"type": "yarn", "factor": 64.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
              "torch_dtype": "bfloat16", "quantization_config": qc}
    (src / "config.json").write_text(json.dumps(config, indent=1))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kconvert.calibrate.run import measure_stats
    from kconvert.io.checkpoint import open_checkpoint

    OUT.mkdir(parents=True, exist_ok=True)
    src = ROOT / "calib-src"
    t0 = time.perf_counter()
    make_checkpoint(src)
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 "make_s": round(time.perf_counter() - t0, 1), "seqs": SEQS, "seq_len": SEQ,
                 "batch": BATCH, "tokens": SEQS * SEQ, "experts": E}
    ids = torch.randint(0, V, (SEQS, SEQ), generator=torch.Generator().manual_seed(0))
    marks = [time.perf_counter()]
    ckpt = open_checkpoint(str(src))
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    measure_stats(ckpt, ids, dev, BATCH, on_layer=lambda _layer, _h: marks.append(
        (torch.cuda.synchronize() if dev == "cuda" else None) or time.perf_counter()))
    per_layer = [round(b - a, 2) for a, b in itertools.pairwise(marks)]
    res.update({
        "seconds_per_layer": per_layer,  # [embed + dense layer 0, MoE layer 1]
        "moe_layer_s": per_layer[-1],
        "moe_tokens_per_s": round(SEQS * SEQ / per_layer[-1]),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda"
        else None,
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
        "projected_61_layers_min": round((per_layer[0] + 60 * per_layer[-1]) / 60, 1),
    })
    print(json.dumps(res, indent=1))
    (OUT / "bench_calibrate.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
