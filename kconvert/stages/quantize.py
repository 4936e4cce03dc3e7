"""The `quantize` stage: targeted modules become NVFP4 or MXFP4 in the chosen on-disk format,
their values decided by the stage's method (kconvert.methods: round to nearest by default, or
GPTQ, kept per matrix only where it beats round to nearest on held-out calibration tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from pydantic import Field

from kconvert.calibrate.input_scales import InputScalePolicy, input_scale_policy
from kconvert.calibrate.stats import read_act_stats
from kconvert.common.options import ACTIVATIONS, BLOCK_SCALE_RULES, CASTS, INPUT_SCALE, INPUT_SCALES
from kconvert.engine.stage import StageRecord
from kconvert.errors import KconvertError, UsageError
from kconvert.formats import OUTPUT_CODECS, DenseCodec, sparse_form_formats, stored_as
from kconvert.formats.linear import ModuleWork
from kconvert.formats.nvfp4_cast import CAST_CODECS
from kconvert.methods import Method, MethodInputs, methods_of
from kconvert.methods.hessians import Calibration
from kconvert.model.names import TARGET_ROLES, Role
from kconvert.plugins.input_scales import INPUT_SCALE_POLICIES
from kconvert.plugins.methods import METHODS
from kconvert.stages.base import (
    CALIBRATION_OPTIONS,
    MethodStage,
    StageKind,
    check_needs,
    method_settings,
    prepare_method,
    with_method_records,
)


class QuantizeStageRecord(StageRecord):
    """The quantize stage's own fields; QuantizeRecord adds its methods'."""


    targets: list[str] = Field(description="roles quantized")
    format: str = Field(description="compressed-tensors | modelopt | mxfp4-pack-quantized | "
                                    "quark-mxfp4")
    block_scale: str = Field(description="block-scale rule: amax | mse")
    cast: str | None = Field(None, description="exact: MXFP4 sources cast to NVFP4 with their "
                             "codes kept where NVFP4 holds their scales, the other blocks by "
                             "block_scale")
    act_stats: str | None = Field(description="activation statistics file (W4A4), or None")
    input_scale: str | None = Field(None, description="W4A4 routed experts' input-scale "
                                    "policy (kconvert.plugins.input_scales)")
    input_scale_filled: list[str] | None = Field(
        None, description="expert, headroom: modules never routed in calibration (no amax), "
                          "given their layer's largest")
    activations: str | None = Field(None, description="MXFP4 activations: none (W4A16) or "
                                    "dynamic (W4A4, quantized at run time)")
    method: str | None = Field(default=None, description="the method, when not "
                               "round-to-nearest")


QuantizeRecord = with_method_records(QuantizeStageRecord, "quantize")


# The quantize stage's --format when neither the recipe nor the command line gives one.
FORMAT = "compressed-tensors"


@dataclass(frozen=True)
class Quantize(MethodStage):
    """Targeted modules become NVFP4 or MXFP4 in the chosen on-disk format.

    A quantized module that is not a target but is in another format is decoded to BF16:
    the output's quantization_config describes the written format only, never a stale one.
    """

    targets: frozenset[Role]
    method: Method = field(compare=False)
    fmt: str = FORMAT
    scale_rule: str = "mse"
    # Activation statistics from calibration: JSON {"input_amax": {module: amax}}. A module
    # found there is W4A4 and gets an input scale (2688/amax in compressed-tensors, amax/2688
    # in ModelOpt); without statistics the output is W4A16.
    act_stats: str | None = None
    # W4A4 routed experts' input scale (options.INPUT_SCALES); "one" is W4A4 without
    # statistics: every target's input scale 1.0.
    input_scale: str = INPUT_SCALE
    # MXFP4 only: "dynamic" declares W4A4 with activations quantized at run time (what AMD's
    # MXFP4 recipe does), "none" weight-only; None: the format's own default.
    activations: str | None = None
    # "exact": MXFP4 sources keep their codes and get exact scales (kconvert.formats.nvfp4_cast).
    cast: str = "none"
    name: str = "quantize"

    @property
    def codec(self):
        return OUTPUT_CODECS[self.fmt]

    @property
    def linear_routers(self) -> bool:
        return Role.ROUTER_WEIGHT in self.targets

    @property
    def dynamic_activations(self) -> bool:
        if self.activations is None:
            return bool(self.codec.dynamic_activations)
        return self.activations == "dynamic"

    @property
    def w4a4(self) -> bool:
        """Whether targets get input scales (calibrated, or 1.0)."""
        return self.act_stats is not None or self.scale_policy.uniform_amax is not None

    @cached_property
    def scale_policy(self) -> InputScalePolicy:
        return input_scale_policy(self.input_scale)

    @cached_property
    def policy(self) -> tuple[dict[str, float], list[str]]:
        """(input amax per module under the input-scale policy, the experts never routed in
        calibration that took their layer's largest)."""
        if self.act_stats is None:
            return {}, []
        return self.scale_policy.amax(read_act_stats(self.act_stats))

    @property
    def input_amax(self) -> dict[str, float]:
        return self.policy[0]

    def input_files(self) -> list[str]:
        return ([self.act_stats] if self.act_stats else []) + super().input_files()

    def record(self) -> QuantizeRecord:
        record = QuantizeRecord(targets=sorted(r.value for r in self.targets), format=self.fmt,
                                block_scale=self.scale_rule, act_stats=self.act_stats,
                                **self.method.record())
        if self.w4a4 and self.codec.input_scale_param is not None:
            record.input_scale = self.input_scale
            if self.policy[1]:
                record.input_scale_filled = self.policy[1]
        if self.codec.dynamic_activations is not None:  # NVFP4's stay as they were
            record.activations = "dynamic" if self.dynamic_activations else "none"
        if self.cast != "none":
            record.cast = self.cast
        return record





    def claim(self, m: ModuleWork) -> None:
        codec = self.codec
        if m.tn.role not in self.targets:
            if m.transform is not None:
                raise KconvertError("a sparsified module must also be quantized: add its role "
                                    "to the quantize stage's targets", tensor=m.module)
            if m.codec.quantized and m.codec is not codec:
                m.out_codec = DenseCodec
                m.stages.append("dequant")
            return
        uniform = self.scale_policy.uniform_amax
        m.input_amax = uniform if uniform is not None else self.input_amax.get(m.module)
        if m.input_amax is not None:
            m.input_scale_policy = self.input_scale
        if self.act_stats is not None and m.input_amax is None:
            # One config group describes every target: all W4A4 or none.
            raise KconvertError("activation statistics have no input amax for this "
                                "targeted module", file=self.act_stats, tensor=m.module)
        block = m.group_size or codec.default_group_size
        if block and m.shape[1] % block:
            raise KconvertError(f"input dimension {m.shape[1]} is not a multiple of {block}; "
                                f"{codec.description} needs it",
                                file=m.primary.file.name, tensor=m.primary.name)
        if m.group_size is not None:  # set by a sparsify stage
            check_sparse_form(self.fmt, m.group_size, m.storage, tensor=m.module)
        m.out_codec = stored_as(codec, m.storage)
        if self.cast != "none":
            m.out_codec = self._cast_codec(m)
        m.group_size = block
        if codec.dynamic_activations is not None:
            m.dynamic_activations = self.dynamic_activations
        if self.method.transforms(m):
            if m.transform is not None:
                raise KconvertError(f"--method {self.method.name} changes the values of "
                                    "unsparsified weights, and a sparsify stage already "
                                    "decides this module's (its own --method)", tensor=m.module)
            m.transform = self.method
        m.stages.append(self.name)

    def _cast_codec(self, m: ModuleWork):
        """The codec that casts m exactly: m must be MXFP4, left to its codes."""
        cast = CAST_CODECS.get(m.out_codec)  # type: ignore[arg-type]
        if cast is None:
            raise KconvertError(f"--cast {self.cast} writes dense NVFP4 (compressed-tensors or "
                                f"modelopt), not {m.out_codec.description} "  # type: ignore[union-attr]
                                f"(block size {m.group_size or m.out_codec.default_group_size}"
                                f", {m.storage} storage)", tensor=m.module)
        if not cast.casts(m.codec):
            raise KconvertError(f"--cast {self.cast} casts MXFP4 modules; this one is "
                                f"{m.codec.description}: leave its role out of --targets or "
                                "drop --cast", file=m.primary.file.name, tensor=m.module)
        if m.transform is not None or self.method.transforms(m):
            raise KconvertError(f"--cast {self.cast} keeps the source's codes; a method that "
                                "changes the weights (a sparsify stage, --method gptq) cannot "
                                "run with it", tensor=m.module)
        return cast


# What --targets may name: the linears' roles, and the MoE routers (AMD's MXFP4 recipe).
QUANTIZE_TARGETS = {**TARGET_ROLES, "routers": Role.ROUTER_WEIGHT}


def parse_targets(spec: str | list[str] | tuple[str, ...]) -> frozenset[Role]:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n.strip() not in QUANTIZE_TARGETS]
    if unknown:
        raise UsageError(f"unknown --targets {unknown}; choose from {sorted(QUANTIZE_TARGETS)}")
    return frozenset(QUANTIZE_TARGETS[n.strip()] for n in names if n.strip())


def check_sparse_form(fmt: str, group_size: int, storage: str, tensor: str | None = None
                      ) -> None:
    """A sparsify stage's blocks against the quantize stage's --format: the format must write
    that paired-4:8 form (block size and storage)."""
    writers = sparse_form_formats(group_size, storage)
    if fmt not in writers:
        raise UsageError(f"--format {fmt} has no form for block size {group_size} / {storage} "
                         "storage" + (f"; use {' or '.join(writers)}" if writers else ""),
                         tensor=tensor)


def check(tables: tuple[dict, ...], at: int) -> None:
    """The quantize stage `tables[at]`'s settings, from the options alone (StageKind.check)."""
    settings = tables[at]
    fmt = settings.get("format", FORMAT)
    if fmt not in OUTPUT_CODECS:
        raise KconvertError(f"unknown format {fmt!r}")
    codec = OUTPUT_CODECS[fmt]
    activations, dynamic = settings.get("activations"), codec.dynamic_activations
    if activations is not None:
        if activations not in ACTIVATIONS:
            raise UsageError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        if dynamic is None:
            raise UsageError(f"--activations is for the MXFP4 formats; --format {fmt} "
                             "is W4A4 through calibrated --act-stats")
    if settings.get("act_stats") is not None and dynamic is not None:
        raise UsageError(f"--format {fmt} quantizes activations at run time "
                         "(--activations dynamic); it takes no --act-stats")
    input_scale = settings.get("input_scale") or INPUT_SCALE
    if input_scale not in INPUT_SCALES:
        raise KconvertError(f"unknown input_scale {input_scale!r}; choose from "
                            f"{list(INPUT_SCALES)}")
    if settings.get("input_scale") is not None:
        if dynamic is not None:
            raise UsageError(f"--input-scale is for NVFP4 W4A4; --format {fmt} quantizes "
                             "activations at run time with no input scale")
        from_stats = INPUT_SCALE_POLICIES.get(Quantize.name, input_scale).needs is not None
        if from_stats != (settings.get("act_stats") is not None):
            raise UsageError(f"--input-scale {input_scale} takes the calibrated input amax: "
                             "give --act-stats" if from_stats else
                             f"--input-scale {input_scale} writes its scales without "
                             "statistics: give no --act-stats")
    targets = parse_targets(settings.get("targets", ["experts"]))
    if Role.ROUTER_WEIGHT in targets and not codec.quantizes_routers:
        others = [f for f, c in OUTPUT_CODECS.items() if c.quantizes_routers]
        raise UsageError(f"--targets routers: only {', '.join(others)} quantizes the "
                         f"routers (AMD's MXFP4 recipe), not --format {fmt}")
    scale_rule = settings.get("block_scale", Quantize.scale_rule)
    if scale_rule not in BLOCK_SCALE_RULES:  # a recipe file's value: checked before any write
        raise KconvertError(f"unknown block_scale {scale_rule!r}; choose from "
                            f"{list(BLOCK_SCALE_RULES)}")
    cast = settings.get("cast") or Quantize.cast
    if cast not in CASTS:
        raise KconvertError(f"unknown cast {cast!r}; choose from {list(CASTS)}")
    method, _own = method_settings(Quantize.name, settings)
    if not method.supports(codec):
        formats = [f for f, c in OUTPUT_CODECS.items() if method.supports(c)]
        methods = [n for n, m in methods_of(Quantize.name).items() if m.supports(codec)]
        raise UsageError(f"--method {method.name} writes {method.grid} ({', '.join(formats)}); "
                         f"--format {fmt} is quantized by --method {' or '.join(methods)} only")


def build(settings: dict, calibration: Calibration | None) -> Quantize:
    check((settings,), 0)
    targets = parse_targets(settings.get("targets", ["experts"]))
    method, own = method_settings(Quantize.name, settings)
    check_needs(method, calibration, None)
    return Quantize(targets=targets, method=method(MethodInputs(targets, calibration,
                                                                settings=own)),
                    fmt=settings.get("format", FORMAT),
                    scale_rule=settings.get("block_scale", Quantize.scale_rule),
                    act_stats=settings.get("act_stats"), activations=settings.get("activations"),
                    cast=settings.get("cast") or Quantize.cast,
                    input_scale=settings.get("input_scale") or INPUT_SCALE)


KIND = StageKind(Quantize.name, build, QuantizeRecord, check=check,
                 settings=("targets", "format", "block_scale", "cast", "act_stats",
                           "input_scale", "activations", "method",
                           *METHODS.setting_names(Quantize.name)),
                 input_options=CALIBRATION_OPTIONS, input_type=Calibration,
                 prepare=prepare_method(Quantize.name), encodes=True, quantizes=True)
