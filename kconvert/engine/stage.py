"""What a stage is to the engine: the hooks a work plan calls on every stage of a run.

The stage kinds themselves (kconvert.stages) subclass `Stage`; the engine knows only these
hooks, never a kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict

from kconvert.formats.linear import ModuleWork
from kconvert.model.names import TensorName

if TYPE_CHECKING:
    from kconvert.gpu.parts import GpuWork
    from kconvert.gpu.plan import GpuPlan
    from kconvert.gpu.shapes import Shapes


# The stage kinds the modules beside the driver find by name, in what a run recorded (a tensor's
# `stage` in the manifest) or in what a command prepares (a stage's input, by kind): declared
# here, below the stages, whose kinds are named so (tests/test_contracts.py holds them equal).
QUANTIZE = "quantize"  # its modules are the ones a manifest counts per layer as quantized
PRUNE = "prune"  # a pruning plan's stage, which `inspect --keep` prepares itself


def recorded_stage(stages: list[str]) -> str:
    """How the manifest records the stages that made an output tensor ("dequant+quantize")."""
    return "+".join(stages)


def stages_of(recorded: str) -> list[str]:
    """The stages a manifest's recorded `stage` names ("copy": none made it)."""
    return recorded.split("+")


class StageRecord(BaseModel):
    """What a stage records in the manifest (kconvert.stages.records.RunRecord): the options
    that decide the output bytes. A field that was not set is left out of the file (a record is
    dumped with exclude_unset), so adding an optional field changes no existing manifest."""

    model_config = ConfigDict(extra="forbid")


class Stage:
    """A stage's hooks; each defaults to "leave it alone"."""

    name: str
    # True when the stage streams calibration layers forward (SparseGPT): the engine then
    # runs transform items in layer order across shards.
    ordered_layers: bool = False
    # The FP8 block-scale rule ("mse" | "amax") the run's NVFP4 encoder follows, when the
    # stage chooses it (quantize); the engine's default otherwise.
    scale_rule: str | None = None
    # True when the stage re-encodes the routers (quantize --targets routers): every router is
    # then planned as a linear, not only a quantized one (`group_modules`).
    linear_routers: bool = False

    def rename(self, tn: TensorName) -> tuple[str | None, tuple[int, ...] | None]:
        """Output name of a source tensor (None: dropped) and, for router tensors, the rows
        (experts) to keep."""
        return tn.name, None

    def replaced_rows(self) -> dict[str, torch.Tensor]:
        """Output name -> the tensor the stage computed, written instead of the source's
        bytes: a router whose rows it selects (a repaired router), or a whole tensor (a
        parameter of a re-fitted matrix)."""
        return {}

    def claim(self, m: ModuleWork) -> None:
        """Claim a module for decoding: set `m.out_codec` and append to `m.stages`."""

    def edit_config(self, text_config: dict) -> None:
        """Change the language model's config (in place) to describe the output."""

    def record(self) -> StageRecord:
        """The options that decide the output bytes, for the manifest and resume checks."""
        raise NotImplementedError

    def input_files(self) -> list[str]:
        """Files besides the source whose contents decide the output bytes (the activation
        statistics of W4A4): a resumed run checks they are unchanged."""
        return []

    def summary(self) -> dict[str, int]:
        """What the stage did, in numbers, for the manifest's summary beside the modules
        counted there (e.g. REAP's layers whose repair the guard applied or refused)."""
        return {}

    def output_files(self) -> dict[str, str]:
        """Files (name -> text) this stage adds to the output, e.g. the pruning plan."""
        return {}

    def close(self) -> None:
        """Release what the stage holds for the run (threads, open files)."""

    def work_elems(self, device: torch.device) -> int | None:
        """Decoded elements per transform item the stage wants on a CPU, or None for the
        engine's own size (on a GPU the command's memory plan sizes items)."""
        return None

    def gpu_work(self, shapes: Shapes) -> GpuWork | None:
        """What the stage runs on the GPU beside the engine's encode (a calibration forward,
        OBS batches), for the command's memory plan; None: nothing."""
        return None

    def use_gpu_plan(self, plan: GpuPlan) -> None:
        """Take the command's GPU memory plan (its micro-batch, OBS share) before the run."""
