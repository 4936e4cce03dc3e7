"""`kconvert eval --generate`: continuations of held-out prompts from one model, through eval's
own forward (transformers' DeepSeek-V3 decoder layers with kconvert's MoE block, built from the
checkpoint's bytes in the compute dtype, W4A4 activations quantized as served:
kconvert.evaluate.activations.build_served), with transformers' DynamicCache holding each
layer's compressed MLA latents, so each new token runs one position through every layer.

Unlike the teacher-forced pass, which streams one decoder layer at a time, decoding needs every
layer at every step: the whole model is decoded into memory (the GPU budget on a GPU, the free
RAM on a CPU). A model that does not fit is refused before any layer is read, in one line that
says what it needs; a model that large is probed through its serving engine's texts instead
(`--generations`).
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.calibrate.forward import embed, load_head, position_embeddings
from kconvert.calibrate.load import read_layer, tensors_by_layer
from kconvert.calibrate.moe import ForwardContext
from kconvert.errors import KconvertError
from kconvert.evaluate.activations import build_served
from kconvert.evaluate.generation import Continuation
from kconvert.gpu.plan import Shapes, gib
from kconvert.io.checkpoint import Checkpoint


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at temperature 0, else drawn from the softmax at
    `temperature` with a generator seeded by `seed` (one stream per model run, so two models
    whose distributions agree draw the same tokens)."""

    new_tokens: int
    temperature: float = 0.0
    seed: int = 0


def model_bytes(text_config: dict, dtype: torch.dtype) -> int:
    """A model's weights decoded to `dtype`: every decoder layer (attention, dense MLP or
    routed and shared experts and router), the embedding and the lm_head."""
    s = Shapes.from_config(text_config)
    dense = s.attention_elems() + 3 * s.hidden * s.dense_inter
    moe = (s.attention_elems() + (s.experts + s.shared) * s.expert_elems()
           + s.experts * s.hidden)
    elems = s.dense_layers * dense + (s.layers - s.dense_layers) * moe + 2 * s.vocab * s.hidden
    return elems * dtype.itemsize


def cache_bytes(text_config: dict, sequences: int, length: int, dtype: torch.dtype) -> int:
    """The KV cache of `sequences` sequences of `length` tokens: each layer's MLA latent and
    rope key per token."""
    s = Shapes.from_config(text_config)
    return sequences * length * s.layers * (s.kv_lora + s.qk_rope) * dtype.itemsize


def available_ram() -> int | None:
    """The memory a new allocation can take without swapping (Linux's MemAvailable; None where
    it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_fits(label: str, ckpt: Checkpoint, sequences: int, length: int, dtype: torch.dtype,
               device: torch.device, budget: int | None) -> None:
    """Refuse, in one line, a model whose decoded weights and KV cache exceed the GPU budget
    (`budget`, on a GPU) or the free RAM (on a CPU)."""
    need = model_bytes(ckpt.text_config, dtype) + cache_bytes(ckpt.text_config, sequences,
                                                              length, dtype)
    if device.type == "cuda":
        have, where = budget, "the GPU memory budget (--gpu-memory)"
    else:
        have, where = available_ram(), "the free RAM"
    if have is not None and need > have:
        raise KconvertError(
            f"--generate holds the whole model in memory: {label} needs {gib(need)} (its "
            f"weights in {str(dtype).removeprefix('torch.')} and the KV cache of {sequences} "
            f"sequences of {length} tokens) but {where} is {gib(have)}; lower "
            "--generate-batch-size, or generate with your serving engine and compare its texts "
            "with --generations")


def eos_ids(ckpt: Checkpoint) -> set[int]:
    """The end-of-sequence ids of the text config and of generation_config.json."""
    found: set[int] = set()
    sources = [ckpt.text_config]
    gen = Path(ckpt.root) / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for cfg in sources:
        value = cfg.get("eos_token_id")
        found.update(value if isinstance(value, list) else [] if value is None else [value])
    return found


def cache_keyword(layer: type) -> str:
    """The keyword under which the installed transformers' decoder layer takes its KV cache
    (`cache` in transformers 5.2x, `past_key_values` before)."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class LoadedModel:
    """Every decoder layer of one checkpoint decoded on the device, with its embedding table
    and head."""

    def __init__(self, ckpt: Checkpoint, cfg, device: torch.device, dtype: torch.dtype,
                 max_len: int) -> None:
        ctx = ForwardContext()  # every position is real: no padding in a prompt batch
        tensors = tensors_by_layer(ckpt, cfg.num_hidden_layers)
        self.layers = [build_served(ckpt, cfg, tensors[L],
                                    read_layer(ckpt, cfg, L, tensors[L], dtype, device),
                                    ctx, device, dtype).module
                       for L in range(cfg.num_hidden_layers)]
        self.table = embed(ckpt, torch.arange(cfg.vocab_size), dtype, device)
        self.head = load_head(ckpt, cfg, device, dtype)
        self.positions, (self.cos, self.sin) = position_embeddings(cfg, max_len, device, dtype)
        self.cache_kw = cache_keyword(type(self.layers[0]))

    def step(self, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
        """Logits (fp32) after the last of `ids` [b, s], which sit at positions start..start+s-1,
        the cache holding every position before."""
        end = start + ids.shape[1]
        pos = (self.cos[:, start:end], self.sin[:, start:end])
        x = self.table[ids]
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=self.positions[:, start:end],
                      position_embeddings=pos, use_cache=True, **{self.cache_kw: cache})
        if cache.get_seq_length() != end:
            # a decoder layer that took the cache under another name would attend to the new
            # token alone: every continuation garbage, and the loop rates with it
            raise KconvertError(f"--generate: the KV cache holds {cache.get_seq_length()} "
                                f"positions after {end} tokens: this transformers version's "
                                "decoder layer did not fill it; use another transformers "
                                "version, or --generations with your engine's texts")
        return self.head(x[:, -1]).float()


def generate(ckpt: Checkpoint, cfg, prompts: torch.Tensor, sampling: Sampling,
             device: torch.device, dtype: torch.dtype, batch_size: int
             ) -> list[tuple[list[int], bool]]:
    """Per prompt (a row of `prompts` [n, P], no padding): its continuation's token ids (up to
    the first end of sequence, which is left out) and whether it ran to the limit without
    one."""
    from transformers.cache_utils import DynamicCache

    n_prompts, prompt_len = prompts.shape
    model = LoadedModel(ckpt, cfg, device, dtype, prompt_len + sampling.new_tokens)
    stop = torch.tensor(sorted(eos_ids(ckpt)), dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(sampling.seed)
    out: list[tuple[list[int], bool]] = []
    with torch.no_grad():
        for first in range(0, n_prompts, batch_size):
            ids = prompts[first:first + batch_size].to(device)
            cache = DynamicCache(config=cfg)
            logits = model.step(ids, 0, cache)
            done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
            lengths = torch.full_like(done, sampling.new_tokens, dtype=torch.long)
            tokens = []
            for t in range(sampling.new_tokens):
                nxt = pick(logits, sampling, gen).to(device)
                tokens.append(nxt)
                ended = torch.isin(nxt, stop) & ~done
                lengths[ended] = t
                done |= ended
                if bool(done.all()) or t == sampling.new_tokens - 1:
                    break
                logits = model.step(nxt[:, None], prompt_len + t, cache)
            rows = torch.stack(tokens, 1).cpu().tolist()
            out += [(row[:n], n == sampling.new_tokens)
                    for row, n in zip(rows, lengths.tolist(), strict=True)]
    return out


def pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> torch.Tensor:
    """The next token of each row: argmax, or a draw at the sampling temperature (on the CPU,
    so the draws are the same on any device)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.cpu() / sampling.temperature, -1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def decode_text(ids: list[int], tokenizer) -> str:
    """Token ids as text: the tokenizer's decoding, or without one a byte vocabulary's (ids
    below 256 are bytes, read as UTF-8; any other id is shown as <id>)."""
    if tokenizer is not None:
        return tokenizer.decode(ids, skip_special_tokens=False)
    parts, run = [], bytearray()
    for i in ids:
        if i < 256:
            run.append(i)
            continue
        parts.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        parts.append(f"<{i}>")
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


def continuations(ckpt: Checkpoint, cfg, prompts: torch.Tensor, sampling: Sampling,
                  device: torch.device, dtype: torch.dtype, batch_size: int, tokenizer
                  ) -> list[Continuation]:
    """One model's continuations of `prompts`, with their texts."""
    made = generate(ckpt, cfg, prompts, sampling, device, dtype, batch_size)
    return [Continuation(prompt=decode_text(p, tokenizer), text=decode_text(ids, tokenizer),
                         tokens=ids, hit_limit=hit)
            for p, (ids, hit) in zip(prompts.tolist(), made, strict=True)]
