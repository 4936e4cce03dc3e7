"""What a calibration pass measured, its files, and the statistics keys of linears."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.calibrate.block_amax import BLOCK_AMAX_STAT, quantiles
from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.model.names import Role, parse_name

STATS_FILE, META_FILE, ACT_FILE = "stats.safetensors", "stats.json", "act_stats.json"
# act_stats.json's per-block amax percentiles of each module (kconvert.calibrate.block_amax):
# absent from files written before calibration kept them.
ACT_BLOCK_P1, ACT_BLOCK_P9999 = "block_amax_p1", "block_amax_p99.99"


ROUTING_CONVENTION = "sigmoid+bias selection, renormalised sigmoid weights x routed_scaling_factor"


GATE_WEIGHT = ("g_j(x) = sigmoid(logit_j) / sum of sigmoid over the chosen top-k (norm_topk_prob) "
               "x routed_scaling_factor: the weight the model applies to expert j's output")


@dataclass
class CalibrationStats:
    """Everything one calibration pass measured.

    `tensors` holds exactly what `stats.safetensors` holds (names in the module docstring);
    `modules` maps each linear's statistics key (`layers.3.experts.7.gate_proj`) to its module
    name in the checkpoint (`model.layers.3.mlp.experts.7.gate_proj`); `meta` is `stats.json`'s
    description of the run.
    """

    meta: dict
    tensors: dict[str, torch.Tensor]
    modules: dict[str, str]

    @property
    def moe_layers(self) -> list[int]:
        return sorted(int(k.split(".")[1]) for k in self.tensors
                      if k.startswith("layers.") and k.endswith(".saliency"))

    def layer(self, layer: int, stat: str) -> torch.Tensor:
        """A per-expert statistic of an MoE layer: saliency, count, gate_sum, reap_sum, ean_sum,
        ean_sq_sum."""
        return self.tensors[f"layers.{layer}.{stat}"]

    def input_amax(self) -> dict[str, float]:
        """{checkpoint module name: input amax}, routed experts that saw no token included (0)."""
        return {module: float(self.tensors[f"{key}.input_amax"])
                for key, module in self.modules.items()}

    def block_amax_quantiles(self) -> dict[str, tuple[float, float]]:
        """{checkpoint module name: (anchor p1, upper p99.99)} of its per-block input amax
        (kconvert.calibrate.block_amax), for the modules whose histogram counts any block;
        empty for statistics written before calibration kept the histograms."""
        out = {}
        for key, module in self.modules.items():
            hist = self.tensors.get(f"{key}.{BLOCK_AMAX_STAT}")
            found = None if hist is None else quantiles(hist)
            if found is not None:
                out[module] = found
        return out

    def act_stats(self) -> dict[str, dict[str, float]]:
        """The `act_stats.json` that `kconvert quantize --act-stats` reads: `input_amax`, and
        per module whose inputs had a non-zero block the two percentiles of its per-block
        amax that `--input-scale headroom` reads (ACT_BLOCK_P1, ACT_BLOCK_P9999).

        A routed expert that no calibration token reached has no measured amax; it gets the
        largest amax of the same projection over the layer's other experts (a zero amax would
        give ModelOpt a zero input scale). Such experts are listed in `meta["unrouted"]`.
        """
        amax = self.input_amax()
        fill: dict[tuple[int, str], float] = {}
        for key, module in self.modules.items():
            parts = key.split(".")
            if parts[2] == "experts":
                slot = (int(parts[1]), parts[4])
                fill[slot] = max(fill.get(slot, 0.0), amax[module])
        for key, module in self.modules.items():
            parts = key.split(".")
            if parts[2] == "experts" and amax[module] == 0.0:
                amax[module] = fill[(int(parts[1]), parts[4])]
        found = sorted(self.block_amax_quantiles().items())
        return {"input_amax": dict(sorted(amax.items())),
                **({ACT_BLOCK_P1: {m: q[0] for m, q in found},
                    ACT_BLOCK_P9999: {m: q[1] for m, q in found}} if found else {})}


@dataclass(frozen=True)
class ActStats:
    """`act_stats.json` as `quantize --act-stats` reads it: each module's input amax, and the
    per-block amax percentiles (CalibrationStats.act_stats; empty in older files)."""

    input_amax: dict[str, float]
    block_amax_p1: dict[str, float]
    block_amax_p9999: dict[str, float]
    path: str | None = None  # the file they were read from


def read_act_stats(path: str | Path) -> ActStats:
    """An act_stats.json, or KconvertError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
        return ActStats(_floats(data["input_amax"]), _floats(data.get(ACT_BLOCK_P1, {})),
                        _floats(data.get(ACT_BLOCK_P9999, {})), str(path))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KconvertError(f"bad activation statistics: {exc}", file=str(path)) from exc


def _floats(by_module: dict) -> dict[str, float]:
    return {k: float(v) for k, v in by_module.items()}


def stats_key(module: str) -> str:
    """Statistics key of a linear's checkpoint module name (see the module docstring)."""
    tn = parse_name(module + ".weight")
    if tn.role is Role.ROUTED_EXPERT:
        return f"layers.{tn.layer}.experts.{tn.expert}.{tn.proj}"
    if tn.role is Role.SHARED_EXPERT:
        return f"layers.{tn.layer}.shared_experts.{tn.proj}"
    if tn.role is Role.DENSE_MLP:
        return f"layers.{tn.layer}.mlp.{tn.proj}"
    if tn.role is Role.ATTENTION:
        return f"layers.{tn.layer}.self_attn.{tn.proj}"
    raise KconvertError("not a decoder-layer linear", tensor=module)


def reduce_over_ranks(sums: list[torch.Tensor], maxima: list[torch.Tensor]) -> None:
    """Every rank's accumulators -> the whole job's, in place: counts and sums added in float64
    (exact but for the order of the additions), amaxes maxed (exact). Nothing without torchrun.
    """
    distributed.all_reduce_(sums, "sum")
    distributed.all_reduce_(maxima, "max")


def save_stats(stats: CalibrationStats, out: str | Path) -> None:
    """Write `stats.safetensors`, `act_stats.json`, then `stats.json` (written last: complete).

    Under torchrun only rank 0 writes: every rank holds the same reduced statistics."""
    if not distributed.is_main():
        return
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(stats.tensors.items())}
    tmp = out / (STATS_FILE + ".tmp")
    # save_file writes through a private (0600) file of its own; give the result the mode a
    # new file gets under the process umask, as the JSON files have.
    tmp.write_bytes(b"")
    mode = tmp.stat().st_mode & 0o777
    try:
        # One metadata key: safetensors keeps metadata in a hash map, so two keys are written
        # in a random order and the same statistics would hash differently (the producer is
        # in stats.json).
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    except SafetensorError as exc:
        tmp.unlink(missing_ok=True)
        # An I/O failure (a full disk) arrives as text: "... (os error 28)". Raised as the
        # OSError it is, the command line names the file and what to do.
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(tmp)) from exc
    os.chmod(tmp, mode)
    os.replace(tmp, out / STATS_FILE)
    _write_json(out / ACT_FILE, stats.act_stats())
    _write_json(out / META_FILE, {**stats.meta, "modules": dict(sorted(stats.modules.items()))})


def load_stats(path: str | Path) -> CalibrationStats:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
        tensors = load_file(str(path / STATS_FILE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise KconvertError(f"unreadable calibration statistics: {exc}", file=str(path)) from exc
    modules = meta.pop("modules", {})
    return CalibrationStats(meta, tensors, modules)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
