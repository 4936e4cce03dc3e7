"""Train the Kimi-routed proxy on one GPU and write it as Kimi ships (INT4 routed experts).

The proxy (docs/proxy.md) is a DeepSeek-V3-architecture MoE with Kimi-K2's routing exactly:
384 routed experts, top-8, one shared expert, sigmoid scores with ``e_score_correction_bias``
(noaux_tc, n_group = topk_group = 1, norm_topk_prob, routed_scaling_factor 2.827), MLA
attention, layer 0 dense, 6 decoder layers, and a 4096-token byte-level BPE trained on the
training split of the Python standard library (test suites included).

Two steps, because the corpus must come from one Python install (3.11.7 for the committed
proxy) while training runs on a GPU machine:

    python scripts/train_proxy.py corpus WORK          # CPU: corpus, tokenizer, token ids
    python scripts/train_proxy.py train WORK OUT       # GPU: train, pack INT4, evaluate

``train`` writes OUT as the checkpoint (INT4 routed experts in Kimi's layout, tokenizer,
``proxy.json`` training record); with ``--tar-parts DIR`` it also writes OUT as a tar split
into parts of at most 15 MiB (how it comes back from a GPU machine).

Load balance is DeepSeek-V3's auxiliary-loss-free rule: after every step each MoE layer's bias
moves by ``+rate`` for experts that got fewer routed tokens than the layer mean in that step
and by ``-rate`` for those that got more; the bias only affects selection.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import tarfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kconvert.testing.fixture_config import kimi_quantization_config
from kconvert.testing.proxy import (
    PROXY_DIMS,
    RECORD_FILE,
    corpus_record,
    encode_files,
    load_proxy,
    pack_routed_experts,
    proxy_config,
    remote_code_files,
    split_sources,
    stdlib_sources,
    tokenizer_files,
    train_tokenizer,
)
from kconvert.testing.tiny_moe import deepseek_config, json_bytes, load_summary, save_kimi_layout

# The recipe is for one CUDA GPU; the CPU runs only quick smoke tests of the script.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Recipe:
    steps: int = 6000  # the committed proxy
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3  # DeepSeek-V3's gamma
    seed: int = 0


@dataclass(frozen=True)
class LoopProbe:
    """Greedy continuations of held-out prompts; a continuation loops when its tail repeats one
    cycle of ``1..max_period`` tokens at least ``min_copies`` times over >= ``min_span`` tokens."""

    prompts: int = 200
    prompt_len: int = 32
    new_tokens: int = 128
    max_period: int = 128
    min_copies: int = 3
    min_span: int = 48
    seed: int = 1


def loops(tokens: list[int], max_period: int = 128, min_copies: int = 3, min_span: int = 48
          ) -> bool:
    """Does the sequence end in one cycle repeated (see LoopProbe)?"""
    n = len(tokens)
    for period in range(1, min(max_period, n // min_copies) + 1):
        i = n - 1
        while i >= period and tokens[i] == tokens[i - period]:
            i -= 1
        span = n - 1 - i + period  # the trailing run that has this period
        if span >= max(min_copies * period, min_span):
            return True
    return False


def grouped_experts(self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3Experts forward, computed per expert on tokens sorted by expert:
    under bf16 autocast one grouped GEMM per projection over all experts; otherwise exact fp32
    products of each routed row with its expert's weights. Leaves the routed (token, slot)
    count per expert in ``self.routed``."""
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=self.num_experts)
    self.routed = counts
    x = hidden[token]
    if torch.is_autocast_enabled(hidden.device.type):
        offs = counts.cumsum(0).to(torch.int32)
        gate_up = torch._grouped_mm(x.to(torch.bfloat16),
                                    self.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch._grouped_mm(self.act_fn(gate) * up,
                              self.down_proj.to(torch.bfloat16).transpose(1, 2), offs=offs)
    else:  # each row against its expert's weights: no per-expert loop, exact fp32
        expert = flat[order]
        gate, up = torch.einsum("rh,roh->ro", x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        y = torch.einsum("ri,rhi->rh", self.act_fn(gate) * up, self.down_proj[expert])
    y = y.float() * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros(n, hidden.shape[-1], device=hidden.device, dtype=torch.float32)
    return out.index_add_(0, token, y).to(hidden.dtype)


def fp32_router(forward: Any) -> Any:
    """Kimi routes in fp32; autocast would otherwise run the router's matmul in bf16."""

    def route(hidden: torch.Tensor) -> Any:
        with torch.autocast(hidden.device.type, enabled=False):
            return forward(hidden)

    return route


def moe_blocks(model: Any) -> dict[int, Any]:
    layers = enumerate(model.model.layers)
    return {i: layer.mlp for i, layer in layers if hasattr(layer.mlp, "gate")}


def prepare(model: Any) -> Any:
    for mlp in moe_blocks(model).values():
        mlp.experts.forward = types.MethodType(grouped_experts, mlp.experts)
        mlp.gate.forward = fp32_router(mlp.gate.forward)
    return model


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    offsets = torch.arange(length, device=stream.device)
    return stream[starts.to(stream.device).unsqueeze(1) + offsets]


def train(cfg: dict[str, Any], data: torch.Tensor, probe_seqs: torch.Tensor, r: Recipe, log: Any
          ) -> tuple[Any, dict]:
    """Train from scratch; ``probe_seqs`` (held-out windows) are scored every 500 steps to show
    the held-out trend in the log and the record (nothing is selected on them)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(r.seed)
    # transformers rewrites the nested rope_scaling dict it is given; config.json keeps Kimi's
    config = deepseek_config(copy.deepcopy(cfg), attn="sdpa")
    model = prepare(DeepseekV3ForCausalLM(config).to(DEVICE).train())
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": r.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=r.lr, betas=(0.9, 0.95), eps=1e-8, fused=DEVICE == "cuda")
    gen = torch.Generator().manual_seed(r.seed + 1)
    blocks = moe_blocks(model)
    curve, heldout_curve, window_loss = [], [], torch.zeros((), device=DEVICE)
    t0 = time.time()
    for step in range(r.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        starts = torch.randint(0, data.numel() - r.seq_len, (r.batch_size,), generator=gen)
        batch = windows(data, starts, r.seq_len)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = model(batch).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, r.grad_clip)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing (DeepSeek-V3 section 2.1.2)
            for mlp in blocks.values():
                load = mlp.experts.routed.float()
                mlp.gate.e_score_correction_bias += r.bias_update_rate * torch.sign(
                    load.mean() - load)
            window_loss += loss.detach()
        if (step + 1) % 100 == 0 or step == r.steps - 1:
            n = (step % 100) + 1
            mean = float(window_loss) / n
            window_loss.zero_()
            curve.append([step + 1, round(mean, 4)])
            if (step + 1) % 500 == 0 or step == r.steps - 1:
                with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
                    logits = model(probe_seqs).logits.float()
                probe = float(F.cross_entropy(logits[:, :-1].flatten(0, 1),
                                              probe_seqs[:, 1:].flatten()))
                heldout_curve.append([step + 1, round(probe, 4)])
                log(f"step {step + 1} held-out probe {probe:.4f}")
            spread = " ".join(f"L{i}:{int(m.experts.routed.min())}-{int(m.experts.routed.max())}"
                              for i, m in blocks.items())
            log(f"step {step + 1} loss {mean:.4f} lr {lr_at(step, r):.2e} load {spread} "
                f"{time.time() - t0:.0f}s")
    wall = time.time() - t0
    model.eval()
    with torch.no_grad():  # the in-memory model becomes exactly what the BF16 files hold
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    tokens = r.steps * r.batch_size * r.seq_len
    return model, {"steps": r.steps, "tokens": tokens, "epochs": round(tokens / data.numel(), 2),
                   "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall),
                   "loss_per_100_steps": curve, "heldout_probe_per_500_steps": heldout_curve,
                   "heldout_probe": f"{len(probe_seqs)} held-out windows, bf16 autocast"}


@torch.no_grad()
def heldout_eval(model: Any, seqs: torch.Tensor, batch: int = 32) -> tuple[float, dict]:
    """Mean next-token CE (nats/token, fp32) over rows of ``seqs``, and routed counts."""
    total, count = 0.0, 0
    blocks = moe_blocks(model)
    routed = {i: torch.zeros(m.experts.num_experts, dtype=torch.long, device=DEVICE)
              for i, m in blocks.items()}
    for rows in seqs.split(batch):
        logits = model(rows).logits.float()
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten(),
                                       reduction="sum").double())
        count += rows[:, 1:].numel()
        for i, m in blocks.items():
            routed[i] += m.experts.routed
    return total / count, {i: c.cpu() for i, c in routed.items()}


@torch.no_grad()
def greedy(model: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model(prompts, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [nxt]
    for _ in range(new_tokens - 1):
        out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(nxt)
    return torch.cat(generated, dim=1)


def loop_rate(model: Any, heldout: torch.Tensor, probe: LoopProbe, tok: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(probe.seed)
    starts = torch.randint(0, heldout.numel() - probe.prompt_len, (probe.prompts,), generator=gen)
    prompts = windows(heldout, starts, probe.prompt_len)
    conts = greedy(model, prompts, probe.new_tokens).tolist()
    flags = [loops(c, probe.max_period, probe.min_copies, probe.min_span) for c in conts]
    looped = [i for i, f in enumerate(flags) if f]
    shown = [*looped[:2], 0]  # two loops and the first prompt's continuation
    return {"rate": round(sum(flags) / len(flags), 4), "looped": len(looped),
            "examples": [{"prompt": tok.decode(prompts[i].tolist()),
                          "continuation": tok.decode(conts[i])} for i in shown]}


def bigram_loss(train_ids: torch.Tensor, heldout: torch.Tensor, vocab: int) -> dict[str, float]:
    """Held-out CE of a bigram model (counts from the training split, Dirichlet-smoothed
    towards the unigram); the prior is the best of a few on the held-out text itself, so the
    baseline is as strong as a bigram gets."""
    pairs = torch.bincount(train_ids[:-1] * vocab + train_ids[1:], minlength=vocab * vocab)
    pairs = pairs.view(vocab, vocab).double()
    uni = torch.bincount(train_ids, minlength=vocab).double() + 1
    uni /= uni.sum()
    a, b = heldout[:-1], heldout[1:]
    losses = {beta: float(-((pairs[a, b] + beta * uni[b]) / (pairs.sum(1)[a] + beta)).log().mean())
              for beta in (0.1, 1.0, 10.0, 100.0, 1000.0)}
    best = min(losses, key=losses.get)
    return {"loss": round(losses[best], 4), "prior": best}


def corpus_main(work: Path, vocab: int) -> None:
    splits = split_sources(stdlib_sources())
    tok = train_tokenizer([t for _, t in splits["train"]], vocab)
    work.mkdir(parents=True, exist_ok=True)
    for name, data in tokenizer_files(tok).items():
        (work / name).write_bytes(data)
    record = corpus_record(splits)
    for name, files in splits.items():
        ids = encode_files(tok, [t for _, t in files])
        np.save(work / f"{name}.npy", ids)
        record[name]["tokens"] = int(ids.size)
    (work / "corpus.json").write_bytes(json_bytes(record))
    print(json.dumps(record, indent=1))


def train_main(a: argparse.Namespace) -> None:
    import transformers
    from tokenizers import Tokenizer

    t_start = time.time()
    work, out = a.work, a.out
    r = Recipe(steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, seed=a.seed)
    probe = LoopProbe(prompts=a.loop_prompts)
    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    train_ids = torch.from_numpy(np.load(work / "train.npy").astype(np.int64)).to(DEVICE)
    heldout = torch.from_numpy(np.load(work / "heldout.npy").astype(np.int64)).to(DEVICE)
    cfg = proxy_config(PROXY_DIMS)
    gen = torch.Generator().manual_seed(0)
    n_win = heldout.numel() // r.seq_len
    pick = torch.randperm(n_win, generator=gen)[: a.eval_windows].sort().values * r.seq_len
    seqs = windows(heldout, pick, r.seq_len)
    model, record = train(cfg, train_ids, seqs[:32], r, lambda s: print(s, flush=True))
    bf16_loss, bf16_routed = heldout_eval(model, seqs)
    print(f"held-out BF16 {bf16_loss:.4f} at {time.time() - t_start:.0f}s", flush=True)
    bf16_loops = loop_rate(model, heldout, probe, tok)
    print(f"loop rate BF16 {bf16_loops['rate']} at {time.time() - t_start:.0f}s", flush=True)
    side = tokenizer_files(tok) | remote_code_files() | {"generation_config.json": json_bytes(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False})}
    save_kimi_layout(model.cpu(), out, cfg, side)
    pack_routed_experts(out, kimi_quantization_config())
    print(f"INT4 checkpoint written at {time.time() - t_start:.0f}s", flush=True)
    int4 = prepare(load_proxy(out, attn="sdpa").to(DEVICE))
    int4_loss, int4_routed = heldout_eval(int4, seqs)
    check = seqs[:4, :256]
    check_loss, _ = heldout_eval(int4, check)
    int4_loops = loop_rate(int4, heldout, probe, tok)
    loads = load_summary(int4_routed)
    for layer, c in int4_routed.items():
        loads[str(layer)]["tokens"] = c.tolist()
    corpus = json.loads((work / "corpus.json").read_text())
    meta = {
        "what": "Kimi-routed proxy trained by scripts/train_proxy.py (docs/proxy.md)",
        "dims": asdict(PROXY_DIMS), "recipe": asdict(r), "corpus": corpus,
        "tokenizer": {"type": "byte-level BPE", "vocab": tok.get_vocab_size(), "bos": 0, "eos": 1},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "train": record,
        "heldout": {"windows": len(seqs), "seq_len": r.seq_len, "tokens": seqs.numel(),
                    "selection": "torch.randperm(windows, Generator(seed 0)), sorted",
                    "loss_bf16": round(bf16_loss, 4), "loss_int4": round(int4_loss, 4),
                    "bigram": bigram_loss(train_ids, heldout, cfg["vocab_size"]),
                    "dead_experts_bf16": sum(int((c == 0).sum()) for c in bf16_routed.values()),
                    "expert_load_int4": loads},
        "loop_probe": asdict(probe) | {"bf16": bf16_loops, "int4": int4_loops,
                                       "decoding": "greedy, fp32, no stop at [EOS]"},
        "check_sequences": {"ids": check.tolist(), "loss_int4": round(check_loss, 6)},
        "script_wall_s": round(time.time() - t_start, 1),
    }
    (out / RECORD_FILE).write_bytes(json_bytes(meta))
    h = meta["heldout"]
    print(f"held-out BF16 {h['loss_bf16']} INT4 {h['loss_int4']} bigram {h['bigram']} | "
          f"loops BF16 {bf16_loops['rate']} INT4 {int4_loops['rate']} | dead "
          f"{[v['dead_experts'] for v in loads.values()]} | {meta['script_wall_s']}s", flush=True)
    if a.tar_parts:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(out, arcname=out.name)
        data, part = buf.getvalue(), 15 << 20
        a.tar_parts.mkdir(parents=True, exist_ok=True)
        for i in range(0, len(data), part):
            (a.tar_parts / f"{out.name}.tar.{i // part}").write_bytes(data[i:i + part])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="CPU: corpus, tokenizer and token ids into WORK")
    c.add_argument("work", type=Path)
    c.add_argument("--vocab", type=int, default=PROXY_DIMS.vocab)
    t = sub.add_parser("train", help="GPU: train on WORK, write the INT4 checkpoint to OUT")
    t.add_argument("work", type=Path)
    t.add_argument("out", type=Path)
    t.add_argument("--steps", type=int, default=Recipe.steps)
    t.add_argument("--batch-size", type=int, default=Recipe.batch_size)
    t.add_argument("--seq-len", type=int, default=Recipe.seq_len)
    t.add_argument("--lr", type=float, default=Recipe.lr)
    t.add_argument("--seed", type=int, default=Recipe.seed)
    t.add_argument("--eval-windows", type=int, default=1024, help="held-out windows scored")
    t.add_argument("--loop-prompts", type=int, default=LoopProbe.prompts)
    t.add_argument("--tar-parts", type=Path, help="also write OUT as a tar in 15 MiB parts here")
    a = ap.parse_args()
    if a.cmd == "corpus":
        corpus_main(a.work, a.vocab)
    else:
        train_main(a)


if __name__ == "__main__":
    main()
