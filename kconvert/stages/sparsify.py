"""The `sparsify` stage (paired-4:8 on routed experts, docs/p48.md).

Sparsify claims the routed experts' gate/up/down (shared experts are never sparsified) and
transforms their decoded fp32 weights before the quantize stage encodes them:
  magnitude  keep the 2 pairs of every 8-chunk with the largest |w_2p| + |w_2p+1|
  wanda      the same on |W_ij| * ||X_j||_2, X_j from `kconvert calibrate` (input_sq_sum)
  sparsegpt  joint OBS prune + NVFP4 quantize (kconvert.methods.sparsegpt) on calibration inputs,
             each layer's from the already-compressed model (`hessian` "sequential") or from the
             unpruned source ("source")
Every mask is chosen per chunk before any block scale, so NVFP4's block scales are computed
after the mask (a pruned outlier never inflates a scale); pruned pairs are +0.0, encoded 0x00.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from kconvert.calibrate.stats import META_FILE, STATS_FILE
from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError, UsageError
from kconvert.formats import p48
from kconvert.formats.linear import ModuleWork
from kconvert.gpu_plan import GpuPlan, GpuWork, Shapes
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.files import hash_file
from kconvert.methods import obs, sparsegpt
from kconvert.methods.hessians import Calibration
from kconvert.model.names import Role
from kconvert.options import (
    HESSIANS,
    SPARSEGPT_SAMPLES,
    SPARSIFY_METHODS,
    SPARSIFY_STORAGES,
    calibration_run,
)
from kconvert.stages.base import CALIBRATION_OPTIONS, StageKind

METHODS = SPARSIFY_METHODS
STORAGES = SPARSIFY_STORAGES


GROUP_SIZES = (16, 32)


# SparseGPT's calibration inputs by default: measured on the trained tiny MoE
# (benchmarks/results/sparsegpt_hessian_tiny_moe.md).
DEFAULT_HESSIAN = "source"


class SparsifyRecord(StageRecord):
    pattern: Literal["p48"]
    method: str = Field(description="magnitude | wanda | sparsegpt")
    group_size: int
    storage: str = Field(description="dense | pair-bitmask")
    targets: list[str] = Field(description="roles made paired-4:8 sparse")
    stats: str | None = Field(default=None, description="xxh3 of Wanda's stats.safetensors")
    percdamp: float | None = None
    blocksize: int | None = None
    hessian: str | None = Field(default=None, description="sparsegpt: source | sequential")
    data: dict | None = Field(default=None, description="SparseGPT's calibration data")


class WandaNorms:
    """||X_j||_2 per input column of each routed linear, read lazily from calibrate's
    `stats.safetensors` (`<key>.input_sq_sum`), so a 61-layer model's statistics never sit
    in memory at once."""

    def __init__(self, stats_dir: str):
        from safetensors import safe_open

        path = Path(stats_dir)
        if not (path / META_FILE).is_file():
            raise KconvertError("not a `kconvert calibrate` output (no stats.json)",
                                file=str(path))
        self._file = safe_open(str(path / STATS_FILE), framework="pt")
        self._names = set(self._file.keys())
        self.where = str(path / STATS_FILE)

    def column_norms(self, m: ModuleWork) -> torch.Tensor:
        from kconvert.calibrate.stats import stats_key

        name = f"{stats_key(m.module)}.input_sq_sum"
        if name not in self._names:
            raise KconvertError("the statistics have no input column norms for this module",
                                file=self.where, tensor=m.module)
        return self._file.get_tensor(name).float().sqrt()


@dataclass(frozen=True)
class Sparsify(Stage):
    method: str = "magnitude"
    group_size: int = 16
    storage: str = "dense"
    stats: str | None = None  # `kconvert calibrate` output directory (wanda)
    hessian: str = DEFAULT_HESSIAN  # sparsegpt: where layer inputs come from
    calibration: Calibration | None = field(default=None, compare=False)
    name: str = "sparsify"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise KconvertError(f"unknown --method {self.method!r}; choose from {METHODS}")
        if self.group_size not in GROUP_SIZES:
            raise KconvertError(f"--group-size must be one of {GROUP_SIZES}")
        if self.storage not in STORAGES:
            raise KconvertError(f"unknown --storage {self.storage!r}; choose from {STORAGES}")
        if self.method == "wanda" and self.stats is None:
            raise KconvertError("--method wanda needs --stats DIR (from `kconvert calibrate`)")
        if self.method == "sparsegpt" and self.calibration is None:
            raise KconvertError("--method sparsegpt needs calibration data: --data FILE")
        if self.hessian not in HESSIANS:
            raise KconvertError(f"unknown --hessian {self.hessian!r}; choose from "
                                f"{HESSIANS}")
        if self.calibration is not None:
            self.calibration.hessians.sequential = self.hessian == "sequential"

    @property
    def ordered_layers(self) -> bool:
        """SparseGPT's calibration pass streams layers forward: items must follow."""
        return self.method == "sparsegpt"

    def claim(self, m: ModuleWork) -> None:
        if m.tn.role is not Role.ROUTED_EXPERT:
            return
        if m.shape[1] % self.group_size:
            raise KconvertError(f"input dimension {m.shape[1]} is not a whole number of "
                                f"{self.group_size}-element scale blocks", tensor=m.module)
        m.group_size = self.group_size
        m.storage = self.storage
        m.transform = self
        m.stages.append(self.name)

    def record(self) -> SparsifyRecord:
        # `pattern` and `targets` are what `kconvert audit` keys its p48 check on.
        out = {"pattern": "p48", "method": self.method, "group_size": self.group_size,
               "storage": self.storage, "targets": [Role.ROUTED_EXPERT.value]}
        if self.stats is not None:
            out["stats"] = hash_file(Path(self.stats) / STATS_FILE)
        if self.method == "sparsegpt":
            out.update(percdamp=obs.PERCDAMP, blocksize=obs.BLOCKSIZE,
                       hessian=self.hessian, data=self.calibration.data)
        return SparsifyRecord(**out)

    def close(self) -> None:
        if self.calibration is not None:
            self.calibration.hessians.close()

    def work_elems(self, device: torch.device) -> int | None:
        """SparseGPT's items on a CPU, sized as the OBS engine's (on a GPU the command's memory
        plan sizes them, from `gpu_work`)."""
        return obs.CPU_WORK_ELEMS if self.method == "sparsegpt" else None

    def gpu_work(self, shapes: Shapes) -> GpuWork | None:
        """SparseGPT's calibration forward beside the engine and its OBS batches."""
        if self.method != "sparsegpt":
            return None
        return self.calibration.hessians.gpu_work(shapes, shared=False, against_rtn=False)

    def use_gpu_plan(self, plan: GpuPlan) -> None:
        if self.calibration is not None:
            self.calibration.hessians.gpu_plan = plan

    @property
    def norms(self) -> WandaNorms:
        return _norms(self.stats)

    def transform(self, modules, w, gs, scale_rule, local_dtype, arithmetic):
        if self.method == "sparsegpt":
            return (*self._sparsegpt(modules, w, gs, scale_rule, local_dtype, arithmetic), None)
        col = None
        if self.method == "wanda":
            col = torch.stack([self.norms.column_norms(m) for m in modules]).to(w.device)
        keep = p48.top2_pairs(p48.pair_scores(w, col))
        return p48.apply_pair_mask(w, keep), None, None

    def _sparsegpt(self, modules, w, gs, scale_rule, local_dtype, arithmetic):
        hessians = self.calibration.hessians
        written = None
        if hessians.sequential:
            def written(i: int, w_hat: torch.Tensor) -> None:
                tn = modules[i].tn
                hessians.replace(tn.layer, tn.expert, tn.proj, w_hat)
        out, codes, _ = obs.quantize_batches(
            w, gs, obs.members_of([m.tn for m in modules]),
            lambda mb: obs.HessianSplit(hessians.hessian(mb.layer, mb.expert, mb.proj), None),
            self.group_size, scale_rule, local_dtype, arithmetic, mask=sparsegpt.p48_mask,
            budget=hessians.obs_budget(w.device), written=written)
        return out, codes


@functools.cache
def _norms(stats: str) -> WandaNorms:
    """One open statistics file per directory (the stage itself is a frozen value)."""
    return WandaNorms(stats)


def build(settings: dict, calibration: Calibration | None) -> Sparsify:
    if settings.get("pattern", "p48") != "p48":
        raise KconvertError(f"unknown sparsity pattern {settings['pattern']!r}; only p48")
    hessian = settings.get("hessian")
    if hessian is not None and settings.get("method", "magnitude") != "sparsegpt":
        raise KconvertError("--hessian serves --method sparsegpt")
    return Sparsify(method=settings.get("method", "magnitude"),
                    group_size=settings.get("group_size", 16),
                    storage=settings.get("storage", "dense"), stats=settings.get("stats"),
                    hessian=hessian or Sparsify.hessian, calibration=calibration)


def prepare(stages: tuple[dict, ...], options: dict, device: torch.device
            ) -> Callable[[Checkpoint], Calibration] | None:
    """SparseGPT's calibration from --data when the run's sparsify method is sparsegpt; None
    otherwise. sparsegpt without --data is a usage error (wanda without --stats is refused by
    the stage itself)."""
    recipe_methods = [s.get("method", "magnitude") for s in stages if s["stage"] == "sparsify"]
    method = options.get("method") or next(iter(recipe_methods), None)
    data, stats = options.get("data"), options.get("stats")
    if not any(s["stage"] == "prune" for s in stages):  # else they also serve the pruning plan
        for option, value, user in (("data", data, "sparsegpt"), ("stats", stats, "wanda")):
            if value is not None and method != user:
                raise UsageError(f"--{option} serves --method {user}; this run's sparsify "
                                 f"method is {method}")
    if method != "sparsegpt":
        return None
    if data is None:
        raise UsageError("--method sparsegpt needs calibration data: --data FILE")

    def make(ckpt: Checkpoint) -> Calibration:
        samples, seq_len, batch_size, seed = calibration_run(options, SPARSEGPT_SAMPLES)
        return Calibration.from_file(ckpt, data, samples, seq_len, batch_size, seed, device)

    return make


KIND = StageKind(Sparsify.name, build, SparsifyRecord,
                 settings=("pattern", "method", "group_size", "storage", "stats", "hessian"),
                 input_options=CALIBRATION_OPTIONS, input_type=Calibration,
                 prepare=prepare,
                 followed_by=("quantize", "p48 output is NVFP4"))
