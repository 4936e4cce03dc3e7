"""Generate tiny, deterministic Kimi-K2-family checkpoints for kconvert's tests.

The real checkpoints are 0.6-2 TB, so tests need stand-ins that have the *exact* on-disk
layout of Kimi-K2-Thinking / K2.5 (tensor names, dtypes, shard naming, index, config blocks)
at toy dimensions. The variants:

* ``k2-int4-kimi``: routed experts INT4 the way Moonshot ships them (QAT codes -7..7,
  scale = amax/7, ``weight_shape`` int32), packed by :func:`pack_int4` (our own code).
* ``k2-int4-ct``: routed experts INT4 produced by compressed-tensors' own compressor
  (codes -8..7, scale = amax/7.5, ``weight_shape`` int64), so a decoder is tested against
  the reference implementation, not only against our own packer.
* ``k25-int4``: the K2.5 multimodal wrapper (``language_model.`` prefixes, vision tower and
  projector shards, tokenizer / remote-code files that must pass through untouched), with
  Moonshot's quantization_config in ``text_config`` only; ``k26-int4``: the same with K2.6's
  ignore list.
* ``k3-mxfp4``: a Kimi-K3-shaped model (kconvert.testing.fixture_k3): latent MoE with MXFP4
  routed experts ``block_sparse_moe.experts.E.w1|w2|w3`` (compressed-tensors' compressor),
  KDA and MLA attention, AttnRes, vision; the quantization_config in ``text_config``.
* ``bf16``: the same model unquantized (plain BF16 experts, no ``quantization_config``); it loads
  with ``transformers.DeepseekV3ForCausalLM`` and is the reference for accuracy checks.

For one seed every variant draws the same BF16 master weights in the same order (quantization
consumes no randomness and vision tensors come last), so ``k2-int4-*`` dequantize to close
approximations of the ``bf16`` fixture and ``k25-int4``'s language model equals ``k2-int4-kimi``.

CLI::

    python scripts/make_fixture.py OUT_DIR --variant k2-int4-kimi [--seed 0] [--hidden 128]
        [--experts 16] [--moe-layers 2] [--moe-intermediate 64] [--mtp-layers 1] [--overwrite]

``--mtp-layers N`` (DeepSeek-V3 variants and ``bf16``) adds N multi-token-prediction layers after
the decoder layers, each a full MoE layer plus embed_tokens, enorm, hnorm, eh_proj and
shared_head, and sets ``num_nextn_predict_layers`` to N.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kconvert.io.files import write_small_safetensors
from kconvert.testing import fixture_k3
from kconvert.testing.fixture_config import k2_config, k25_config, special_ids
from kconvert.testing.fixture_weights import (
    VISION,
    FixtureDims,
    Rng,
    Tensors,
    attention_tensors,
    ct_int4_scheme,
    mlp_tensors,
    moe_layer_tensors,
    mtp_layer_tensors,
    quant_ct,
    quant_kimi,
    self_check,
    vision_tensors,
)

VARIANTS = ("k2-int4-ct", "k2-int4-kimi", "k25-int4", "k26-int4", "k3-mxfp4", "bf16")
MULTIMODAL = ("k25-int4", "k26-int4")


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
    bos, _ = special_ids(vocab)
    reserved = [f"<|reserved_token_{i}|>" for i in range(bos - 256)]
    tok.add_special_tokens([AddedToken(t, special=True) for t in (*reserved, *_SPECIAL_TOKENS)])
    return (tok.to_str(pretty=True) + "\n").encode()


def _side_files(d: FixtureDims, rng: Rng, variant: str) -> dict[str, bytes]:
    """Tokenizer, templates and remote-code files that a converter must pass through untouched.

    `tiktoken.model` and `tokenization_kimi.py` stand in for Kimi's own tokenizer (remote code
    no test runs); the tokenizer AutoTokenizer loads is `tokenizer.json`, so the `text` and
    `messages` calibration inputs work on the fixtures, offline.
    """
    bos, eos = special_ids(d.vocab)
    files: dict[str, bytes] = {
        "tiktoken.model": rng.bytes(1024),
        "tokenization_kimi.py": _STUB_PY.format(what="the tiktoken TikTokenTokenizer").encode(),
        "chat_template.jinja": _CHAT_TEMPLATE.encode(),
        "generation_config.json": json_bytes(
            {"bos_token_id": bos, "do_sample": True, "eos_token_id": eos, "temperature": 1.0}
        ),
        "tokenizer.json": _tokenizer_json(d.vocab),
        "tokenizer_config.json": json_bytes(
            {
                "bos_token": _SPECIAL_TOKENS[0],
                "eos_token": _SPECIAL_TOKENS[eos - bos],
                "model_max_length": 262144,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        ),
    }
    if variant == "k3-mxfp4":
        files["configuration_kimi_k3.py"] = _STUB_PY.format(what="KimiK3Config").encode()
        files["modeling_kimi_k3.py"] = _STUB_PY.format(
            what="KimiK3ForConditionalGeneration").encode()
    elif variant in MULTIMODAL:
        files["configuration_kimi_k25.py"] = _CONFIG_PY.format(
            what="KimiK25Config", base="Kimi_K25Config", model_type="kimi_k25").encode()
        files["modeling_kimi_k25.py"] = _STUB_PY.format(
            what="KimiK25ForConditionalGeneration"
        ).encode()
        files["preprocessor_config.json"] = json_bytes(
            {
                "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "merge_kernel_size": [2, 2],
                "patch_size": VISION["patch_size"],
            }
        )
    else:
        files["configuration_deepseek.py"] = _CONFIG_PY.format(
            what="DeepseekV3Config", base="DeepseekV3Config", model_type="kimi_k2").encode()
        files["modeling_deepseek.py"] = _STUB_PY.format(what="DeepseekV3ForCausalLM").encode()
    return files


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def make_fixture(
    out: Path,
    variant: str,
    dims: FixtureDims | None = None,
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
    dims = dims or FixtureDims()
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

    if variant == "k3-mxfp4" and dims.mtp_layers:
        raise ValueError("Kimi-K3 has no multi-token-prediction layers (num_nextn_predict_layers "
                         "0); --mtp-layers is for the DeepSeek-V3 variants")
    rng = Rng(seed)
    if variant == "k3-mxfp4":
        bos, eos = special_ids(dims.vocab)
        return _write(out, fixture_k3.shards(dims, rng), fixture_k3.config(dims, bos, eos),
                      _side_files(dims, rng, variant))
    quant: Callable[[torch.Tensor], Tensors] | None
    if variant == "bf16":
        quant = None
    elif variant == "k2-int4-ct":
        scheme = ct_int4_scheme()
        quant = lambda w: quant_ct(w, scheme)  # noqa: E731
    else:
        quant = quant_kimi
    multimodal = variant in MULTIMODAL
    lm = "language_model." if multimodal else ""
    mp = f"{lm}model.layers"

    shards: list[Tensors] = []
    layer0 = attention_tensors(f"{mp}.0", dims, rng)
    layer0.update(mlp_tensors(f"{mp}.0.mlp", dims.hidden, dims.intermediate, rng))
    shards.append(layer0)
    for layer in range(1, dims.moe_layers + 1):
        shards.append(moe_layer_tensors(f"{mp}.{layer}", dims, rng, quant))
    shards.append(
        {
            f"{lm}model.embed_tokens.weight": rng.normal(dims.vocab, dims.hidden, std=1.0),
            f"{lm}model.norm.weight": rng.norm(dims.hidden),
            f"{lm}lm_head.weight": rng.linear(dims.vocab, dims.hidden),
        }
    )
    if multimodal:  # drawn last so the language model matches k2-int4-kimi for the same seed
        proj, vision = vision_tensors(dims, rng)
        shards += [proj, vision]
    # Drawn after everything else, so the rest of the model is the one without MTP layers.
    for layer in range(dims.moe_layers + 1, dims.moe_layers + 1 + dims.mtp_layers):
        shards.append(mtp_layer_tensors(f"{mp}.{layer}", dims, rng, quant))
    config = (k25_config(dims, k26=variant == "k26-int4") if multimodal
              else k2_config(dims, quantized=quant is not None))
    return _write(out, shards, config, _side_files(dims, rng, variant))


def _write(out: Path, shards: list[Tensors], config: dict[str, Any],
           side_files: dict[str, bytes]) -> Path:
    """The shards (model-0000i-of-00000n), their index, config.json and the side files."""
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:06d}.safetensors"
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        write_small_safetensors(out / name, tensors, {"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_bytes(json_bytes(index))
    (out / "config.json").write_bytes(json_bytes(config))
    for fname, data in side_files.items():
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
    ap.add_argument("--mtp-layers", type=int, help="multi-token-prediction layers "
                    "(num_nextn_predict_layers, DeepSeek-V3's layout)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    a = ap.parse_args(argv)
    over = {
        "hidden": a.hidden,
        "experts": a.experts,
        "moe_layers": a.moe_layers,
        "moe_intermediate": a.moe_intermediate,
        "mtp_layers": a.mtp_layers,
    }
    dims = replace(FixtureDims(), **{k: v for k, v in over.items() if v is not None})
    dims = replace(dims, top_k=min(dims.top_k, dims.experts))  # --experts 2 stays valid
    try:
        path = make_fixture(a.out, a.variant, dims, a.seed, overwrite=a.overwrite)
    except (ValueError, FileExistsError) as e:
        ap.error(str(e))
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"{path}: {a.variant}, {size / 1e6:.2f} MB")
