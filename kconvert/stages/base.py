"""The stage kind: how recipes and commands name a stage, what they may set, what it prepares
from the opened source, and how it is built.

A conversion is a list of stages (their hooks: kconvert.engine.stage.Stage). At plan time each
stage may claim a source module and say how it leaves: decoded and re-encoded by an output
codec, or (when no stage claims it) copied byte for byte. The engine then decodes only what
some stage claimed, runs the stages' weight transforms on the fp32 values, and encodes with the
module's output codec. Each stage module declares its `StageKind` (KIND); kconvert.stages.KINDS
lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kconvert.engine.stage import Stage, StageRecord
from kconvert.gpu_budget import GpuRequest
from kconvert.io.checkpoint import Checkpoint

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
    # (the recipe's [[stages]] tables, the options given by name, the run's GPU request: its
    # device, and the budget resolved once for the run) ->
    # make(ckpt), which makes the stage's input (an input_type) from the opened source, or None
    # when this run needs none. Called once per run before the source is opened, so the
    # options are checked before anything is read.
    prepare: Callable[[tuple[dict, ...], dict[str, Any], GpuRequest],
                      Callable[[Checkpoint], Any] | None] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """Every option name the kind takes, recipe settings and command-line inputs."""
        return self.settings + self.input_options
