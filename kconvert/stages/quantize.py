"""The `quantize` stage: targeted modules become NVFP4 or MXFP4 in the chosen on-disk format.
NVFP4 by round-to-nearest (`rtn`) or by the OBS engine's GPTQ (`gptq`, kconvert.methods.obs),
which is kept per matrix only where its output error on held-out calibration tokens is below
RTN's; MXFP4 by round-to-nearest only."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from pydantic import Field

from kconvert.engine.stage import Stage, StageRecord
from kconvert.errors import KconvertError, UsageError
from kconvert.formats import OUTPUT_CODECS, DenseCodec, Nvfp4PairBitmaskCodec
from kconvert.formats.linear import ModuleWork
from kconvert.gpu_budget import GpuRequest
from kconvert.gpu_plan import GpuPlan, GpuWork, Shapes
from kconvert.io.checkpoint import Checkpoint
from kconvert.methods import obs
from kconvert.methods.hessians import Calibration
from kconvert.model.names import TARGET_ROLES, Role
from kconvert.options import (
    ACTIVATIONS,
    BLOCK_SCALE_RULES,
    QUANTIZE_METHODS,
    SPARSEGPT_SAMPLES,
    SPARSIFY_METHODS,
    calibration_run,
)
from kconvert.stages.base import CALIBRATION_OPTIONS, StageKind

# The roles GPTQ has Hessians for, all from the layer-streamed calibration: the experts' from
# the MoE block's captured inputs, attention's and the dense MLP's from the input Grams the
# forward collects (obs.EXPERT_ROLES and the rest). A targeted router (MXFP4 only, where gptq
# is refused) is not among them; the manifest records them as `gptq_targets`.
GPTQ_ROLES = (Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.DENSE_MLP, Role.ATTENTION)


class QuantizeRecord(StageRecord):
    targets: list[str] = Field(description="roles quantized")
    format: str = Field(description="compressed-tensors | modelopt | mxfp4-pack-quantized | "
                                    "quark-mxfp4")
    block_scale: str = Field(description="block-scale rule: amax | mse")
    act_stats: str | None = Field(description="activation statistics file (W4A4), or None")
    activations: str | None = Field(None, description="MXFP4 activations: none (W4A16) or "
                                    "dynamic (W4A4, quantized at run time)")
    method: str | None = Field(default=None, description="gptq when not round-to-nearest")
    gptq_targets: list[str] | None = Field(
        default=None, description="gptq: the targeted roles quantized by GPTQ (the others RTN)")
    percdamp: float | None = None
    blocksize: int | None = None
    data: dict | None = Field(default=None, description="gptq: the calibration data")


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
    method: str = "rtn"
    calibration: Calibration | None = field(default=None, compare=False)
    name: str = "quantize"

    @property
    def linear_routers(self) -> bool:
        return Role.ROUTER_WEIGHT in self.targets

    @property
    def dynamic_activations(self) -> bool:
        if self.activations is None:
            return bool(OUTPUT_CODECS[self.fmt].dynamic_activations)
        return self.activations == "dynamic"

    def __post_init__(self) -> None:
        if self.method not in QUANTIZE_METHODS:
            raise KconvertError(f"unknown --method {self.method!r}; choose from "
                                f"{QUANTIZE_METHODS}")
        if self.method == "gptq" and self.calibration is None:
            raise KconvertError("--method gptq needs calibration data: --data FILE")
        if self.method == "gptq":
            self.calibration.hessians.gram_roles = frozenset(
                r for r in self.gptq_roles if r not in obs.EXPERT_ROLES)

    @property
    def ordered_layers(self) -> bool:
        """GPTQ's calibration pass streams layers forward: items must follow."""
        return self.method == "gptq"

    @property
    def gptq_roles(self) -> list[Role]:
        return [r for r in GPTQ_ROLES if r in self.targets] if self.method == "gptq" else []

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
        out = {"targets": sorted(r.value for r in self.targets), "format": self.fmt,
               "block_scale": self.scale_rule, "act_stats": self.act_stats}
        if self.method == "gptq":  # an RTN run's record is unchanged
            out.update(method=self.method, gptq_targets=sorted(r.value for r in self.gptq_roles),
                       percdamp=obs.PERCDAMP, blocksize=obs.BLOCKSIZE,
                       data=self.calibration.data)
        record = QuantizeRecord(**out)
        if OUTPUT_CODECS[self.fmt].dynamic_activations is not None:  # NVFP4's stay as they were
            record.activations = "dynamic" if self.dynamic_activations else "none"
        return record

    def close(self) -> None:
        if self.calibration is not None:
            self.calibration.hessians.close()

    def work_elems(self, device: torch.device) -> int | None:
        """GPTQ's items on a CPU, sized as the OBS engine's (on a GPU the command's memory
        plan sizes them, from `gpu_work`)."""
        return obs.CPU_WORK_ELEMS if self.method == "gptq" else None

    def gpu_work(self, shapes: Shapes) -> GpuWork | None:
        """GPTQ's calibration forward beside the engine and its OBS batches."""
        if self.method != "gptq":
            return None
        return self.calibration.hessians.gpu_work(
            shapes, shared=Role.SHARED_EXPERT in self.gptq_roles, against_rtn=True)

    def use_gpu_plan(self, plan: GpuPlan) -> None:
        if self.calibration is not None:
            self.calibration.hessians.gpu_plan = plan

    def transform(self, modules, w, gs, scale_rule, local_dtype, arithmetic):
        """GPTQ on the decoded target weights w [B, M, K], per matrix kept only where it beats
        RTN on held-out tokens (obs.HELDOUT_EVERY); the choices go to the manifest (`obs`)."""
        hessians = self.calibration.hessians

        def split(mb: obs.Member) -> obs.HessianSplit:
            if mb.inputs is not None:
                return hessians.linear_hessians(mb.layer, mb.inputs)
            return hessians.split_hessians(mb.layer, mb.expert, mb.proj)

        out, codes, choices = obs.quantize_batches(
            w, gs, obs.members_of([m.tn for m in modules]), split,
            modules[0].group_size, scale_rule, local_dtype, arithmetic, against_rtn=True,
            budget=hessians.obs_budget(w.device))
        return out, codes, [asdict(c) for c in choices]

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
            if m.tn.role in self.gptq_roles:
                if m.transform is not None:
                    raise KconvertError("--method gptq quantizes unsparsified weights; a p48 "
                                        "run's error-compensated method is sparsify --method "
                                        "sparsegpt", tensor=m.module)
                m.transform = self
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


def build(settings: dict, calibration: Calibration | None) -> Quantize:
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
    method = settings.get("method", "rtn")
    if method in SPARSIFY_METHODS:
        # In a recipe with a sparsify stage, --method names the sparsify method (`prepare`
        # refuses those where there is none): this stage rounds.
        method = "rtn"
    check_method_format(method, fmt)
    return Quantize(targets=targets, fmt=fmt, scale_rule=scale_rule,
                    act_stats=settings.get("act_stats"), activations=activations,
                    method=method, calibration=calibration)


def check_method_format(method: str, fmt: str) -> None:
    """GPTQ is implemented for NVFP4 (the OBS engine's E2M1 grid with FP8 block scales);
    the MXFP4 formats are round-to-nearest only."""
    if method == "gptq" and OUTPUT_CODECS[fmt].encodes_itself:
        nvfp4 = [f for f, c in OUTPUT_CODECS.items() if not c.encodes_itself]
        raise UsageError(f"--method gptq writes NVFP4 ({', '.join(nvfp4)}); --format {fmt} "
                         "is quantized by --method rtn only")


def prepare(stages: tuple[dict, ...], options: dict, gpu: GpuRequest
            ) -> Callable[[Checkpoint], Calibration] | None:
    """GPTQ's calibration from --data when the run's quantize method is gptq (a recipe without
    a sparsify stage: with one, --method is the sparsify method); None otherwise. gptq without
    --data is a usage error."""
    kinds = [s["stage"] for s in stages]
    if "sparsify" in kinds:
        return None
    recipe_methods = [s.get("method", "rtn") for s in stages if s["stage"] == "quantize"]
    method = options.get("method") or next(iter(recipe_methods), "rtn")
    if method not in QUANTIZE_METHODS:
        raise UsageError(f"--method {method} is a sparsify method; this recipe quantizes "
                         f"without sparsifying: --method {' or '.join(QUANTIZE_METHODS)}")
    data = options.get("data")
    if data is not None and method != "gptq" and "prune" not in kinds:
        raise UsageError(f"--data serves --method gptq; this run's quantize method is {method}")
    if method != "gptq":
        return None
    if data is None:
        raise UsageError("--method gptq needs calibration data: --data FILE")

    def make(ckpt: Checkpoint) -> Calibration:
        samples, seq_len, batch_size, seed = calibration_run(options, SPARSEGPT_SAMPLES)
        return Calibration.from_file(ckpt, data, samples, seq_len, batch_size, seed,
                                     gpu.device)

    return make


KIND = StageKind(Quantize.name, build, QuantizeRecord,
                 settings=("targets", "format", "block_scale", "act_stats", "activations",
                           "method"),
                 input_options=CALIBRATION_OPTIONS, input_type=Calibration, prepare=prepare)
