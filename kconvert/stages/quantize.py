"""The `quantize` stage: targeted modules become NVFP4 or MXFP4 in the chosen on-disk format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import Field

from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError, UsageError
from kconvert.formats import OUTPUT_CODECS, DenseCodec, Nvfp4PairBitmaskCodec
from kconvert.formats.linear import ModuleWork
from kconvert.model.names import TARGET_ROLES, Role
from kconvert.options import ACTIVATIONS, BLOCK_SCALE_RULES
from kconvert.stages.base import StageKind


class QuantizeRecord(StageRecord):
    targets: list[str] = Field(description="roles quantized")
    format: str = Field(description="compressed-tensors | modelopt | mxfp4-pack-quantized | "
                                    "quark-mxfp4")
    block_scale: str = Field(description="block-scale rule: amax | mse")
    act_stats: str | None = Field(description="activation statistics file (W4A4), or None")
    activations: str | None = Field(None, description="MXFP4 activations: none (W4A16) or "
                                    "dynamic (W4A4, quantized at run time)")


@dataclass(frozen=True)
class Quantize(Stage):
    """Targeted modules become NVFP4 or MXFP4 in the chosen on-disk format.

    A quantized module that is not a target but is in another format is decoded to BF16:
    the output's quantization_config describes the written format only, never a stale one.
    """

    targets: frozenset[Role]
    fmt: str = "compressed-tensors"
    scale_rule: str = "mse"
    # Activation statistics from calibration: JSON {"input_amax": {module: amax}}. A module
    # found there is W4A4 and gets an input scale (2688/amax in compressed-tensors, amax/2688
    # in ModelOpt); without statistics the output is W4A16.
    act_stats: str | None = None
    # MXFP4 only: "dynamic" declares W4A4 with activations quantized at run time (what AMD's
    # MXFP4 recipe does), "none" weight-only; None: the format's own default.
    activations: str | None = None
    name: str = "quantize"

    @property
    def linear_routers(self) -> bool:
        return Role.ROUTER_WEIGHT in self.targets

    @property
    def dynamic_activations(self) -> bool:
        if self.activations is None:
            return bool(OUTPUT_CODECS[self.fmt].dynamic_activations)
        return self.activations == "dynamic"

    @cached_property
    def input_amax(self) -> dict[str, float]:
        if self.act_stats is None:
            return {}
        try:
            return {k: float(v) for k, v in
                    json.loads(Path(self.act_stats).read_text())["input_amax"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KconvertError(f"bad activation statistics: {exc}", file=self.act_stats) from exc

    def input_files(self) -> list[str]:
        return [self.act_stats] if self.act_stats else []

    def record(self) -> QuantizeRecord:
        record = QuantizeRecord(targets=sorted(r.value for r in self.targets), format=self.fmt,
                                block_scale=self.scale_rule, act_stats=self.act_stats)
        if OUTPUT_CODECS[self.fmt].dynamic_activations is not None:  # NVFP4's stay as they were
            record.activations = "dynamic" if self.dynamic_activations else "none"
        return record

    def claim(self, m: ModuleWork) -> None:
        if m.tn.role in self.targets:
            m.input_amax = self.input_amax.get(m.module)
            if self.act_stats is not None and m.input_amax is None:
                # One config group describes every target: all W4A4 or none.
                raise KconvertError("activation statistics have no input amax for this "
                                    "targeted module", file=self.act_stats, tensor=m.module)
            codec = OUTPUT_CODECS[self.fmt]
            block = codec.default_group_size
            if m.shape[1] % block:
                raise KconvertError(
                    f"input dimension {m.shape[1]} is not a multiple of {block}; "
                    f"{codec.description} needs it",
                    file=m.primary.file.name, tensor=m.primary.name,
                )
            m.out_codec = codec
            if codec.encodes_itself:
                if m.transform is not None:
                    raise KconvertError(f"--format {self.fmt}: sparsify writes NVFP4 only; "
                                        "use compressed-tensors", tensor=m.module)
                m.group_size = block
                m.dynamic_activations = self.dynamic_activations
                m.stages.append(self.name)
                return
            if m.storage == "pair-bitmask" or m.group_size != 16:
                if not m.out_codec.p48_forms:
                    others = [f for f, c in OUTPUT_CODECS.items() if c.p48_forms]
                    raise KconvertError(f"--format {self.fmt} has no form for block size "
                                        f"{m.group_size} / {m.storage} storage; use "
                                        f"{' or '.join(others)}", tensor=m.module)
                if m.storage == "pair-bitmask":
                    m.out_codec = Nvfp4PairBitmaskCodec
            m.stages.append(self.name)
        elif m.transform is not None:
            raise KconvertError("a sparsified module must also be quantized: add its role to "
                                "the quantize stage's targets", tensor=m.module)
        elif m.codec.quantized and m.codec is not OUTPUT_CODECS[self.fmt]:
            m.out_codec = DenseCodec
            m.stages.append("dequant")


# What --targets may name: the linears' roles, and the MoE routers (AMD's MXFP4 recipe).
QUANTIZE_TARGETS = {**TARGET_ROLES, "routers": Role.ROUTER_WEIGHT}


def parse_targets(spec: str | list[str] | tuple[str, ...]) -> frozenset[Role]:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n.strip() not in QUANTIZE_TARGETS]
    if unknown:
        raise UsageError(f"unknown --targets {unknown}; choose from {sorted(QUANTIZE_TARGETS)}")
    return frozenset(QUANTIZE_TARGETS[n.strip()] for n in names if n.strip())


def build(settings: dict, _input: None) -> Quantize:
    fmt = settings.get("format", "compressed-tensors")
    if fmt not in OUTPUT_CODECS:
        raise KconvertError(f"unknown format {fmt!r}")
    activations, dynamic = settings.get("activations"), OUTPUT_CODECS[fmt].dynamic_activations
    if activations is not None:
        if activations not in ACTIVATIONS:
            raise UsageError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        if dynamic is None:
            raise UsageError(f"--activations is for the MXFP4 formats; --format {fmt} "
                             "is W4A4 through calibrated --act-stats")
    if settings.get("act_stats") is not None and dynamic is not None:
        raise UsageError(f"--format {fmt} quantizes activations at run time "
                         "(--activations dynamic); it takes no --act-stats")
    targets = parse_targets(settings.get("targets", ["experts"]))
    if Role.ROUTER_WEIGHT in targets and not OUTPUT_CODECS[fmt].quantizes_routers:
        others = [f for f, c in OUTPUT_CODECS.items() if c.quantizes_routers]
        raise UsageError(f"--targets routers: only {', '.join(others)} quantizes the "
                         f"routers (AMD's MXFP4 recipe), not --format {fmt}")
    scale_rule = settings.get("block_scale", "mse")
    if scale_rule not in BLOCK_SCALE_RULES:  # a recipe file's value: checked before any write
        raise KconvertError(f"unknown block_scale {scale_rule!r}; choose from "
                            f"{list(BLOCK_SCALE_RULES)}")
    return Quantize(targets=targets, fmt=fmt, scale_rule=scale_rule,
                    act_stats=settings.get("act_stats"), activations=activations)


KIND = StageKind(Quantize.name, build, QuantizeRecord,
                 settings=("targets", "format", "block_scale", "act_stats", "activations"))
