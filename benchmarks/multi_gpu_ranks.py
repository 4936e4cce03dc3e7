"""One kconvert command on N ranks of one host (the plain CLI for one rank, torchrun for N),
timed whole, and what rank 0's -v lines say of the MoE layers' seconds; `Bench`, the settings
and results multi_gpu's parts share."""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.calibrate import LAYER_LINE
from benchmarks.child_process import child_env, run_child
from benchmarks.harness import REPO, Timer, drop_page_cache, save
from benchmarks.synthetic import Dims

# A -v line of kconvert.methods.hessians: where a MoE layer's seconds went in GPTQ/SparseGPT.
OBS_LINE = re.compile(r"INFO: OBS layer (?P<layer>\d+): (?P<waited>[\d.]+) s waiting for its "
                      r"calibration forward, (?P<solving>[\d.]+) s solving it")
# rank 0's -v line of a repaired MoE layer (kconvert.pruning.repair), its learned phase
LEARNED_LINE = re.compile(r"INFO: layer (?P<layer>\d+) repair: .*?learned compensation "
                          r"(?P<seconds>[\d.]+) s")
REPAIR_LINE = re.compile(r"layer \d+ repair: .*")
# NCCL's NVLink multicast off for every rank, as the device machines require.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


# The learned method's line per work item under -v (kconvert.methods.learned.Learned.transform)
ITEM = re.compile(r"layer (\d+) experts \d+-\d+: (.*?); learned written")
PHASE = re.compile(r"([a-z -]+?) ([0-9.]+) s")

def layer_seconds(log: str) -> dict[str, dict]:
    """Per MoE layer (from `-v`'s item lines): seconds per phase summed over its items, the
    total, the first item's, and `steady_s` (every item at the median of the later ones)."""
    items: dict[str, list[dict[str, float]]] = {}
    for layer, phases in ITEM.findall(log):
        items.setdefault(layer, []).append({k.strip(): float(v) for k, v in
                                            PHASE.findall(phases)})
    out = {}
    for layer, rows in items.items():
        totals = [sum(r.values()) for r in rows]
        later = totals[1:] or totals
        out[layer] = {"items": len(rows), "total_s": round(sum(totals), 2),
                      "first_item_s": round(totals[0], 2),
                      "steady_s": round(statistics.median(later) * len(rows), 2),
                      "phases_s": {k: round(sum(r.get(k, 0.0) for r in rows), 2)
                                   for k in rows[0]}}
    return out


@dataclass
class Bench:
    root: Path
    ranks: list[int]
    dev: str
    dims: Dims
    seq: int
    batch: int
    tokens: dict[str, int]  # label -> sequences
    gptq_seqs: int
    repair_seqs: int  # reap-learned's sequences
    eval_seqs: int
    n_experts: int  # the convert part's set
    shards: int
    eval_repeat: bool
    keep_page_cache: bool
    timer: Timer
    out: Path
    res: dict

    def save(self) -> None:
        save(self.res, self.out)

    def past_deadline(self, what: str) -> bool:
        """True (and `what` recorded as skipped) once --deadline-s has passed."""
        if not self.timer.late():
            return False
        self.res.setdefault("skipped", []).append(what)
        return True

    def run(self, ranks: int, args: list[str], drop: bool = False) -> dict:
        """One command on `ranks` ranks: wall seconds, exit status, the -v layer lines of
        rank 0 and the MoE layers' seconds."""
        if drop:
            drop_page_cache(self.keep_page_cache)
        c = run_child([*launcher(ranks), *args], env=child_env(**NO_MULTICAST), cwd=REPO)
        res: dict = {"ranks": ranks, "rc": c.rc, "wall_s": round(c.wall_s, 2),
                     "peak_rss_gb": c.peak_rss_gb}
        layers = [{"layer": m["label"], "wall": float(m["wall"]), "read": float(m["read"]),
                   "compute": float(m["compute"])} for m in LAYER_LINE.finditer(c.stderr)]
        if layers:
            res["layers"] = layers
            res["moe_layer_s"] = round(sum(lay["wall"] for lay in layers
                                           if not lay["layer"].endswith("layer 0")), 2)
        obs = [{"layer": int(m["layer"]), "waited": float(m["waited"]),
                "solving": float(m["solving"])} for m in OBS_LINE.finditer(c.stderr)]
        if obs:
            # the last MoE layer's: the forward its engine waited for and its solve (with one
            # MoE layer the wait holds the start-up and layer 0 too: --moe-layers 2 for GPTQ)
            res["obs_layers"] = obs
            res["moe_layer_s"] = round(obs[-1]["waited"] + obs[-1]["solving"], 2)
        items = layer_seconds(c.stderr)
        if items:  # a learned method's work items, per MoE layer and phase
            res["learned_items"] = items
        learned = [float(m["seconds"]) for m in LEARNED_LINE.finditer(c.stderr)]
        if learned:
            res["learned_layers_s"] = learned  # per repaired MoE layer
            res["learned_s"] = round(sum(learned), 2)
            # rank 0's seconds per phase of each layer's repair
            res["repair_lines"] = [m.group(0) for m in REPAIR_LINE.finditer(c.stderr)]
        notes = [ln.strip() for ln in c.stderr.splitlines() if "one process may be as fast" in ln]
        if notes:
            res["note"] = notes[0]
        if c.rc:
            res["errors"] = [ln.strip() for ln in c.stderr.splitlines()
                             if "error" in ln.lower() and "elastic" not in ln][:6]
            res["tail"] = (c.stdout[-1500:] + c.stderr[-2500:]).strip()
        return res

    def each_rank_count(self, what: str, run) -> dict[int, dict]:
        """`run(ranks)` for every rank count not past the deadline -> its result."""
        out = {}
        for ranks in self.ranks:
            if not self.past_deadline(f"{what} {ranks} ranks"):
                out[ranks] = run(ranks)
        return out


def launcher(ranks: int) -> list[str]:
    """Rank 0's output only: every rank logs its own -v lines."""
    if ranks == 1:
        return [sys.executable, "-m", "kconvert"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "--local-ranks-filter=0", "-m", "kconvert"]
