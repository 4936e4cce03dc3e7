"""Train a tiny, real Kimi-K2-shaped MoE on the Python standard library and save it in Kimi layout.

REAP (issue 4) needs a *trained* mixture of experts to measure pruning quality: random weights
route uniformly and every expert is equally (un)important. This script trains a tiny
DeepSeek-V3-architecture model with transformers' ``DeepseekV3ForCausalLM`` on CPU for a few
minutes and writes it exactly like ``make_fixture.py``'s ``bf16`` variant (one shard per layer,
a last shard with embed/norm/lm_head, per-expert BF16 tensors, F32 ``e_score_correction_bias``,
``model_type`` "kimi_k2").

Model: byte-level vocabulary (ids 0..255 = bytes, 256 = <bos>, 257 = <eos>), hidden 128,
4 layers (layer 0 dense, 1..3 MoE), 24 routed experts (moe_intermediate 64) + 1 shared, top-4,
sigmoid scores with ``e_score_correction_bias`` selection (noaux_tc, n_group 1, topk_group 1,
norm_topk_prob, routed_scaling_factor 2.827), MLA attention (q_lora 64, kv_lora 32, qk_nope 16,
qk_rope 8, v_head 16, 4 heads) with Kimi-K2-Thinking's YaRN rope config.

Data: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (test suites and
site-packages excluded), sorted by relative path; a file is held out when
``crc32(relative path) % 10 == 0`` (so the split of a file does not depend on which other files
an install has). Files are joined with <eos>; training samples random windows.

Load balance: DeepSeek-V3's auxiliary-loss-free method. After every optimizer step each MoE
layer's ``e_score_correction_bias`` (a buffer in transformers) moves by ``+u`` for experts that
received fewer routed tokens than the mean in that step and by ``-u`` for those that received
more. The bias only affects *selection*, never the gate weights.

Importable evaluation API (for the REAP tests)::

    from train_tiny_moe import heldout_ids, heldout_loss, load_kimi_checkpoint, expert_load
    ids = heldout_ids(64 * 256, seed=0)                  # 1-D LongTensor of byte ids
    loss = heldout_loss("tests/fixtures/tiny-moe-trained", ids, seq_len=256)   # nats/byte

CLI (the committed fixture is the default output; deterministic for a seed)::

    python scripts/train_tiny_moe.py [OUT] [--steps 800] [--seed 0] [--overwrite]
"""

from __future__ import annotations

import os

# OpenMP's default spin-waiting makes 2-thread torch ~10x slower on a CPU shared with other
# processes; passive waiting costs nothing when the CPU is idle. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import functools
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixture import FixtureDims, _k2_config

__all__ = [
    "BOS",
    "EOS",
    "TINY_MOE_DIMS",
    "VOCAB",
    "corpus_ids",
    "expert_load",
    "heldout_ids",
    "heldout_loss",
    "load_kimi_checkpoint",
    "save_kimi_layout",
    "stdlib_files",
    "train",
]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
BOS, EOS = 256, 257
VOCAB = 258
META_FILE = "tiny_moe.json"  # training record written next to the weights
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# The fixture's dims with more experts and layers (hidden/intermediates are multiples of 32 so
# INT4/NVFP4 fit) and the byte-level vocabulary.
TINY_MOE_DIMS = FixtureDims(experts=24, moe_layers=3, vocab=VOCAB)


@dataclass(frozen=True)
class TrainArgs:
    steps: int = 800
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 0.005  # DeepSeek-V3's gamma (0.001 there, for 14.8T tokens)
    seed: int = 0


# ----------------------------------------------------------------------------- data


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the stdlib's ``*.py`` sources, sorted; tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _EXCLUDED_DIRS & set(rel.parts[:-1]) or not p.is_file():
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


def _windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
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
    return _windows(corpus_ids("heldout"), n, window, gen).reshape(-1)[:n_tokens].clone()


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


def _batches(seqs: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Batches of equal-length sequences (a shorter tail chunk goes alone)."""
    i = 0
    while i < len(seqs):
        j = i + 1
        while j < len(seqs) and j - i < batch_size and seqs[j].numel() == seqs[i].numel():
            j += 1
        yield torch.stack(seqs[i:j])
        i = j


# ----------------------------------------------------------------------------- configs / io


def kimi_config(dims: FixtureDims = TINY_MOE_DIMS) -> dict[str, Any]:
    """config.json: make_fixture's Kimi-K2-Thinking config (rope/yarn/router fields verbatim)
    at these dims, with byte-level specials and without auto_map (no remote code shipped)."""
    cfg = _k2_config(dims, quantized=False)
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


def _json(obj: Any) -> bytes:
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
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            written[k] = v
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_bytes(_json(index))
    (out / "config.json").write_bytes(_json(config))
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


# ----------------------------------------------------------------------------- evaluation


@contextmanager
def _route_counter(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
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
    for batch in _batches(seqs, batch_size):
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
        with _route_counter(model) as counts:
            for batch in _batches(_as_sequences(texts_or_ids, seq_len), batch_size):
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


# ----------------------------------------------------------------------------- training


def _lr_at(step: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(
    dims: FixtureDims, a: TrainArgs, log: Any = print, device: str = "cpu"
) -> tuple[Any, dict[str, Any]]:
    """Train from scratch; returns the model (weights rounded to BF16 values, on the CPU) and a
    record. ``device`` other than "cpu" is for quick hyper-parameter sweeps only."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(a.seed)
    cfg = deepseek_config(kimi_config(dims), experts="grouped_mm" if device == "cpu" else "eager")
    model = DeepseekV3ForCausalLM(cfg).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": a.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data = corpus_ids("train")
    gen = torch.Generator().manual_seed(a.seed + 1)
    routers = {
        i: layer.mlp.gate
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    }
    t0, c0 = time.time(), time.process_time()
    losses: list[float] = []
    # Without this, 2-thread CPU training is not bitwise reproducible (accumulating index
    # kernels in the experts' backward); with it, same seed + torch + thread count = same bytes.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with _route_counter(model) as counts:
            for step in range(a.steps):
                for g in opt.param_groups:
                    g["lr"] = _lr_at(step, a)
                batch = _windows(data, a.batch_size, a.seq_len, gen).to(device)
                for c in counts.values():
                    c.zero_()
                loss = model(batch, labels=batch).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
                opt.step()
                with torch.no_grad():  # aux-loss-free balancing (DeepSeek-V3 section 2.1.2)
                    for i, gate in routers.items():
                        load = counts[i].float()
                        gate.e_score_correction_bias += a.bias_update_rate * torch.sign(
                            load.mean() - load
                        )
                losses.append(float(loss.detach()))
                if step % 25 == 0 or step == a.steps - 1:
                    spread = " ".join(
                        f"L{i}:{int(c.min())}-{int(c.max())}" for i, c in counts.items()
                    )
                    log(
                        f"step {step:4d} loss {sum(losses[-25:]) / len(losses[-25:]):.4f} "
                        f"lr {_lr_at(step, a):.2e} load(min-max/step) {spread} "
                        f"wall {time.time() - t0:.0f}s cpu {time.process_time() - c0:.0f}s"
                    )
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    record = {
        "steps": a.steps,
        "train_tokens": a.steps * a.batch_size * a.seq_len,
        "train_wall_s": round(time.time() - t0, 1),
        "train_cpu_s": round(time.process_time() - c0, 1),
        "threads": torch.get_num_threads(),
        "final_train_loss_ema25": round(sum(losses[-25:]) / len(losses[-25:]), 4),
    }
    model.cpu().eval()
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():  # the in-memory model becomes exactly what the BF16 files hold
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, record


def verify(
    out: Path, model: Any, written: dict[str, torch.Tensor], ids: torch.Tensor, seq_len: int
) -> tuple[float, float]:
    """Reload with transformers; every saved tensor (experts included) must be in the model,
    and the held-out loss must equal the in-memory model's. Returns (in-memory, reloaded)."""
    re = load_kimi_checkpoint(out)
    state = re.state_dict()
    inter = re.config.moe_intermediate_size
    seen = set()
    for name, t in written.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
            ex = re.model.layers[layer].mlp.experts
            held = {
                "gate_proj": ex.gate_up_proj[e, :inter],
                "up_proj": ex.gate_up_proj[e, inter:],
                "down_proj": ex.down_proj[e],
            }[proj]
            fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
            seen.add(f"model.layers.{layer}.mlp.experts.{fused}")
        else:
            held = state[name]
            seen.add(name)
        if not torch.equal(held, t.float()):
            raise AssertionError(f"{name}: reloaded tensor differs from the saved one")
        if name.endswith("e_score_correction_bias") and t.dtype != torch.float32:
            raise AssertionError(f"{name} must be F32")
    missing = set(state) - seen
    if missing:
        raise AssertionError(f"model tensors never written: {sorted(missing)}")
    for name, t in model.state_dict().items():
        if not torch.equal(state[name], t):
            raise AssertionError(f"{name}: reloaded model differs from the in-memory model")
    mem = heldout_loss(model, ids, seq_len)
    disk = heldout_loss(re, ids, seq_len)
    if abs(mem - disk) > 1e-5:
        raise AssertionError(f"held-out loss in memory {mem} != reloaded {disk}")
    return mem, disk


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=TrainArgs.steps)
    ap.add_argument("--batch-size", type=int, default=TrainArgs.batch_size)
    ap.add_argument("--seq-len", type=int, default=TrainArgs.seq_len)
    ap.add_argument("--lr", type=float, default=TrainArgs.lr)
    ap.add_argument("--bias-update-rate", type=float, default=TrainArgs.bias_update_rate)
    ap.add_argument("--seed", type=int, default=TrainArgs.seed)
    ap.add_argument("--eval-tokens", type=int, default=128 * 256, help="held-out tokens scored")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    a = ap.parse_args(argv)
    import transformers

    out: Path = a.out
    if out.exists() and any(out.iterdir()):
        if not a.overwrite:
            ap.error(f"{out} is not empty (use --overwrite)")
        shutil.rmtree(out)
    torch.set_num_threads(a.threads)
    dims = TINY_MOE_DIMS
    targs = TrainArgs(
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        bias_update_rate=a.bias_update_rate,
        seed=a.seed,
    )
    info = corpus_info()
    print(f"corpus: {json.dumps(info)}", flush=True)
    model, record = train(dims, targs, log=lambda s: print(s, flush=True))

    ev_seq = targs.seq_len
    ids = heldout_ids(a.eval_tokens, seed=0, window=ev_seq)
    train_ids = _windows(
        corpus_ids("train"), a.eval_tokens // ev_seq, ev_seq, torch.Generator().manual_seed(12345)
    ).reshape(-1)
    record["train_loss"] = round(heldout_loss(model, train_ids, ev_seq), 4)
    record["eval"] = {"heldout_tokens": a.eval_tokens, "seq_len": ev_seq, "heldout_seed": 0}
    loads = load_summary(expert_load(model, ids, ev_seq))

    cfg = kimi_config(dims)
    meta = {
        "what": "tiny Kimi-K2-shaped MoE trained by scripts/train_tiny_moe.py",
        "vocab": {"bytes": "0..255", "bos": BOS, "eos": EOS, "size": VOCAB},
        "dims": {k: v for k, v in asdict(dims).items() if k != "vocab"},  # vocab: above
        "train_args": asdict(targs),
        "corpus": info,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "record": record,
        "heldout_expert_load": loads,
    }
    gen_cfg = {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}
    written = save_kimi_layout(model, out, cfg, {"generation_config.json": _json(gen_cfg)})
    mem, disk = verify(out, model, written, ids, ev_seq)
    record["heldout_loss"] = round(disk, 4)
    record["heldout_loss_in_memory"] = round(mem, 4)
    (out / META_FILE).write_bytes(_json(meta))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"train loss {record['train_loss']:.4f}  held-out loss {disk:.4f} nats/byte "
        f"(in memory {mem:.6f}, reloaded {disk:.6f})"
    )
    for layer, s in loads.items():
        print(
            f"layer {layer}: routed share min {s['min_share']:.4f} max {s['max_share']:.4f} "
            f"(uniform {s['uniform_share']:.4f}), dead {s['dead_experts']}"
        )
    print(
        f"{out}: {size / 1e6:.2f} MB, train {record['train_wall_s']}s wall / "
        f"{record['train_cpu_s']}s cpu"
    )


if __name__ == "__main__":
    main()
