"""The `quantize` stage: targeted modules become NVFP4 in the chosen on-disk flavour."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pydantic import Field

from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError
from kconvert.formats import OUTPUT_CODECS, DenseCodec, Nvfp4PairBitmaskCodec
from kconvert.formats.linear import ModuleWork
from kconvert.model.names import TARGET_ROLES, Role
from kconvert.stages.base import StageKind


class QuantizeRecord(StageRecord):
    targets: list[str] = Field(description="roles made NVFP4")
    format: str = Field(description="compressed-tensors | modelopt")
    block_scale: str = Field(description="FP8 block-scale rule: amax | mse")
    act_stats: str | None = Field(description="activation statistics file (W4A4), or None")


@dataclass(frozen=True)
class Quantize(Stage):
    """Targeted modules become NVFP4 in the chosen on-disk flavour.

    A quantized module that is not a target but is in another format is decoded to BF16:
    the output's quantization_config describes NVFP4 only, never a stale format.
    """

    targets: frozenset[Role]
    fmt: str = "compressed-tensors"
    scale_rule: str = "mse"
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

    def input_files(self) -> list[str]:
        return [self.act_stats] if self.act_stats else []

    def record(self) -> QuantizeRecord:
        return QuantizeRecord(targets=sorted(r.value for r in self.targets), format=self.fmt,
                              block_scale=self.scale_rule, act_stats=self.act_stats)

    def claim(self, m: ModuleWork) -> None:
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


def parse_targets(spec: str | list[str] | tuple[str, ...]) -> frozenset[Role]:
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n.strip() not in TARGET_ROLES]
    if unknown:
        raise KconvertError(f"unknown --targets {unknown}; choose from {sorted(TARGET_ROLES)}")
    return frozenset(TARGET_ROLES[n.strip()] for n in names if n.strip())


def build(settings: dict, _input: None) -> Quantize:
    fmt = settings.get("format", "compressed-tensors")
    if fmt not in OUTPUT_CODECS:
        raise KconvertError(f"unknown format {fmt!r}")
    return Quantize(targets=parse_targets(settings.get("targets", ["experts"])), fmt=fmt,
                    scale_rule=settings.get("block_scale", "mse"),
                    act_stats=settings.get("act_stats"))


KIND = StageKind(Quantize.name, build, QuantizeRecord,
                 settings=("targets", "format", "block_scale", "act_stats"))
