"""REAP expert pruning: calibration scores -> a plan, which the `prune` stage
(kconvert.stages.prune) checks against the checkpoint and applies.

The plan keeps the N highest-scoring routed experts of every MoE layer (ties: lower id),
listed in ascending source order (reap.md). Criteria: `reap` (saliency: mean over routed
tokens of gate weight x ||expert output||), `frequency` (routed-token count) and `ean` (sum
over routed tokens of ||expert output||). A given plan file (`--plan`) is applied as is, after
checking it against the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from kconvert.calibrate.stats import STATS_FILE
from kconvert.errors import KconvertError, UsageError
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name
from kconvert.plugins.pruning import CRITERIA, PRUNE
from kconvert.pruning.plan import PruneLayer, PrunePlan

# The per-layer statistics the criteria are computed from (`calibrate` writes them).
SCORE_STATS = ("saliency", "count", "ean_sum", "ean_sq_sum")
# How a multi-token-prediction layer keeps its experts where the statistics hold no scores of
# it (made before kconvert's calibration ran MTP layers, or by another tool; docs/mtp.md):
# every expert of it has the same (no) evidence, so the criteria's own tie rule, lower id
# first, decides.
MTP_RULE = "uncalibrated-lowest-ids"


def with_means(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The scores with MAN and MSAN (arXiv 2606.15716): the routed-token means of the
    gate-free expert output norm ||f_j(x)|| and of its square (0 for a never-routed expert);
    MSAN needs `ean_sq_sum`, which statistics from before it existed lack."""
    count = s["count"].clamp(min=1)
    out = dict(s, man=s["ean_sum"] / count)
    if "ean_sq_sum" in s:
        out["msan"] = s["ean_sq_sum"] / count
    return out


def scores_from_stats(stats_dir: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per MoE layer: saliency, count and ean_sum per source expert, from `calibrate` output."""
    path = Path(stats_dir) / STATS_FILE
    if not path.is_file():
        raise KconvertError("no stats.safetensors in the statistics directory", file=str(path))
    layers: dict[int, dict[str, torch.Tensor]] = {}
    # Only the per-layer score vectors: the file also holds ~1.5 GB of Wanda column norms.
    with safe_open(str(path), "pt") as fh:
        for name in fh.keys():
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == "layers" and parts[2] in SCORE_STATS:
                layers.setdefault(int(parts[1]), {})[parts[2]] = fh.get_tensor(name).double()
    if not layers:
        raise KconvertError("statistics hold no per-layer expert scores", file=str(path))
    return dict(sorted(layers.items()))


def scores_of(stats) -> dict[int, dict[str, torch.Tensor]]:
    """The same per-layer scores from an in-memory `calibrate.CalibrationStats`."""
    return {layer: {k: stats.layer(layer, k).double() for k in SCORE_STATS}
            for layer in stats.moe_layers}


def statistic(criterion: str) -> str:
    """The per-expert statistic criterion `criterion` keeps the highest of (its class,
    kconvert.pruning.kinds)."""
    declared = CRITERIA.get(PRUNE[0], criterion)
    if declared is None:
        raise KconvertError(f"unknown criterion {criterion!r}; choose from "
                            f"{sorted(CRITERIA.names())}")
    return declared.load().statistic


def plan_from_scores(scores: dict[int, dict[str, torch.Tensor]], keep: int, criterion: str,
                     source: dict | None = None, mtp_layers: Iterable[int] = ()) -> PrunePlan:
    """Keep the `keep` highest-scoring experts of every scored layer; each of `mtp_layers`
    (the checkpoint's multi-token-prediction layers) without scores keeps its `keep` lowest
    ids, the plan saying so (MTP_RULE), so that every MoE layer keeps one count."""
    ranked_by = statistic(criterion)
    layers = {}
    for layer, raw in scores.items():
        s = with_means(raw)
        if ranked_by not in s:
            raise KconvertError(f"criterion {criterion} needs statistics this calibration did "
                                "not record (re-run `kconvert calibrate`)")
        score = s[ranked_by]
        if keep > score.numel():
            raise KconvertError(f"--keep {keep} exceeds the {score.numel()} experts of layer "
                                f"{layer}")
        layers[str(layer)] = PruneLayer(
            keep=keep_ids(score, keep),
            saliency=s["saliency"].tolist() if "saliency" in s else None,
            frequency=s["count"].tolist() if "count" in s else None,
            ean=s["ean_sum"].tolist() if "ean_sum" in s else None,
        )
    for layer in mtp_layers:
        layers.setdefault(str(layer), PruneLayer(keep=list(range(keep)), rule=MTP_RULE))
    n_routed = next(iter(scores.values()))["count"].numel()
    return PrunePlan(criterion=criterion, routing="model", source=source,
                     n_routed_experts=n_routed, layers=layers)


def note_mtp_layers(plan: PrunePlan, echo: Callable[[str], None]) -> None:
    """Say which layers kept their experts by MTP_RULE rather than by the criterion, and,
    in a plan with router repair or compensation, which layers have no record of it (the
    multi-token-prediction layers: the repair stream runs the decoder layers, docs/mtp.md)."""
    ruled = [int(k) for k, v in plan.layers.items() if v.rule == MTP_RULE]
    if ruled:
        echo(f"kconvert: warning: multi-token-prediction layer(s) {', '.join(map(str, ruled))} "
             f"keep their {len(plan.layers[str(ruled[0])].keep)} lowest expert ids: the "
             "statistics hold no scores of them, so no criterion ranks their experts "
             "(docs/mtp.md; calibrate again, or give a --plan naming their keep)")
    if plan.repair or plan.compensation:
        bare = [int(k) for k, v in plan.layers.items() if v.repair is None
                and v.compensation is None]
        if bare:
            echo(f"note: multi-token-prediction layer(s) {', '.join(map(str, bare))} are "
                 "pruned without router repair or compensation: the repair stream runs the "
                 "decoder layers only (docs/mtp.md)")


def keep_ids(score: torch.Tensor, keep: int) -> list[int]:
    """The `keep` highest-scoring expert ids, ascending; lower id first among equal scores
    (stable and reproducible)."""
    order = sorted(range(score.numel()), key=lambda e: (-float(score[e]), e))
    return sorted(order[:keep])


def moe_layers(ckpt: Checkpoint) -> dict[int, int]:
    """Layer -> number of routed experts found in the checkpoint's tensors."""
    experts: dict[int, set[int]] = {}
    for name in ckpt.weight_map:
        tn = parse_name(name)
        if tn.role is Role.ROUTED_EXPERT:
            experts.setdefault(tn.layer, set()).add(tn.expert)
    return {layer: len(ids) for layer, ids in sorted(experts.items())}


def mtp_moe_layers(ckpt: Checkpoint) -> list[int]:
    """The multi-token-prediction layers (num_nextn_predict_layers) that hold routed experts."""
    mtp = arch_of(ckpt.text_config).mtp_layers
    return [layer for layer in moe_layers(ckpt) if layer in mtp]


def repaired_tensors(plan: PrunePlan, ckpt: Checkpoint,
                     rows: dict[int, tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[tuple[str, torch.Tensor], ...]:
    """(router tensor name, repaired tensor) of every repaired layer, checked against the
    plan's records: the row hashes and bias entries it says were written."""
    repaired = {int(k): v.repair for k, v in plan.layers.items() if v.repair is not None}
    if set(repaired) != set(rows):
        raise KconvertError("the plan records repaired router rows, which only a calibration "
                            "run can compute (they are not in the plan file): run with --data "
                            "and --repair" if repaired else "repaired rows for a plan that "
                            "records no repair")
    out = []
    for name in ckpt.weight_map:
        tn = parse_name(name)
        if tn.layer not in repaired or tn.role not in (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS):
            continue
        weight, bias = rows[tn.layer]
        record = repaired[tn.layer]
        if (row_hashes(weight) != record.gate_rows_xxh3
                or bias.tolist() != record.bias or bias.dtype != torch.float32):
            raise KconvertError(f"layer {tn.layer}: repaired rows differ from the plan's record",
                                tensor=name)
        out.append((name, weight if tn.role is Role.ROUTER_WEIGHT else bias))
    return tuple(out)


def compensated_tensors(plan: PrunePlan, matrices: dict[str, torch.Tensor]
                        ) -> tuple[tuple[str, torch.Tensor], ...]:
    """(output name, re-fitted matrix) of every compensated layer, checked against the
    plan's records (xxh3-128 of the bytes)."""
    recorded = {name: digest for v in plan.layers.values() if v.compensation is not None
                for name, digest in v.compensation.matrices_xxh3.items()}
    if set(recorded) != set(matrices):
        raise KconvertError("the plan records re-fitted down_proj matrices, which only a "
                            "calibration run can compute (they are not in the plan file): run "
                            "with --data and --compensate" if recorded else "re-fitted "
                            "matrices for a plan that records no compensation")
    for name, t in matrices.items():
        if tensor_hash(t) != recorded[name]:
            raise KconvertError("re-fitted matrix differs from the plan's record", tensor=name)
    return tuple(sorted(matrices.items()))


def tensor_hash(t: torch.Tensor) -> str:
    """xxh3-128 (hex) of a tensor's bytes, as the manifest hashes written tensors."""
    return xxhash.xxh3_128_hexdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy()
                                     .tobytes())


def row_hashes(rows: torch.Tensor) -> list[str]:
    """xxh3-64 (hex) of each row's bytes, as written."""
    raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    return [xxhash.xxh3_64_hexdigest(raw[i].numpy().tobytes()) for i in range(rows.shape[0])]


def routing_limits(ckpt: Checkpoint) -> tuple[int, int]:
    """(routed experts, the router's top-k) from the config (n_routed_experts and
    num_experts_per_tok, Kimi-K3's num_experts and num_experts_per_token), both required
    positive integers: without the top-k no keep can be checked against the router's
    (transformers' default, 8, would then refuse a model pruned below it)."""
    text, out = ckpt.text_config, []
    arch = arch_of(text)
    for key in (arch.experts_key, arch.top_k_key):
        value = text.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found = "is missing" if value is None else f"is {value!r}, not a positive integer"
            raise KconvertError(f"{key} {found}; pruning needs it",
                                file=str(ckpt.root / "config.json"))
        out.append(value)
    return out[0], out[1]


def check_plan_keep(plan: PrunePlan, ckpt: Checkpoint, keep: int | None,
                    prune_ratio: float | None, where: str) -> None:
    """--keep N (or --prune-ratio R) beside --plan: allowed when it asks for the plan's own
    count, a usage error naming both numbers otherwise."""
    if keep is None and prune_ratio is None:
        return
    asked = keep_count(ckpt, keep, prune_ratio)
    counts = sorted({len(v.keep) for v in plan.layers.values()})
    if counts != [asked]:
        option = f"--keep {keep}" if keep is not None else f"--prune-ratio {prune_ratio}"
        raise UsageError(f"{option} asks for {asked} experts per layer, but the plan {where} "
                         f"keeps {', '.join(map(str, counts))}")


def keep_count(ckpt: Checkpoint, keep: int | None, prune_ratio: float | None) -> int:
    """Routed experts to keep per layer from --keep N or --prune-ratio R, checked against the
    config: at least num_experts_per_tok (the router's top-k), at most n_routed_experts."""
    if (keep is None) == (prune_ratio is None):
        raise KconvertError("give exactly one of --keep N and --prune-ratio R")
    config = str(ckpt.root / "config.json")
    n_routed, top_k = routing_limits(ckpt)
    arch = arch_of(ckpt.text_config)
    if keep is None:
        if not 0 <= prune_ratio < 1:
            raise KconvertError(f"--prune-ratio {prune_ratio} is not in [0, 1)")
        keep = round(n_routed * (1 - prune_ratio))
        asked = f"--prune-ratio {prune_ratio} of {n_routed} experts keeps {keep}"
    else:
        asked = f"--keep {keep}"
    if keep > n_routed:
        raise KconvertError(f"{asked}: more than the {arch.experts_key}={n_routed}", file=config)
    if keep < top_k:
        raise KconvertError(f"{asked}: fewer than {arch.top_k_key}={top_k}, the experts the "
                            "router picks per token; keep at least that many", file=config)
    return keep
