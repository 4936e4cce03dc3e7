"""What every on-disk format of one linear's parameters provides.

A format is a codec class: it turns the parameter tensors of B same-shaped linears (each
stacked on a leading batch dim) into fp32 weights [B, out, in] and back, and it says how it is
recognised (by the parameters a module has, `matches`), which dtypes and shapes its parameters
may have (`param_rules`, what the audit checks), how a quantization_config names it (the
`ct_*`, `modelopt_algos` and `quant_method` class attributes) and what in such a config's
scheme must agree with its tensors (`scheme_problems`).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, TensorName

ParamSpec = tuple[str, str, tuple[int, ...]]  # (param suffix, safetensors dtype, shape)
# param -> (dtypes it may have, its exact shape or None where only the format's rule applies)
ParamRules = dict[str, tuple[frozenset[str], tuple[int, ...] | None]]


class Linear(Protocol):
    """A linear's parameter set, as a conversion plans it and as the audit reads it."""

    tn: TensorName
    codec: type[Codec]
    shape: tuple[int, ...]
    params: dict[str, TensorInfo]

    @property
    def primary(self) -> TensorInfo: ...


def is_linear(m: Linear) -> bool:
    """Would the model hold an nn.Linear here (what a config's 'Linear' target means)?"""
    if m.tn.role in (Role.EMBEDDING, Role.ROUTER_WEIGHT, Role.ROUTER_BIAS, Role.NORM):
        return False
    return m.codec.quantized or len(m.shape) == 2


class OutputModule(Linear, Protocol):
    """A linear as a conversion writes it: what a config writer needs to describe it."""

    out_module: str
    out_codec: type[Codec] | None
    group_size: int
    # W4A4 whose activations the engine quantizes at run time (MXFP4): no input scales.
    dynamic_activations: bool

    @property
    def has_input_scale(self) -> bool: ...


class Codec:
    """Base: `params` names the parameter suffixes a module in this format has."""

    name: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    quantized: ClassVar[bool] = True
    description: ClassVar[str]  # in messages: "INT4 pack-quantized", "NVFP4 (ModelOpt)", ...
    # Elements per scale when no config says (group of INT4, block of NVFP4).
    default_group_size: ClassVar[int | None] = None
    # NVFP4's per-tensor scales, which a fused set's members must share.
    global_scale_param: ClassVar[str | None] = None
    input_scale_param: ClassVar[str | None] = None
    # How a quantization_config names this format: compressed-tensors' "format" (and, for a
    # layout flagged beside it, the flag's "layout"), ModelOpt's quant_algo values (-> "w4a4" or
    # "w4a16"), or the config's quant_method.
    ct_format: ClassVar[str | None] = None
    ct_layout_key: ClassVar[str | None] = None
    ct_layout: ClassVar[str | None] = None
    modelopt_algos: ClassVar[dict[str, str]] = {}
    quant_method: ClassVar[str | None] = None
    # The config family an output in this format is described by ("compressed-tensors",
    # "modelopt", "quark"), and the --format name that selects it; None for source-only formats.
    config_family: ClassVar[str | None] = None
    cli_name: ClassVar[str | None] = None
    # compressed-tensors' preset schemes for an output in this format: (W4A16, W4A4).
    ct_presets: ClassVar[tuple[str, str] | None] = None
    # The codec turns fp32 weights into its parameters itself (`quantize`, then `encode`), with
    # no per-tensor scale (MXFP4); NVFP4's encoders are driven by `arithmetic` instead.
    encodes_itself: ClassVar[bool] = False
    # Whether the format has a W4A4 form whose activations are quantized at run time
    # (declared in the config, no input scales to calibrate): None if not, else whether an
    # output is written that way unless the command says otherwise.
    dynamic_activations: ClassVar[bool | None] = None
    # Whether the format's config can describe a quantized MoE router (AMD's MXFP4 recipe).
    quantizes_routers: ClassVar[bool] = False
    # NVFP4 formats: whose scale arithmetic the encoder follows (kconvert.formats.nvfp4).
    arithmetic: ClassVar[str | None] = None
    # An output format that also has forms for p48's 32-element blocks and pair-bitmask
    # storage (kconvert.formats.nvfp4_pair_bitmask).
    p48_forms: ClassVar[bool] = False
    # The dtypes its first parameter may have, where the parameter names alone do not tell
    # the format (a `weight` is dense, FP8-block or ModelOpt NVFP4); None: any.
    weight_dtypes: ClassVar[frozenset[str] | None] = None

    @classmethod
    def matches(cls, infos: dict[str, TensorInfo]) -> bool:
        """Whether a module with these parameters is in this format."""
        return set(infos) - OPTIONAL_PARAMS == set(cls.params) and (
            cls.weight_dtypes is None or infos[cls.params[0]].dtype in cls.weight_dtypes)

    @classmethod
    def param_rules(cls, shape: tuple[int, int], group_size: int) -> ParamRules:
        """The dtypes and shapes this format's parameters may have (the audit checks them)."""
        raise NotImplementedError

    @classmethod
    def scheme_problems(cls, where: str, scheme: dict, m: Linear) -> list[str]:
        """How the scheme a config gives `m` disagrees with m's tensors (none by default)."""
        return []

    @classmethod
    def declares_dynamic_input(cls, qconfig: dict, name: str) -> bool:
        """Whether `qconfig` (a config of this format's family) declares that module `name`'s
        inputs are quantized at run time in the format's own blocks, with no stored scale
        (the W4A4 form of `dynamic_activations`, which `kconvert eval` emulates). Raises
        KconvertError where it declares input quantization in a form that is not that one."""
        return False

    @classmethod
    def edit_config(cls, qconfig: dict) -> None:
        """Add what an output in this format needs to its family's config (in place)."""

    @classmethod
    def logical_shape(cls, infos: dict[str, TensorInfo], shape_value: tuple[int, int] | None
                      ) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def decode(cls, t: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def quantize(cls, w: torch.Tensor, rule: str, chunk_elems: int):
        """An `encodes_itself` codec's encoding of fp32 weights [B, out, in] by the block-scale
        `rule`: an object with err_sq and ref_sq [B] that `encode` reads module i from."""
        raise NotImplementedError


# Parameters that belong to a format but that a decode does not need (W4A4 input scales).
OPTIONAL_PARAMS = {"input_scale", "input_global_scale"}
