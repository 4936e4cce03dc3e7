"""A stand-in for someone else's expert-pruning script (no kconvert code, no manifest).

It does what community REAP / magnitude pruners do to a Kimi-K2 / DeepSeek-V3 checkpoint, with
nothing but safetensors and torch: per MoE layer keep K routed experts chosen by a rule,
renumber them 0..K-1 in ascending source order, slice the router's rows and
`e_score_correction_bias` entries, rename the kept experts' tensors (whatever their format),
drop the rest, set `n_routed_experts` (top level and `text_config`), rewrite the index, and
copy every other file. The plan it followed can be written as JSON for `kconvert audit --plan`.

    python tests/audit/third_party_prune.py SRC DST --keep 8 [--rule router-l2|random|lowest]
        [--seed 0] [--plan-out plan.json]

It loads one whole shard at a time (fine for the tests' tiny checkpoints; that is how many such
scripts work). `kconvert audit DST --source SRC [--plan plan.json]` then checks the result.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
ROUTER = re.compile(r"^(?P<pre>.*\.layers\.(?P<layer>\d+)\.mlp\.gate)\.weight$")
BIAS = re.compile(r"^.*\.layers\.(?P<layer>\d+)\.mlp\.gate\.e_score_correction_bias$")
EXPERT = re.compile(
    r"^(?P<pre>.*\.layers\.(?P<layer>\d+)\.mlp\.experts\.)(?P<e>\d+)(?P<rest>\..+)$")


def choose(router: torch.Tensor, keep: int, rule: str, gen: torch.Generator) -> list[int]:
    """Kept source expert ids (ascending) for one layer's router weight [N, hidden]."""
    n = router.shape[0]
    if rule == "router-l2":  # a data-free magnitude baseline: largest router rows win
        score = router.float().norm(dim=1)
        ids = torch.topk(score, keep).indices
    elif rule == "random":
        ids = torch.randperm(n, generator=gen)[:keep]
    elif rule == "lowest":
        ids = torch.arange(keep)
    else:
        raise ValueError(f"unknown rule {rule}")
    return sorted(int(i) for i in ids)


def prune(src: Path, dst: Path, keep: int, rule: str = "router-l2", seed: int = 0) -> dict:
    """Write the pruned checkpoint into dst (absent or empty); returns the plan followed."""
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    gen = torch.Generator().manual_seed(seed)

    # Pass 1: routers only, to choose the experts of every layer.
    plan: dict[str, dict] = {}
    for shard in shards:
        with safe_open(str(src / shard), "pt") as f:
            for name in f.keys():
                m = ROUTER.match(name)
                if m:
                    w = f.get_tensor(name)
                    ids = choose(w, keep, rule, gen)
                    plan[m["layer"]] = {"keep": ids,
                                        "saliency": w.float().norm(dim=1).tolist()}

    # Pass 2: rewrite each shard.
    weight_map, total = {}, 0
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / shard), "pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                t = f.get_tensor(name)
                if (m := EXPERT.match(name)) and m["layer"] in plan:
                    ids = plan[m["layer"]]["keep"]
                    e = int(m["e"])
                    if e not in ids:
                        continue
                    name = f"{m['pre']}{ids.index(e)}{m['rest']}"
                elif (m := ROUTER.match(name) or BIAS.match(name)) and m["layer"] in plan:
                    t = t[plan[m["layer"]]["keep"]]
                out[name] = t.contiguous()
        save_file(out, str(dst / shard), metadata=metadata)
        for name, t in out.items():
            weight_map[name] = shard
            total += t.numel() * t.element_size()
    (dst / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2))

    config = json.loads((src / "config.json").read_text())
    for c in (config, config.get("text_config")):
        if isinstance(c, dict) and "n_routed_experts" in c:
            c["n_routed_experts"] = keep
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (INDEX, "config.json"):
            shutil.copyfile(p, dst / p.name)
    return {"criterion": rule, "layers": plan}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--keep", type=int, required=True, help="experts kept per MoE layer")
    ap.add_argument("--rule", default="router-l2", choices=["router-l2", "random", "lowest"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-out", type=Path, default=None)
    a = ap.parse_args(argv)
    plan = prune(a.src, a.dst, a.keep, a.rule, a.seed)
    if a.plan_out:
        a.plan_out.write_text(json.dumps(plan, indent=1))
    print(f"{a.dst}: kept {a.keep} experts in {len(plan['layers'])} MoE layers")


if __name__ == "__main__":
    main()
