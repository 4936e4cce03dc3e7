"""The Kimi-routed proxy (tests/fixtures/kimi-proxy, made by scripts/train_proxy.py): its dims
and config, its corpus (the Python standard library with its test suites) and BPE tokenizer, the
INT4 packing of its routed experts as Kimi ships them, and loading it into transformers'
DeepSeek-V3 modules. Notes: docs/proxy.md."""

from __future__ import annotations

import hashlib
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kconvert.formats.int4 import Int4Codec
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.fixture_weights import PROJS, FixtureDims, quant_kimi
from kconvert.testing.fixtures import make_fixture
from kconvert.testing.tiny_moe import (
    NOT_STDLIB,
    deepseek_config,
    is_heldout,
    json_bytes,
    stdlib_files,
)

RECORD_FILE = "proxy.json"  # training record written next to the weights


BOS_TOKEN, EOS_TOKEN = "[BOS]", "[EOS]"  # Kimi's special token names; ids 0 and 1 here


# 6 decoder layers (layer 0 dense, 1..5 MoE) with Kimi's routing: 384 routed experts, top-8.
# hidden 256 x moe_intermediate 32 keeps the INT4 experts (5 x 384 x 3 matrices) near 27 MB.
PROXY_DIMS = FixtureDims(
    hidden=256,
    intermediate=512,
    moe_intermediate=32,
    experts=384,
    top_k=8,
    moe_layers=5,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    heads=8,
    vocab=4096,
)


# Unlike the tiny MoE's corpus, the stdlib's own test suites stay in: three times the text.
def stdlib_sources() -> list[tuple[str, str]]:
    """(relative path, text) of every UTF-8 ``*.py`` under the stdlib, its test suites
    included, sorted by path."""
    out = []
    for rel, p in stdlib_files(NOT_STDLIB):
        try:  # a few test files are deliberately in other encodings
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            out.append((rel, text))
    if not out:
        raise RuntimeError("no stdlib sources found")
    return out


def split_sources(sources: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Training and held-out files; the split is the tiny MoE's (crc32 of the path)."""
    return {
        "train": [s for s in sources if not is_heldout(s[0])],
        "heldout": [s for s in sources if is_heldout(s[0])],
    }


def corpus_record(splits: dict[str, list[tuple[str, str]]]) -> dict[str, Any]:
    """Files, bytes and a sha256 over (path, text) per split: enough to tell installs apart."""
    out: dict[str, Any] = {"python": platform.python_version(), "glob": "stdlib/**/*.py"}
    for name, files in splits.items():
        h = hashlib.sha256()
        for rel, text in files:
            h.update(rel.encode() + b"\0" + text.encode() + b"\0")
        out[name] = {
            "files": len(files),
            "bytes": sum(len(t.encode()) for _, t in files),
            "sha256": h.hexdigest(),
        }
    return out


def train_tokenizer(texts: list[str], vocab: int) -> Any:
    """A byte-level BPE of ``vocab`` tokens ([BOS] = 0, [EOS] = 1) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, not {vocab}")
    return tok


def tokenizer_files(tok: Any) -> dict[str, bytes]:
    """tokenizer.json + tokenizer_config.json: AutoTokenizer loads a PreTrainedTokenizerFast."""
    cfg = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return {
        "tokenizer.json": (tok.to_str() + "\n").encode(),
        "tokenizer_config.json": json_bytes(cfg),
    }


def encode_files(tok: Any, texts: list[str]) -> np.ndarray:
    """Token ids of ``texts`` joined by [EOS] (uint16, 1-D)."""
    eos = tok.token_to_id(EOS_TOKEN)
    parts = []
    for enc in tok.encode_batch(texts):
        parts += [np.asarray(enc.ids, dtype=np.uint16), np.asarray([eos], dtype=np.uint16)]
    return np.concatenate(parts)


def proxy_config(dims: FixtureDims = PROXY_DIMS) -> dict[str, Any]:
    """config.json of the BF16 model: make_fixture's Kimi-K2-Thinking config at the proxy's dims
    (auto_map included), with the tokenizer's [BOS] = 0 / [EOS] = 1; the INT4 proxy adds Kimi's
    quantization_config."""
    return dict(k2_config(dims, quantized=False), bos_token_id=0, eos_token_id=1)


def remote_code_files() -> dict[str, bytes]:
    """The bundled fixture's stand-ins for Kimi's remote code, which config.json's auto_map
    names: transformers reads config.json through them before it loads a tokenizer."""
    names = ("configuration_deepseek.py", "modeling_deepseek.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = make_fixture(Path(tmp) / "fixture", "bf16")
        return {name: (out / name).read_bytes() for name in names}


def _expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def pack_routed_experts(model_dir: Path, quantization_config: dict[str, Any]) -> None:
    """Turn a BF16 Kimi-layout directory into Kimi's INT4 release in place: every routed
    expert's ``weight`` becomes ``weight_packed/weight_scale/weight_shape`` (Kimi's QAT INT4,
    group 32, the bundled fixture's packer), and config.json gains ``quantization_config``."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if _expert_weight(name):
                base = name.removesuffix(".weight")
                out.update({f"{base}.{k}": v for k, v in quant_kimi(t).items()})
            else:
                out[name] = t
        save_file(out, str(model_dir / shard), metadata={"format": "pt"})
        for k, v in out.items():
            weight_map[k] = shard
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index_path.write_bytes(json_bytes(index))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (model_dir / "config.json").write_bytes(json_bytes(cfg))


def _fused_experts(tensors: dict[str, torch.Tensor], prefix: str, n: int) -> dict[str, Any]:
    """One MoE layer's INT4 experts decoded (exact q * scale) into transformers' fused
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
    decoded = {}
    for proj in PROJS:
        t = {
            p: torch.stack([tensors.pop(f"{prefix}.{e}.{proj}.{p}") for e in range(n)])
            for p in ("weight_packed", "weight_scale", "weight_shape")
        }
        decoded[proj] = Int4Codec.decode(t, tuple(t["weight_shape"][0].tolist()))
    return {
        f"{prefix}.gate_up_proj": torch.cat([decoded["gate_proj"], decoded["up_proj"]], dim=1),
        f"{prefix}.down_proj": decoded["down_proj"],
    }


def load_proxy(model_dir: str | Path, attn: str = "eager") -> Any:
    """The INT4 proxy (or any INT4 Kimi-layout directory with per-expert tensors) as
    transformers' ``DeepseekV3ForCausalLM`` in fp32, eval mode, experts decoded exactly; strict:
    a missing or unexpected tensor raises."""
    from transformers import DeepseekV3ForCausalLM

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    state: dict[str, torch.Tensor] = {}
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        state.update(_fused_experts(tensors, prefix, cfg["n_routed_experts"]))
    state.update(tensors)
    model = DeepseekV3ForCausalLM(deepseek_config(cfg, attn))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.eval()
