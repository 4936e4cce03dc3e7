"""Every synthetic Kimi-K2-shaped shard set the benchmarks build, and their token data.

Three builders, each with its reasons:
- `kimi_set`: our own, for the data-driven commands (calibrate, eval, reap, sparsify, gptq):
  layer 0 dense, --moe-layers MoE layers of routed INT4 experts and a BF16 shared expert, MLA
  attention, real Kimi-K2 shapes (FULL) but a 16k vocabulary (only the embedding lookup
  touches it); weights scaled by fan-in and INT4 scales fixed, so a forward pass stays finite
  layer after layer.
- the anchor's (`anchor_set`, `expert_set`): ../shared/bench/anchor_convert.py's own builder
  (its `make_src`, `int4_expert`, config), read from its source and run here, so that kconvert
  converts exactly the set the llm-compressor anchor is timed on. anchor_convert.py is the
  outside reference and is called as it is, never edited or copied.
- `mxfp4_set`: the MXFP4 twin of an INT4 set, its routed experts in compressed-tensors'
  `mxfp4-pack-quantized` (Kimi-K3's expert format: group 32, uint8 E8M0), made by kconvert's
  own `int4-to-mxfp4` (amax rule: compressed-tensors' bytes), for the exact MXFP4 -> NVFP4
  cast (`python -m benchmarks convert cast`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.harness import REPO

FIXTURE = REPO / "tests" / "fixtures" / "tiny-k2-thinking-int4"


@dataclass(frozen=True)
class Dims:
    """hidden, expert intermediate, dense intermediate, routed experts, vocabulary, q_lora,
    kv_lora, attention heads (the order of --dims)."""

    hidden: int
    moe_inter: int
    dense_inter: int
    experts: int
    vocab: int
    q_lora: int
    kv_lora: int
    heads: int

    @classmethod
    def parse(cls, text: str) -> Dims:
        return cls(*(int(x) for x in text.split(",")))

    def __str__(self) -> str:
        return ",".join(map(str, astuple(self)))


FULL = Dims(7168, 2048, 18432, 384, 16384, 1536, 512, 64)
TINY = Dims(128, 64, 256, 16, 512, 64, 32, 4)


def add_dims(ap: argparse.ArgumentParser, moe_layers: int | None = 1) -> None:
    """--dims (kimi_set's eight sizes; FULL by default, TINY under a bench's --tiny) and,
    unless `moe_layers` is None, --moe-layers (default `moe_layers`)."""
    ap.add_argument("--dims", type=Dims.parse, default=FULL,
                    help="the set's sizes: hidden, expert intermediate, dense intermediate, "
                         f"routed experts, vocabulary, q_lora, kv_lora, heads (default: {FULL}"
                         f"; with --tiny {TINY})")
    if moe_layers is not None:
        ap.add_argument("--moe-layers", type=int, default=moe_layers,
                        help="MoE layers after the dense layer 0 (default: %(default)s)")


def add_anchor_dims(ap: argparse.ArgumentParser, moe_layers: int = 1) -> None:
    """--dims and --moe-layers of the anchor's set (anchor_set): full, tiny or small."""
    ap.add_argument("--dims", choices=("full", "tiny", "small"), default="full",
                    help="the anchor's set: full (15.5 GB with one MoE layer), tiny (a check "
                         "in seconds) or small (ANCHOR_SMALL's sizes) (default: %(default)s)")
    ap.add_argument("--moe-layers", type=int, default=moe_layers,
                    help="MoE layers of the set (default: %(default)s)")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _bf16(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device=_device()) * shape[-1] ** -0.5).to(torch.bfloat16).cpu()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit codes [..., K] (0..15) as int32 words [..., K/8], low nibble first."""
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int32)
    words = (codes.view(*codes.shape[:-1], -1, 8) << shifts).sum(-1, dtype=torch.int64)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int4(out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    """Kimi-style INT4: codes -7..7 packed low nibble first, bf16 group-32 scales."""
    dev = _device()
    packed = pack_nibbles(torch.randint(-7, 8, (out_f, in_f), device=dev, dtype=torch.int32) + 8)
    scale = torch.full((out_f, in_f // 32), (in_f ** -0.5) / 4, device=dev).to(torch.bfloat16)
    return {"weight_packed": packed.cpu(), "weight_scale": scale.cpu(),
            "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int32)}


def _attention(p: str, d: Dims) -> dict[str, torch.Tensor]:
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    return {f"{p}.self_attn.q_a_proj.weight": _bf16(d.q_lora, d.hidden),
            f"{p}.self_attn.q_a_layernorm.weight": ones(d.q_lora),
            f"{p}.self_attn.q_b_proj.weight": _bf16(d.heads * 192, d.q_lora),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": _bf16(d.kv_lora + 64, d.hidden),
            f"{p}.self_attn.kv_a_layernorm.weight": ones(d.kv_lora),
            f"{p}.self_attn.kv_b_proj.weight": _bf16(d.heads * 256, d.kv_lora),
            f"{p}.self_attn.o_proj.weight": _bf16(d.hidden, d.heads * 128),
            f"{p}.input_layernorm.weight": ones(d.hidden),
            f"{p}.post_attention_layernorm.weight": ones(d.hidden)}


def _kimi_config(d: Dims, moe_layers: int) -> dict:
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
              "strategy": "group", "dynamic": False}}},
          "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                     r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "hidden_size": d.hidden, "intermediate_size": d.dense_inter,
            "moe_intermediate_size": d.moe_inter, "num_hidden_layers": 1 + moe_layers,
            "first_k_dense_replace": 1, "n_routed_experts": d.experts,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.827,
            "norm_topk_prob": True, "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "num_attention_heads": d.heads, "num_key_value_heads": d.heads,
            "vocab_size": d.vocab, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "rope_theta": 50000.0,
            "tie_word_embeddings": False,
            "rope_scaling": {"type": "yarn", "factor": 64.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "torch_dtype": "bfloat16", "quantization_config": qc}


def make_kimi_set(src: Path, d: Dims, moe_layers: int) -> None:
    """Build the set in `src` (replacing what is there): one shard per layer, a last one with
    the embedding, norm and lm_head."""
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    count = moe_layers + 2
    names = [f"model-{i:05d}-of-{count:06d}.safetensors" for i in range(1, count + 1)]
    weight_map: dict[str, str] = {}

    def put(i: int, t: dict[str, torch.Tensor]) -> None:
        save_file(t, str(src / names[i]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(t, names[i]))

    t = _attention("model.layers.0", d)
    for proj, shape in (("gate_proj", (d.dense_inter, d.hidden)),
                        ("up_proj", (d.dense_inter, d.hidden)),
                        ("down_proj", (d.hidden, d.dense_inter))):
        t[f"model.layers.0.mlp.{proj}.weight"] = _bf16(*shape)
    put(0, t)
    for layer in range(1, moe_layers + 1):
        p = f"model.layers.{layer}"
        t = _attention(p, d)
        t[f"{p}.mlp.gate.weight"] = _bf16(d.experts, d.hidden)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(d.experts) * 0.01
        for proj, shape in (("gate_proj", (d.moe_inter, d.hidden)),
                            ("up_proj", (d.moe_inter, d.hidden)),
                            ("down_proj", (d.hidden, d.moe_inter))):
            t[f"{p}.mlp.shared_experts.{proj}.weight"] = _bf16(*shape)
            for e in range(d.experts):
                for param, v in _int4(*shape).items():
                    t[f"{p}.mlp.experts.{e}.{proj}.{param}"] = v
        put(layer, t)
    put(moe_layers + 1, {"model.embed_tokens.weight": _bf16(d.vocab, d.hidden),
                         "lm_head.weight": _bf16(d.vocab, d.hidden),
                         "model.norm.weight": torch.ones(d.hidden, dtype=torch.bfloat16)})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(_kimi_config(d, moe_layers), indent=1))


def kimi_set(root: Path, d: Dims, moe_layers: int = 1) -> Path:
    """ROOT/calib-src, built unless it is there with these dims and MoE layers (a stamp
    beside it says which)."""
    src = root / "calib-src"
    stamp, made = src.with_suffix(".dims"), f"{d};{moe_layers}"
    if not (src / "config.json").exists() or not stamp.exists() or stamp.read_text() != made:
        make_kimi_set(src, d, moe_layers)
        stamp.write_text(made)
    return src


def random_ids(seqs: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[seqs, seq] token ids, uniform over the vocabulary."""
    return torch.randint(0, vocab, (seqs, seq), generator=torch.Generator().manual_seed(seed))


def write_ids(path: Path, ids: torch.Tensor) -> Path:
    """One `{"input_ids": [...]}` line per row: the commands' --data format."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    return path


def random_int4(batch: int, m: int, k: int, gen: torch.Generator, dev: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """In-memory INT4 experts [batch, m, k]: any int32 word as 8 codes, bf16 group-32 scales
    in [0.001, 0.005) (the anchor's scale range)."""
    packed = torch.randint(-2**31, 2**31 - 1, (batch, m, k // 8), dtype=torch.int32,
                           device=dev, generator=gen)
    scale = (torch.rand(batch, m, k // 32, device=dev, generator=gen) * 0.004 + 0.001
             ).to(torch.bfloat16)
    return packed, scale


# ------------------------------------------------------------------ the anchor's builder


def anchor_script() -> Path:
    """anchor_convert.py: ANCHOR_SCRIPT, else .bench/ (where device runs copy shared/bench),
    else shared/bench in or beside this repository."""
    env = os.environ.get("ANCHOR_SCRIPT")
    for cand in (env, REPO / ".bench" / "anchor_convert.py",
                 REPO / "shared" / "bench" / "anchor_convert.py",
                 REPO.parent / "shared" / "bench" / "anchor_convert.py"):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise SystemExit("anchor_convert.py not found: set ANCHOR_SCRIPT or copy it to .bench/")


def anchor_stub() -> Path:
    """The stub packages anchor_convert.py puts ahead of llmcompressor's imports."""
    return anchor_script().parent / "stub"


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def anchor_namespace(dims: str = "full", moe_layers: int = 1) -> dict:
    """anchor_convert.py's functions and sizes (make_src, int4_expert, bf16, H, E, ...) for
    DIMS=`dims` and MOE_LAYERS=`moe_layers`, without running its main()."""
    script = anchor_script()
    text = re.sub(r"\nmain\(\)\s*$", "\n", script.read_text())
    ns: dict = {"__name__": "anchor_convert", "__file__": str(script)}
    with _environ(DIMS=dims, MOE_LAYERS=str(moe_layers)):
        exec(compile(text, str(script), "exec"), ns)
    return ns


# --dims small: anchor_convert's layout at sizes a 2-core machine converts in seconds (about
# 57 MB a MoE layer, 70 MB of embed + lm_head).
ANCHOR_SMALL = {"H": 1024, "I_MOE": 512, "I_DENSE": 2048, "E": 64, "V": 16384, "QL": 256,
                "KVL": 128, "NH": 8}


def anchor_set(src: Path, dims: str = "full", moe_layers: int = 1) -> int:
    """anchor_convert.make_src into `src` for DIMS=`dims` (full: 15.5 GB with one MoE layer;
    tiny; small: ANCHOR_SMALL's sizes); the bytes written."""
    ns = anchor_namespace(dims, moe_layers)
    if dims == "small":
        ns.update(ANCHOR_SMALL)
    return ns["make_src"](str(src))


def anchor_config(ns: dict) -> dict:
    """The config.json that anchor_convert.make_src writes (its block read from the source)."""
    text = anchor_script().read_text()
    start = text.index("    cfg = {")
    end = text.index("json.dump(cfg", start)
    block = "\n".join(ln[4:] for ln in text[start:end].splitlines())
    env = {k: ns[k] for k in ("H", "I_DENSE", "I_MOE", "E", "V", "QL", "KVL", "NH")}
    env["MOE_LAYERS"] = 1
    exec(compile(block, "anchor_cfg", "exec"), {}, env)
    return env["cfg"]


def expert_set(dst: Path, n_experts: int, seed: int = 0) -> int:
    """One shard with a MoE layer of n full-size experts (INT4 as anchor_convert makes them)
    and its router + the anchor's config (DIMS=full, n_routed_experts=n): a small set for CPU
    timing. The layer is layer 0 of a one-layer model, so that the source passes kconvert's
    structure checks (no missing dense layer 0, a router, top-k within n). The matrices."""
    ns = anchor_namespace("full")
    h, inter = ns["H"], ns["I_MOE"]
    torch.manual_seed(seed)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    t = {"model.layers.0.mlp.gate.weight": ns["bf16"](n_experts, h),
         "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(n_experts)}
    for e in range(n_experts):
        for pj, shp in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                        ("down_proj", (h, inter))):
            pk, sc, sh = ns["int4_expert"](*shp)
            b = f"model.layers.0.mlp.experts.{e}.{pj}"
            t[f"{b}.weight_packed"], t[f"{b}.weight_scale"], t[f"{b}.weight_shape"] = pk, sc, sh
    name = "model-00001-of-000001.safetensors"
    save_file(t, dst / name, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": (dst / name).stat().st_size},
         "weight_map": dict.fromkeys(t, name)}, indent=2))
    cfg = anchor_config(ns)
    cfg.update(n_routed_experts=n_experts, num_experts_per_tok=min(8, n_experts),
               num_hidden_layers=1, first_k_dense_replace=0)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return 3 * n_experts


def mxfp4_set(int4_src: Path, dst: Path, device: str = "cpu") -> Path:
    """`dst`: the routed experts of the INT4 set `int4_src` as compressed-tensors MXFP4
    (`kconvert int4-to-mxfp4 --format mxfp4-pack-quantized`), everything else as it is; built
    unless `dst` is there from the same source (a stamp beside it says which)."""
    from kconvert.api import int4_to_mxfp4

    stamp, made = dst.with_suffix(".source"), str(int4_src.resolve())
    if not (dst / "kconvert-manifest.json").is_file() or not stamp.is_file() \
            or stamp.read_text() != made:
        int4_to_mxfp4(str(int4_src), str(dst), format="mxfp4-pack-quantized", device=device,
                      overwrite=dst.exists())
        stamp.write_text(made)
    return dst


def split_shards(single: Path, dst: Path, shards: int) -> None:
    """The one-shard set `single` as `shards` shards, each holding whole experts (a fused set
    is never split) and the router in the first."""
    dst.mkdir(parents=True, exist_ok=True)
    (src_file,) = single.glob("*.safetensors")
    weight_map = {}
    with safe_open(str(src_file), framework="pt") as f:
        names = sorted(f.keys())
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {}
            for n in names:
                expert = n.split(".experts.")[1].split(".")[0] if ".experts." in n else None
                if (expert is None and s == 0) or (expert is not None
                                                   and int(expert) % shards == s):
                    part[n] = f.get_tensor(n)
            save_file(part, str(dst / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
    total = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (dst / "config.json").write_text((single / "config.json").read_text())


def sharded_expert_set(root: Path, n_experts: int, shards: int) -> Path:
    """ROOT/torchrun-src: `expert_set` of n experts split into `shards` shards of whole
    experts; built unless it is there."""
    src = root / "torchrun-src"
    if not (src / "config.json").is_file():
        single = root / "torchrun-single"
        expert_set(single, n_experts)
        split_shards(single, src, shards)
        shutil.rmtree(single, ignore_errors=True)
    return src
