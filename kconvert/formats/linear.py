"""The linear model every package shares: a source linear (`ModuleWork`), what becomes of it,
and how a checkpoint's tensors group into linears of known formats.

Planning (kconvert.engine.work), calibration, the audit and sizing read checkpoints through
these; stages (kconvert.stages) set a module's fate on them, and a `WeightTransform` changes its
decoded weights before encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from kconvert.errors import KconvertError
from kconvert.formats import OPTIONAL_PARAMS, Codec, EncodeSpec, detect_codec, encode_spec
from kconvert.formats.base import CHUNK_ELEMS
from kconvert.io.shards import TensorInfo
from kconvert.model.names import TARGET_ROLES, Role, TensorName, parse_name

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
    # The input-scale policy that amax follows (kconvert.common.options.INPUT_SCALES), which the
    # output's config declares.
    input_scale_policy: str | None = None
    # W4A4 with activations quantized at run time (MXFP4), declared in the config only.
    dynamic_activations: bool = False
    dense_dtype: str = "BF16"  # what a decoded module is written as (F32: exact INT4 values)
    # Elements per block scale: the output codec's default unless a stage sets it (p48's
    # sparse kernels read NVFP4 in 16s or 32s).
    group_size: int | None = None
    storage: str = "dense"  # NVFP4 byte layout: "dense" or "pair-bitmask" (p48 only)
    # The method that changes the decoded fp32 weights before encoding (GPTQ, a p48 mask),
    # if any.
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
        if not self.repack:  # asked of every module while planning: nothing to sort
            return ()
        return tuple(p for p in sorted(OPTIONAL_PARAMS) if p in self.params)

    @property
    def has_input_scale(self) -> bool:
        """W4A4: the output carries an input scale (calibrated, or carried by a re-layout)."""
        return self.input_amax is not None or any(p in self.carried for p in OPTIONAL_PARAMS)

    def encode_spec(self, rule: str | None = None, chunk_elems: int = CHUNK_ELEMS) -> EncodeSpec:
        """How its decoded weights are encoded by its output codec: by the block-scale `rule`
        of the run (None: the default), in chunks of `chunk_elems` elements."""
        return encode_spec(self.codec, self.primary.torch_dtype, rule, self.group_size,
                           {"weight": self.dense_dtype}, chunk_elems)

    def out_specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(param, dtype, shape) of every output tensor of a re-encoded module."""
        specs = self.out_codec.output_specs(self.shape, self.encode_spec(),
                                            self.input_amax is not None)
        return specs + [(p, self.params[p].dtype, self.params[p].shape) for p in self.carried]


class Transformed(NamedTuple):
    """What a method makes of B matrices' decoded weights, for their codec's encode."""

    weights: torch.Tensor  # [B, M, K], fp32
    codes: torch.Tensor | None = None  # block-scale codes to encode them with (None: the rule's)
    # Per matrix what the manifest records of the method's choice
    # (kconvert.plugins.methods.ObsEntry).
    records: list[dict] | None = None


class Batch(NamedTuple):
    """B same-shaped modules of a work item as the engine hands them to their method: decoded
    fp32 weights [B, M, K], to be encoded by `codec` with `spec` and per-tensor scales for
    `amax` [B] (a fused set's shared amax, from the source weights)."""

    modules: list[ModuleWork]
    weights: torch.Tensor
    codec: type[Codec]
    spec: EncodeSpec
    amax: torch.Tensor


class WeightTransform(Protocol):
    """Changes modules' decoded fp32 weights before they are encoded."""

    # "expert": a work item never splits a routed expert's matrices (the method sees an
    # expert's gate, up and down in one call); "matrix": any split.
    unit: str

    def transform(self, batches: list[Batch]) -> list[Transformed]:
        """New weights for every batch of one work item whose modules it transforms."""
        ...


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
    tensors: dict[str, TensorInfo], shape_values: dict[str, tuple[int, ...]],
    routers: bool = False,
) -> tuple[list[ModuleWork], list[TensorInfo]]:
    """Split the source tensors into linears (with their codec) and everything else.

    A router is a linear here only when it is quantized (AMD's MXFP4 recipe), so that it is
    decoded wherever a format is read; a plain one stays a tensor like any other, unless
    `routers` (a stage re-encodes them).
    `shape_values` holds the contents of the tiny `weight_shape` tensors (INT4 modules).
    """
    targets = set(TARGET_ROLES.values())
    modules, grouped = [], set()
    for module, params in module_params(
            tensors, lambda tn: tn.role in targets or tn.role is Role.ROUTER_WEIGHT).items():
        if not routers and set(params) == {"weight"} and \
                parse_name(params["weight"].name).role is Role.ROUTER_WEIGHT:
            continue
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
