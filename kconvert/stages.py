"""Stages: plain functions over one module's plan (and, later, one layer's fp32 weights).

A conversion is a list of stages. At plan time each stage may claim a source module and say
how it leaves: decoded and re-encoded by an output codec, or (when no stage claims it)
copied byte for byte. The engine then decodes only what some stage claimed, runs the
stages' weight transforms on the fp32 values, and encodes with the module's output codec.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch

from kconvert.codecs import (
    OPTIONAL_PARAMS,
    OUTPUT_CODECS,
    Codec,
    DenseCodec,
    Nvfp4PairBitmaskCodec,
    detect_codec,
)
from kconvert.errors import KconvertError
from kconvert.layout import TARGET_ROLES, Role, TensorName, parse_name
from kconvert.safetensors_io import TensorInfo

# Parameter suffixes that only exist in quantized formats: a module that has one of these but
# matches no codec is a layout we do not understand, and must not be copied into an output
# whose quantization_config no longer describes it.
PLAN_FILE = "reap-plan.json"
QUANT_ONLY_PARAMS = {
    "weight_packed", "weight_scale", "weight_shape", "weight_global_scale", "weight_scale_2",
    "weight_scale_inv", "weight_zero_point",
}


@dataclass
class ModulePlan:
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
    block: int = 16  # NVFP4 elements per FP8 block scale (32 for sparse kernels)
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
        specs = self.out_codec.specs(self.shape, self.input_amax is not None, self.block)
        return specs + [(p, self.params[p].dtype, self.params[p].shape) for p in self.carried]


class WeightTransform(Protocol):
    """Changes B same-shaped modules' decoded fp32 weights before they are encoded."""

    def transform(self, modules: list[ModulePlan], w: torch.Tensor, gs: torch.Tensor,
                  block_scale: str, local_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new weights [B, M, K], FP8 block-scale codes to encode them with, or None to let
        the encoder choose). `gs` [B] are the NVFP4 global scales they will be encoded with."""
        ...


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

    def plan(self, m: ModulePlan) -> None:
        """Claim a module for decoding: set `m.out_codec` and append to `m.stages`."""

    def edit_config(self, text_config: dict) -> None:
        """Change the language model's config (in place) to describe the output."""

    def recorded(self) -> dict:
        """The options that decide the output bytes, for the manifest and resume checks."""
        return {}

    def edit_quant_config(self, block: dict) -> None:
        """Change the output's compressed-tensors quantization_config block (in place)."""

    def output_files(self) -> dict[str, str]:
        """Files (name -> text) this stage adds to the output, e.g. the pruning plan."""
        return {}

    def close(self) -> None:
        """Release what the stage holds for the run (threads, open files)."""


@dataclass(frozen=True)
class Dequant(Stage):
    """Every quantized module (INT4, NVFP4, FP8) is decoded; alone, it writes BF16, or F32
    (`dtype`), which holds INT4's q * scale exactly: a lossless intermediate."""

    dtype: str = "BF16"
    name: str = "dequant"

    def plan(self, m: ModulePlan) -> None:
        if m.codec.quantized:
            m.out_codec = DenseCodec
            m.dense_dtype = self.dtype
            m.stages.append(self.name)

    def recorded(self) -> dict:
        return {"dtype": self.dtype}


@dataclass(frozen=True)
class Quantize(Stage):
    """Targeted modules become NVFP4 in the chosen on-disk flavour.

    A quantized module that is not a target but is in another format is decoded to BF16:
    the output's quantization_config describes NVFP4 only, never a stale format.
    """

    targets: frozenset[Role]
    fmt: str = "compressed-tensors"
    block_scale: str = "mse"
    # Activation statistics from calibration: JSON {"input_amax": {module: amax}}. A module
    # found there is W4A4 and gets an input scale (2688/amax in compressed-tensors, amax/2688
    # in ModelOpt); without statistics the output is W4A16.
    act_stats: str | None = None
    name: str = "quantize"

    @cached_property
    def input_amax(self) -> dict[str, float]:
        if self.act_stats is None:
            return {}
        try:
            return {k: float(v) for k, v in
                    json.loads(Path(self.act_stats).read_text())["input_amax"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KconvertError(f"bad activation statistics: {exc}", file=self.act_stats) from exc

    def recorded(self) -> dict:
        return {"targets": sorted(r.value for r in self.targets), "format": self.fmt,
                "block_scale": self.block_scale, "act_stats": self.act_stats}

    def plan(self, m: ModulePlan) -> None:
        if m.tn.role in self.targets:
            m.input_amax = self.input_amax.get(m.module)
            if self.act_stats is not None and m.input_amax is None:
                # One config group describes every target: all W4A4 or none.
                raise KconvertError("activation statistics have no input amax for this "
                                    "targeted module", file=self.act_stats, tensor=m.module)
            if m.shape[1] % 16:
                raise KconvertError(
                    f"input dimension {m.shape[1]} is not a multiple of 16; NVFP4 needs it",
                    file=m.primary.file.name, tensor=m.primary.name,
                )
            m.out_codec = OUTPUT_CODECS[self.fmt]
            if m.storage == "pair-bitmask" or m.block != 16:
                if self.fmt != "compressed-tensors":
                    raise KconvertError(f"--format {self.fmt} has no form for block size "
                                        f"{m.block} / {m.storage} storage; use "
                                        "compressed-tensors", tensor=m.module)
                if m.storage == "pair-bitmask":
                    m.out_codec = Nvfp4PairBitmaskCodec
            m.stages.append(self.name)
        elif m.transform is not None:
            raise KconvertError("a sparsified module must also be quantized: add its role to "
                                "the quantize stage's targets", tensor=m.module)
        elif m.codec.quantized and m.codec is not OUTPUT_CODECS[self.fmt]:
            m.out_codec = DenseCodec
            m.stages.append("dequant")


@dataclass(frozen=True)
class Prune(Stage):
    """Drop the routed experts a plan does not keep and renumber the rest 0..N-1.

    Kept experts keep their bytes (whatever their format) under new ids; the router's gate
    rows and e_score_correction_bias entries are sliced to the kept ids, in the same order.
    """

    keep: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, kept source ids ascending)
    plan_json: str = ""  # the plan file's text, written to DST as reap-plan.json
    name: str = "prune"

    @cached_property
    def _new_id(self) -> dict[int, dict[int, int]]:
        return {layer: {old: new for new, old in enumerate(ids)} for layer, ids in self.keep}

    @cached_property
    def _rows(self) -> dict[int, tuple[int, ...]]:
        return dict(self.keep)

    @property
    def kept(self) -> int:
        return len(self.keep[0][1])

    def rename(self, tn: TensorName) -> tuple[str | None, tuple[int, ...] | None]:
        if tn.layer not in self._new_id:
            return tn.name, None
        if tn.role is Role.ROUTED_EXPERT:
            new = self._new_id[tn.layer].get(tn.expert)
            return (None, None) if new is None else (tn.with_expert(new).name, None)
        if tn.role in (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS):
            return tn.name, self._rows[tn.layer]
        return tn.name, None

    def edit_config(self, text_config: dict) -> None:
        # Group-limited routing needs equal experts per group; kept ids rarely are, so routing
        # falls back to one group (Kimi already has n_group = topk_group = 1).
        text_config["n_routed_experts"] = self.kept
        text_config["n_group"] = 1
        text_config["topk_group"] = 1

    def recorded(self) -> dict:
        return {"kept_per_layer": self.kept, "layers": len(self.keep),
                "plan": hashlib.sha256(self.plan_json.encode()).hexdigest()}

    def output_files(self) -> dict[str, str]:
        return {PLAN_FILE: self.plan_json}


def parse_targets(spec: str | list[str] | tuple[str, ...]) -> frozenset[Role]:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n.strip() not in TARGET_ROLES]
    if unknown:
        raise KconvertError(f"unknown --targets {unknown}; choose from {sorted(TARGET_ROLES)}")
    return frozenset(TARGET_ROLES[n.strip()] for n in names if n.strip())


def group_modules(
    tensors: dict[str, TensorInfo], shape_values: dict[str, tuple[int, ...]]
) -> tuple[list[ModulePlan], list[TensorInfo]]:
    """Split the source tensors into linears (with their codec) and everything else.

    `shape_values` holds the contents of the tiny `weight_shape` tensors (INT4 modules).
    """
    by_module: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        tn = parse_name(name)
        if tn.param and tn.role in TARGET_ROLES.values():
            by_module.setdefault(tn.module, {})[tn.param] = info
    modules, grouped = [], set()
    for module, params in by_module.items():
        codec = detect_codec(params)
        if codec is None:
            if QUANT_ONLY_PARAMS & set(params):
                first = next(iter(params.values()))
                raise KconvertError(
                    f"quantized module with parameters {sorted(params)} matches no known format",
                    file=first.file.name, tensor=first.name,
                )
            continue
        shape_info = params.get("weight_shape")
        shape_value = shape_values.get(shape_info.name) if shape_info else None
        shape = codec.logical_shape(params, shape_value)
        tn = parse_name(params[codec.params[0]].name)
        modules.append(ModulePlan(module, tn, codec, params, shape))
        grouped.update(info.name for info in params.values())
    others = [info for name, info in tensors.items() if name not in grouped]
    return modules, others
