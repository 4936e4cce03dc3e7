"""Stages: plain functions over one module's plan (and, later, one layer's fp32 weights).

A conversion is a list of stages. At plan time each stage may claim a source module and say
how it leaves: decoded and re-encoded by an output codec, or (when no stage claims it)
copied byte for byte. The engine then decodes only what some stage claimed, runs the
stages' weight transforms on the fp32 values, and encodes with the module's output codec.

Each stage module declares its `StageKind` (KIND): how recipes and commands name the stage,
what they may set, what a command prepares for it, and how it is built; kconvert.stages.KINDS
lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from kconvert.formats.linear import ModuleWork
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.names import TensorName


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

    def rename(self, tn: TensorName) -> tuple[str | None, tuple[int, ...] | None]:
        """Output name of a source tensor (None: dropped) and, for router tensors, the rows
        (experts) to keep."""
        return tn.name, None

    def replaced_rows(self) -> dict[str, torch.Tensor]:
        """Output name -> the tensor the stage computed for a router whose rows it selects
        (a repaired router), written instead of the selected source rows."""
        return {}

    def claim(self, m: ModuleWork) -> None:
        """Claim a module for decoding: set `m.out_codec` and append to `m.stages`."""

    def edit_config(self, text_config: dict) -> None:
        """Change the language model's config (in place) to describe the output."""

    def record(self) -> StageRecord:
        """The options that decide the output bytes, for the manifest and resume checks."""
        raise NotImplementedError

    def output_files(self) -> dict[str, str]:
        """Files (name -> text) this stage adds to the output, e.g. the pruning plan."""
        return {}

    def close(self) -> None:
        """Release what the stage holds for the run (threads, open files)."""

    def work_elems(self, device: torch.device) -> int | None:
        """Decoded elements per transform item the stage wants on `device`,
        or None for the engine's own size."""
        return None


# The command-line options that say which calibration data a command reads and how it runs
# (REAP's saliency for a prune stage, SparseGPT's inputs for a sparsify stage).
CALIBRATION_OPTIONS = ("data", "samples", "seq_len", "batch_size", "seed")


@dataclass(frozen=True)
class StageKind:
    """A kind of stage, as a recipe's `stage = "..."` and the command line name it."""

    name: str
    # (settings, input) -> the stage; `settings` holds only the settings given (recipe, then
    # command line), so the defaults live here, and so do the checks of their values.
    build: Callable[[dict[str, Any], Any], Stage]
    # What the stage's record() returns: its entry in the manifest's options (RunRecord).
    record_type: type[StageRecord]
    # Recipe keys, which are also long command-line options with `_` for `-` (`block_scale` is
    # --block-scale); the command line wins over the recipe.
    settings: tuple[str, ...] = ()
    # Command-line options only, from which a command prepares the stage's input out of the
    # opened source (a pruning plan checked against it, calibration inputs).
    input_options: tuple[str, ...] = ()
    # What a command prepares (an instance is handed to `build`); None: the stage takes none.
    input_type: type | None = None
    # (kind, why): a stage kind that must come later in the same recipe.
    followed_by: tuple[str, str] | None = None
    # (the recipe's [[stages]] tables, the options given by name, the run's device) ->
    # make(ckpt), which makes the stage's input (an input_type) from the opened source, or None
    # when this run needs none. Called once per run before the source is opened, so the
    # options are checked before anything is read.
    prepare: Callable[[tuple[dict, ...], dict[str, Any], torch.device],
                      Callable[[Checkpoint], Any] | None] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """Every option name the kind takes, recipe settings and command-line inputs."""
        return self.settings + self.input_options
