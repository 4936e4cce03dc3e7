"""The trained tiny MoE (tests/fixtures/tiny-moe-trained, made by scripts/train_tiny_moe.py):
its dimensions and config, its data (the Python standard library, split into training and
held-out files), its Kimi-layout checkpoint files, and its whole-model evaluation with
transformers (held-out loss, expert load). Notes: docs/tiny-moe.md."""

from __future__ import annotations

import functools
import json
import math
import platform
import sysconfig
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kconvert.io.files import write_small_safetensors
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.fixture_weights import FixtureDims

BOS, EOS = 256, 257


VOCAB = 258


META_FILE = "tiny_moe.json"  # training record written next to the weights


# Folders never read: installed packages and bytecode (NOT_STDLIB), and for the tiny MoE the
# stdlib's test suites too (the proxy reads them: kconvert.testing.proxy).
NOT_STDLIB = frozenset({"site-packages", "dist-packages", "__pycache__"})
_EXCLUDED_DIRS = NOT_STDLIB | {"test", "tests", "idle_test"}


# The fixture's dims with more experts and layers (hidden/intermediates are multiples of 32 so
# INT4/NVFP4 fit) and the byte-level vocabulary.
TINY_MOE_DIMS = FixtureDims(experts=24, moe_layers=3, vocab=VOCAB)


def stdlib_files(excluded: frozenset[str] = _EXCLUDED_DIRS) -> list[tuple[str, Path]]:
    """(relative path, path) of the stdlib's ``*.py`` sources outside the `excluded` folders
    (default: tests excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if excluded & set(rel.parts[:-1]) or not p.is_file():
            continue
        out.append((rel.as_posix(), p))
    return sorted(out)


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 10 == 0


@functools.lru_cache(maxsize=2)
def corpus_ids(split: str) -> torch.Tensor:
    """All files of ``split`` ("train" / "heldout") as byte ids joined by <eos> (int16, 1-D)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    parts = []
    sep = torch.tensor([EOS], dtype=torch.int16)
    for rel, path in stdlib_files():
        if is_heldout(rel) != (split == "heldout"):
            continue
        data = path.read_bytes()
        if data:
            parts += [torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16), sep]
    if not parts:
        raise RuntimeError(f"no stdlib sources found under {sysconfig.get_paths()['stdlib']}")
    return torch.cat(parts)


def corpus_info() -> dict[str, Any]:
    """What the corpus was built from: enough to tell whether another install differs."""
    files = stdlib_files()
    info: dict[str, Any] = {"python": platform.python_version(), "stdlib_py_files": len(files)}
    for split in ("train", "heldout"):
        ids = corpus_ids(split)
        info[f"{split}_files"] = sum(is_heldout(r) == (split == "heldout") for r, _ in files)
        info[f"{split}_bytes"] = int(ids.numel())
        info[f"{split}_crc32"] = zlib.crc32(ids.numpy().tobytes())
    return info


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


def heldout_ids(n_tokens: int, seed: int = 0, window: int = 256) -> torch.Tensor:
    """``n_tokens`` held-out byte ids (1-D LongTensor): random ``window``-long excerpts of the
    held-out stdlib files, concatenated (so with ``seq_len == window`` every sequence is one
    contiguous excerpt). Deterministic for (n_tokens, seed, window) on one Python install."""
    if n_tokens < 1 or window < 2:
        raise ValueError("need n_tokens >= 1 and window >= 2")
    gen = torch.Generator().manual_seed(seed)
    n = math.ceil(n_tokens / window)
    return windows(corpus_ids("heldout"), n, window, gen).reshape(-1)[:n_tokens].clone()


def _as_sequences(texts_or_ids: Any, seq_len: int) -> list[torch.Tensor]:
    """Text(s) -> bytes joined by <eos>; 1-D ids -> chunks of ``seq_len``; 2-D ids -> rows."""
    if isinstance(texts_or_ids, str):
        texts_or_ids = [texts_or_ids]
    if (
        isinstance(texts_or_ids, (list, tuple))
        and texts_or_ids
        and isinstance(texts_or_ids[0], str)
    ):
        flat: list[int] = []
        for i, text in enumerate(texts_or_ids):
            flat += ([EOS] if i else []) + list(text.encode())
        ids = torch.tensor(flat, dtype=torch.long)
    else:
        ids = torch.as_tensor(texts_or_ids, dtype=torch.long)
    if ids.dim() == 2:
        return list(ids)
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D or 2-D, got shape {tuple(ids.shape)}")
    chunks = [c for c in ids.split(seq_len) if c.numel() >= 2]
    if not chunks:
        raise ValueError("need at least 2 tokens to score")
    return chunks


def batches(seqs: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Batches of equal-length sequences (a shorter tail chunk goes alone)."""
    i = 0
    while i < len(seqs):
        j = i + 1
        while j < len(seqs) and j - i < batch_size and seqs[j].numel() == seqs[i].numel():
            j += 1
        yield torch.stack(seqs[i:j])
        i = j


def kimi_config(dims: FixtureDims = TINY_MOE_DIMS) -> dict[str, Any]:
    """config.json: make_fixture's Kimi-K2-Thinking config (rope/yarn/router fields verbatim)
    at these dims, with byte-level specials and without auto_map (no remote code shipped)."""
    cfg = k2_config(dims, quantized=False)
    del cfg["auto_map"]
    cfg.update(bos_token_id=BOS, eos_token_id=EOS)
    return cfg


def deepseek_config(cfg: dict[str, Any], attn: str = "eager", experts: str = "grouped_mm") -> Any:
    """transformers config for a Kimi config dict, with model_type "deepseek_v3".

    transformers 5.x fuses per-expert tensors into its 3-D expert parameters only for
    model_type "deepseek_v3" (for "kimi_k2" it silently leaves them random).
    """
    from transformers import DeepseekV3Config

    d = dict(cfg, model_type="deepseek_v3")
    for key in ("architectures", "auto_map", "quantization_config"):
        d.pop(key, None)
    out = DeepseekV3Config.from_dict(d)
    out._attn_implementation = attn
    out._experts_implementation = experts
    return out


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def kimi_state_dict(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """The model's weights as Kimi tensors, one dict per shard (layers, then embed/norm/head).

    Fused experts are split: ``gate_up_proj [E, 2I, H]`` -> ``gate_proj = [e, :I]``,
    ``up_proj = [e, I:]``; ``down_proj [E, H, I]`` -> ``down_proj = [e]``. BF16 everywhere except
    ``e_score_correction_bias`` (F32, as Kimi ships it).
    """
    state = model.state_dict()
    n_layers = model.config.num_hidden_layers
    inter = model.config.moe_intermediate_size
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers + 1)]
    for name, t in state.items():
        t = t.detach()
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            shard = shards[layer]
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            shard = shards[-1]
        else:
            raise KeyError(f"unexpected state tensor {name}")
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            assert t.shape[1] == 2 * inter, t.shape
            for e in range(t.shape[0]):
                shard[f"{base}{e}.gate_proj.weight"] = t[e, :inter].to(torch.bfloat16).contiguous()
                shard[f"{base}{e}.up_proj.weight"] = t[e, inter:].to(torch.bfloat16).contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                shard[f"{base}{e}.down_proj.weight"] = t[e].to(torch.bfloat16).contiguous()
        elif name.endswith("e_score_correction_bias"):
            shard[name] = t.to(torch.float32).contiguous()
        else:
            shard[name] = t.to(torch.bfloat16).contiguous()
    return shards


def save_kimi_layout(
    model: torch.nn.Module, out: Path, config: dict[str, Any], extra_files: dict[str, bytes]
) -> dict[str, torch.Tensor]:
    """Write shards, index, config and ``extra_files`` into ``out``; returns every saved tensor."""
    out.mkdir(parents=True, exist_ok=True)
    shards = kimi_state_dict(model)
    n = len(shards)
    weight_map: dict[str, str] = {}
    written: dict[str, torch.Tensor] = {}
    total = 0
    for i, tensors in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:06d}.safetensors"
        write_small_safetensors(out / fname, tensors, {"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            written[k] = v
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_bytes(json_bytes(index))
    (out / "config.json").write_bytes(json_bytes(config))
    for fname, data in extra_files.items():
        (out / fname).write_bytes(data)
    return written


def load_kimi_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    attn_implementation: str = "eager",
    experts_implementation: str = "grouped_mm",
) -> Any:
    """A dense (BF16) Kimi-layout checkpoint as transformers' ``DeepseekV3ForCausalLM`` (eval).

    Refuses quantized checkpoints (decompress them first) and fails on any missing, unexpected
    or mis-shaped tensor, so per-expert tensors can never be silently left random.
    """
    from transformers import DeepseekV3ForCausalLM

    model_dir = Path(model_dir)
    cfg_dict = json.loads((model_dir / "config.json").read_text())
    if "text_config" in cfg_dict:
        raise ValueError(f"{model_dir}: multimodal wrapper configs are not supported here")
    if "quantization_config" in cfg_dict:
        raise ValueError(f"{model_dir}: quantized checkpoint; decompress to BF16 first")
    cfg = deepseek_config(cfg_dict, attn_implementation, experts_implementation)
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        model_dir,
        config=cfg,
        dtype=dtype,
        output_loading_info=True,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise ValueError(f"{model_dir}: checkpoint does not match the model: {info}")
    return model.eval()


@contextmanager
def route_counter(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Counts, per MoE layer index, how many routed (token, slot) pairs each expert received."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    counts: dict[int, torch.Tensor] = {}
    handles = []
    for idx, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if not isinstance(gate, DeepseekV3TopkRouter):
            continue
        counts[idx] = torch.zeros(gate.num_experts, dtype=torch.long, device=gate.weight.device)

        def hook(mod, args, out, idx=idx):
            counts[idx] += torch.bincount(out[2].reshape(-1), minlength=mod.num_experts)

        handles.append(gate.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def _model(model_or_dir: Any) -> Any:
    if isinstance(model_or_dir, (str, Path)):
        return load_kimi_checkpoint(model_or_dir)
    return model_or_dir


@torch.no_grad()
def _score(model: Any, seqs: list[torch.Tensor], batch_size: int) -> tuple[float, int]:
    total, count = 0.0, 0
    for batch in batches(seqs, batch_size):
        logits = model(batch).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss.double())
        count += batch[:, 1:].numel()
    return total, count


def heldout_loss(
    model_dir: str | Path | Any, texts_or_ids: Any, seq_len: int = 256, batch_size: int = 16
) -> float:
    """Mean next-byte cross-entropy (nats/byte) of a dense Kimi-layout checkpoint.

    ``model_dir``: a checkpoint directory (loaded with :func:`load_kimi_checkpoint`, fp32) or an
    already loaded ``DeepseekV3ForCausalLM``. ``texts_or_ids``: a string or list of strings
    (UTF-8 bytes are the ids, texts joined by <eos>), a 1-D id tensor/list (split into
    ``seq_len`` chunks; a last chunk shorter than ``seq_len`` is scored too) or a 2-D tensor
    (rows used as given). Every position but the first of each sequence is predicted.
    """
    model = _model(model_dir)
    was_training = model.training
    model.eval()
    try:
        total, count = _score(model, _as_sequences(texts_or_ids, seq_len), batch_size)
    finally:
        model.train(was_training)
    return total / count


@torch.no_grad()
def expert_load(
    model_dir: str | Path | Any, texts_or_ids: Any, seq_len: int = 256, batch_size: int = 16
) -> dict[int, torch.Tensor]:
    """Routed (token, slot) counts per expert for every MoE layer: {layer: LongTensor[E]}."""
    model = _model(model_dir)
    was_training = model.training
    model.eval()
    try:
        with route_counter(model) as counts:
            for batch in batches(_as_sequences(texts_or_ids, seq_len), batch_size):
                model(batch)
    finally:
        model.train(was_training)
    return {k: v.clone() for k, v in counts.items()}


def load_summary(counts: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Per layer: min/max routed-token share (uniform = 1/E) and experts never routed to."""
    out = {}
    for layer, c in sorted(counts.items()):
        share = c.double() / c.sum()
        out[str(layer)] = {
            "min_share": round(float(share.min()), 5),
            "max_share": round(float(share.max()), 5),
            "uniform_share": round(1.0 / c.numel(), 5),
            "dead_experts": int((c == 0).sum()),
            "shares": [round(float(s), 5) for s in share],
        }
    return out
