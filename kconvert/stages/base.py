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
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from kconvert.errors import KconvertError
from kconvert.formats import OPTIONAL_PARAMS, Codec, DenseCodec, detect_codec
from kconvert.io.shards import TensorInfo
from kconvert.model.names import TARGET_ROLES, TensorName, parse_name

QUANT_ONLY_PARAMS = {
    "weight_packed", "weight_scale", "weight_shape", "weight_global_scale", "weight_scale_2",
    "weight_scale_inv", "weight_zero_point",
}


@dataclass
class ModuleWork:
    """One source linear and what becomes of it."""

    module: str
    tn: TensorName  # parsed name of the module's first parameter (role, layer, expert, ...)
    codec: type[Codec]
    params: dict[str, TensorInfo]
    shape: tuple[int, int]
    out_module: str = ""
    out_codec: type[Codec] | None = None  # None: every parameter copied unchanged
    stages: list[str] = field(default_factory=list)
    # Calibrated activation amax (W4A4 input scale); shared by the module's fused set.
    input_amax: float | None = None
    dense_dtype: str = "BF16"  # what a decoded module is written as (F32: exact INT4 values)
    group_size: int = 16  # NVFP4 elements per FP8 block scale (32 for sparse kernels)
    storage: str = "dense"  # NVFP4 byte layout: "dense" or "pair-bitmask" (p48 only)
    # The stage that changes the decoded fp32 weights before encoding (sparsify), if any.
    transform: WeightTransform | None = None
    # Re-laid out byte for byte (NVFP4 -> NVFP4, e.g. densify), never decoded or re-encoded.
    repack: bool = False

    def __post_init__(self) -> None:
        self.out_module = self.out_module or self.module

    @property
    def primary(self) -> TensorInfo:
        """The parameter whose shard the module's output lands in."""
        return self.params[self.codec.params[0]]

    @property
    def carried(self) -> tuple[str, ...]:
        """Optional parameters (W4A4 input scales) a re-layout carries over unchanged."""
        return tuple(p for p in sorted(OPTIONAL_PARAMS) if self.repack and p in self.params)

    @property
    def has_input_scale(self) -> bool:
        """W4A4: the output carries an input scale (calibrated, or carried by a re-layout)."""
        return self.input_amax is not None or any(p in self.carried for p in OPTIONAL_PARAMS)

    def out_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(param, dtype, shape) of every output tensor of a re-encoded module."""
        if self.out_codec is DenseCodec:
            return DenseCodec.specs(self.shape, self.dense_dtype)
        specs = self.out_codec.specs(self.shape, self.input_amax is not None, self.group_size)
        return specs + [(p, self.params[p].dtype, self.params[p].shape) for p in self.carried]


class WeightTransform(Protocol):
    """Changes B same-shaped modules' decoded fp32 weights before they are encoded."""

    def transform(self, modules: list[ModuleWork], w: torch.Tensor, gs: torch.Tensor,
                  scale_rule: str, local_dtype: torch.dtype, arithmetic: str
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new weights [B, M, K], FP8 block-scale codes to encode them with, or None to let
        the encoder choose). `gs` [B] are the NVFP4 per-tensor scales they will be encoded
        with, in the output flavour's `arithmetic` (kconvert.formats.nvfp4.ARITHMETIC)."""
        ...


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

    @property
    def options(self) -> tuple[str, ...]:
        """Every option name the kind takes, recipe settings and command-line inputs."""
        return self.settings + self.input_options


def module_params(tensors: dict[str, TensorInfo], belongs: Callable[[TensorName], bool]
                  ) -> dict[str, dict[str, TensorInfo]]:
    """module name -> {parameter suffix: tensor} of the tensors `belongs` selects that end in a
    parameter suffix (weight, weight_packed, weight_scale, ...)."""
    by_module: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        tn = parse_name(name)
        if tn.param and belongs(tn):
            by_module.setdefault(tn.module, {})[tn.param] = info
    return by_module


def as_linear(module: str, params: dict[str, TensorInfo],
              shape_values: dict[str, tuple[int, ...]]) -> ModuleWork | None:
    """The module in the format its parameters match, None when they match none. Raises
    KconvertError when its logical shape cannot be read (INT4's weight_shape disagrees with
    its tensors)."""
    codec = detect_codec(params)
    if codec is None:
        return None
    shape_info = params.get("weight_shape")
    shape_value = shape_values.get(shape_info.name) if shape_info else None
    shape = codec.logical_shape(params, shape_value)
    return ModuleWork(module, parse_name(params[codec.params[0]].name), codec, params, shape)


def group_modules(
    tensors: dict[str, TensorInfo], shape_values: dict[str, tuple[int, ...]]
) -> tuple[list[ModuleWork], list[TensorInfo]]:
    """Split the source tensors into linears (with their codec) and everything else.

    `shape_values` holds the contents of the tiny `weight_shape` tensors (INT4 modules).
    """
    targets = set(TARGET_ROLES.values())
    modules, grouped = [], set()
    for module, params in module_params(tensors, lambda tn: tn.role in targets).items():
        m = as_linear(module, params, shape_values)
        if m is None:
            if QUANT_ONLY_PARAMS & set(params):
                first = next(iter(params.values()))
                raise KconvertError(
                    f"quantized module with parameters {sorted(params)} matches no known format",
                    file=first.file.name, tensor=first.name,
                )
            continue
        modules.append(m)
        grouped.update(info.name for info in params.values())
    others = [info for name, info in tensors.items() if name not in grouped]
    return modules, others
