"""What every on-disk format of one linear's parameters provides.

A format is a codec class: it turns the parameter tensors of B same-shaped linears (each
stacked on a leading batch dim) into fp32 weights [B, out, in] (`decode`) and fp32 weights into
them (`encode`, by the numbers an `EncodeSpec` gives), and it says how it is recognised (by the
parameters a module has, `matches`), which dtypes and shapes its parameters may have
(`param_rules`, what the audit checks), how a quantization_config names it (the `ct_*`,
`modelopt_algos` and `quant_method` class attributes) and what in such a config's scheme must
agree with its tensors (`scheme_problems`). It owns all of its bytes: the tensors an encode
writes (`specs`), its packed values (`unpack`), the encode of another format's parameters as
stored (`reads_packed`) and a lossless re-layout of them (`relayout`), so that the engine and the
audit call codecs only through this class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
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
    if m.tn.role in (Role.EMBEDDING, Role.ROUTER_WEIGHT, Role.ROUTER_BIAS, Role.NORM, Role.MTP):
        return False
    return m.codec.quantized or len(m.shape) == 2


class OutputModule(Linear, Protocol):
    """A linear as a conversion writes it: what a config writer needs to describe it."""

    out_module: str
    out_codec: type[Codec] | None
    group_size: int
    # W4A4 whose activations the engine quantizes at run time (MXFP4): no input scales.
    dynamic_activations: bool
    # W4A4 NVFP4: the policy its input scale follows (kconvert.common.options.INPUT_SCALES).
    input_scale_policy: str | None

    @property
    def has_input_scale(self) -> bool: ...


# The block-scale rule an encode follows where nothing chose one (`kconvert quantize`'s default).
DEFAULT_SCALE_RULE = "mse"
# Elements per encoder chunk where the caller does not size it (bounds its temporaries).
CHUNK_ELEMS = 1 << 22


@dataclass(frozen=True)
class EncodeSpec:
    """What an encode follows besides the weights themselves."""

    rule: str = "mse"  # the block-scale rule of NVFP4 and MXFP4 (formats.md §2, §6)
    group_size: int | None = None  # elements per scale; None: the codec's default_group_size
    # The dtype (safetensors name) each parameter is stored in where the format allows several
    # (a dense weight: BF16 or F32; INT4's weight_scale and weight_shape); else the codec's own.
    dtypes: Mapping[str, str] = field(default_factory=dict)
    # The dtype compressed-tensors divides a block's amax by 6 in (formats.md §2): the source
    # weights' own, bf16 for a BF16 checkpoint.
    local_dtype: torch.dtype = torch.float32
    chunk_elems: int = CHUNK_ELEMS  # elements per encoder chunk (bounds its temporaries)

    def group(self, codec: type[Codec]) -> int:
        return self.group_size or codec.default_group_size  # type: ignore[return-value]


def encode_spec(source: type[Codec], source_dtype: torch.dtype, rule: str | None,
                group_size: int | None, dtypes: Mapping[str, str],
                chunk_elems: int = CHUNK_ELEMS) -> EncodeSpec:
    """How weights decoded from a `source` module (its first parameter `source_dtype`) are
    encoded: by `rule` (DEFAULT_SCALE_RULE where none is given), `group_size` elements per
    scale (None: the output codec's own), parameters stored in `dtypes` where the output
    format allows several. compressed-tensors takes a block's amax / 6 in the source weights'
    own dtype (bf16 for a BF16 checkpoint, formats.md §2); a quantized source decodes to fp32."""
    local = torch.float32 if source.quantized else source_dtype
    return EncodeSpec(rule or DEFAULT_SCALE_RULE, group_size, dtypes, local, chunk_elems)


@dataclass
class Encoded:
    """B matrices as their codec stores them: each parameter stacked over the batch [B, ...]
    (what `Codec.decode` reads back), and what the manifest records of the encoding."""

    params: dict[str, torch.Tensor]
    err_sq: torch.Tensor | None = None  # float64 [B]: squared error against the weights given
    ref_sq: torch.Tensor | None = None  # float64 [B]: the squares of those weights
    # float32 [B]: the per-tensor scale in compressed-tensors' form, 2688 / amax, which the
    # manifest records whatever the flavour (None: the format has no per-tensor scale).
    recorded_scale: torch.Tensor | None = None
    # Per matrix, what the manifest records of how it was encoded beyond its error (the
    # exact MXFP4 cast's block counts, {"cast": {...}}); None: nothing.
    records: list[dict] | None = None

    def module(self, i: int) -> dict[str, torch.Tensor]:
        """Matrix i's parameters."""
        return {p: t[i] for p, t in self.params.items()}

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Encoded:
        """The same encoding with every tensor passed through `move` (e.g. to the host)."""
        def each(value):
            return move(value) if isinstance(value, torch.Tensor) else value

        return Encoded({p: move(t) for p, t in self.params.items()},
                       *(each(getattr(self, f.name)) for f in fields(self)[1:]))


class Codec:
    """Base: `params` names the parameter suffixes a module in this format has."""

    name: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    quantized: ClassVar[bool] = True
    description: ClassVar[str]  # in messages: "INT4 pack-quantized", "NVFP4 (ModelOpt)", ...
    # The numbers it stores, whatever the layout: "bf16", "int4", "fp8-block", "nvfp4",
    # "mxfp4" (`inspect --as`; a method that produces one grid's values, kconvert.methods).
    grid: ClassVar[str]
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
    # Whether its encode chooses block scales by EncodeSpec.rule (NVFP4, MXFP4; INT4's are
    # compressed-tensors' amax / 7.5, FP8-block's amax / 448).
    uses_scale_rule: ClassVar[bool] = False
    # Whether a MoE router may be stored in this format (plain float, or MXFP4 in AMD's recipe).
    router_form: ClassVar[bool] = False
    # Whether the format has a W4A4 form whose activations are quantized at run time
    # (declared in the config, no input scales to calibrate): None if not, else whether an
    # output is written that way unless the command says otherwise.
    dynamic_activations: ClassVar[bool | None] = None
    # Whether the format's config can describe a quantized MoE router (AMD's MXFP4 recipe).
    quantizes_routers: ClassVar[bool] = False
    # NVFP4 formats: whose scale arithmetic the encoder follows (kconvert.formats.nvfp4).
    arithmetic: ClassVar[str | None] = None
    # The (block size, storage) forms a paired-4:8 sparse matrix may take in this format
    # (p48.md): none where the format has no sparse form.
    sparse_forms: ClassVar[frozenset[tuple[int, str]]] = frozenset()
    # Device bytes the encoder holds per element of a batch beyond the fp32 weights (its
    # outputs and temporaries, for the GPU memory plan), and per element of one chunk.
    encode_bytes_per_elem: ClassVar[int] = 2
    encode_chunk_bytes_per_elem: ClassVar[int] = 0
    # The parameter its packed elements are stored in, and how many elements a byte of it holds
    # (NVFP4: 2, two nibbles; a sparse layout more, only the kept bytes stored), where the format
    # packs them in a parameter of their own (what the p48 pattern check reads).
    packed_param: ClassVar[str | None] = None
    elements_per_byte: ClassVar[int | None] = None
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
    def write_config(cls, modules: list[OutputModule], names: Mapping[str, tuple[int, ...]]
                     ) -> tuple[dict, dict[str, dict]]:
        """An output format's quantization_config for its config family, and the files the
        family adds (name -> JSON), for the modules as converted and the output tensors
        (name -> shape); kconvert.formats.quant_config picks the family."""
        raise NotImplementedError

    @classmethod
    def logical_shape(cls, infos: dict[str, TensorInfo], shape_value: tuple[int, int] | None
                      ) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def decode(cls, t: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def specs(cls, shape: tuple[int, int], input_scale: bool = False,
              group_size: int | None = None) -> list[ParamSpec]:
        """(param, dtype, shape) of every tensor an encode of one [out, in] matrix writes, with
        `group_size` elements per scale, plus its input scale where `input_scale` (W4A4)."""
        raise NotImplementedError

    @classmethod
    def output_specs(cls, shape: tuple[int, int], spec: EncodeSpec, input_scale: bool
                     ) -> list[ParamSpec]:
        """`specs` of an encode by `spec` (a format whose dtypes `spec.dtypes` choose reads
        them here)."""
        return cls.specs(shape, input_scale, spec.group_size)

    @classmethod
    def unpack(cls, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The stored values as the grid packs them densely, then the scales (NVFP4: packed
        [B, M, K/2], block scales, per-tensor scales [B]): what a lossless re-layout and the
        p48 pattern check read. Only where the format stores such values."""
        raise NotImplementedError

    @classmethod
    def relayout(cls, source: type[Codec], params: dict[str, torch.Tensor]
                 ) -> tuple[Encoded, torch.Tensor]:
        """`source`'s stacked parameters laid out in this format byte for byte, no value
        changed (densify): (the encoding, its error 0, and the amax [B] its per-tensor scales
        stand for). Only where a stage re-lays out `source` here (ModuleWork.repack)."""
        raise NotImplementedError

    @classmethod
    def stored_global_scale(cls, recorded: float, amax: float) -> torch.Tensor:
        """The per-tensor scale tensor this format stores for a fused set the manifest records
        with `recorded` (2688 / amax, compressed-tensors' form) and `amax`: what its own
        encoder writes. Only where the format has a `global_scale_param`."""
        raise NotImplementedError

    @classmethod
    def encode(cls, w: torch.Tensor, spec: EncodeSpec, *, amax: torch.Tensor | None = None,
               codes: torch.Tensor | None = None) -> Encoded:
        """fp32 weights w [B, out, in] as this format stores them. `amax` [B]: the amax each
        matrix's per-tensor scale is made for where the format has one (a fused set's members
        share the set's largest), else each matrix's own; `codes`: block-scale codes to encode
        with instead of the rule's (a method that chose them, e.g. GPTQ)."""
        raise NotImplementedError

    @classmethod
    def reads_packed(cls, source: type[Codec], device: torch.device) -> bool:
        """Whether `encode_packed` encodes `source`'s parameters as stored on `device`,
        decoding inside the encoder (no fp32 copy of the weights is ever made)."""
        return False

    @classmethod
    def encode_packed(cls, source: type[Codec], params: dict[str, torch.Tensor],
                      spec: EncodeSpec, amax: torch.Tensor) -> Encoded:
        """`encode` of `source`'s stacked parameters, where `reads_packed` says so: the same
        bytes as encode(source.decode(params), spec, amax=amax)."""
        raise NotImplementedError

    @classmethod
    def packed_amax(cls, source: type[Codec], params: dict[str, torch.Tensor]) -> torch.Tensor:
        """max |w| [B] f32 (NaN or Inf where a value is) of `source`'s stacked parameters
        that `encode_packed` takes, without an fp32 copy."""
        raise NotImplementedError

    @classmethod
    def input_scale(cls, input_amax: float) -> dict[str, torch.Tensor]:
        """A W4A4 module's stored input scale for its calibrated input amax (none where the
        format stores none)."""
        return {}


# Parameters that belong to a format but that a decode does not need (W4A4 input scales).
OPTIONAL_PARAMS = {"input_scale", "input_global_scale"}
# The quantization_config key (kconvert's own; loaders ignore it) that says which policy the
# routed experts' W4A4 input scales follow (kconvert.common.options.INPUT_SCALES).
INPUT_SCALE_POLICY = "input_scale_policy"


def input_scale_policy(modules: list[OutputModule]) -> str | None:
    """The input-scale policy of an output's W4A4 modules (one per output), or None."""
    return next((m.input_scale_policy for m in modules if m.input_scale_policy), None)
