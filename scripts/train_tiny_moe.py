"""Train a tiny, real Kimi-K2-shaped MoE on the Python standard library and save it in Kimi layout.

REAP needs a *trained* mixture of experts to measure pruning quality: random weights
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

The model's data, layout and evaluation are in kconvert.testing.tiny_moe::

    from kconvert.testing.tiny_moe import heldout_ids, heldout_loss
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
import json
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.tiny_moe import (
    BOS,
    EOS,
    META_FILE,
    TINY_MOE_DIMS,
    VOCAB,
    corpus_ids,
    corpus_info,
    deepseek_config,
    expert_load,
    heldout_ids,
    heldout_loss,
    json_bytes,
    kimi_config,
    load_kimi_checkpoint,
    load_summary,
    route_counter,
    save_kimi_layout,
    windows,
)

ROOT = Path(__file__).resolve().parent.parent


DEFAULT_OUT = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


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
        with route_counter(model) as counts:
            for step in range(a.steps):
                for g in opt.param_groups:
                    g["lr"] = _lr_at(step, a)
                batch = windows(data, a.batch_size, a.seq_len, gen).to(device)
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
    ap.add_argument("--experts", type=int, default=TINY_MOE_DIMS.experts, help="routed experts")
    ap.add_argument("--top-k", type=int, default=TINY_MOE_DIMS.top_k)
    ap.add_argument("--moe-intermediate", type=int, default=TINY_MOE_DIMS.moe_intermediate)
    ap.add_argument("--moe-layers", type=int, default=TINY_MOE_DIMS.moe_layers)
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    a = ap.parse_args(argv)
    import transformers

    out: Path = a.out
    if out.exists() and any(out.iterdir()):
        if not a.overwrite:
            ap.error(f"{out} is not empty (use --overwrite)")
        shutil.rmtree(out)
    torch.set_num_threads(a.threads)
    dims = replace(
        TINY_MOE_DIMS,
        experts=a.experts,
        top_k=a.top_k,
        moe_intermediate=a.moe_intermediate,
        moe_layers=a.moe_layers,
    )
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
    train_ids = windows(
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
    written = save_kimi_layout(model, out, cfg, {"generation_config.json": json_bytes(gen_cfg)})
    mem, disk = verify(out, model, written, ids, ev_seq)
    record["heldout_loss"] = round(disk, 4)
    record["heldout_loss_in_memory"] = round(mem, 4)
    (out / META_FILE).write_bytes(json_bytes(meta))
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
