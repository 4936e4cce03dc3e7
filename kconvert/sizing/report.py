"""`kconvert inspect`: the checkpoint, the output an option would write, and how it fits."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kconvert.common.options import STREAM_WINDOW
from kconvert.engine.source_order import HubDisk, hub_disk
from kconvert.io.files import human_bytes
from kconvert.model.names import parse_name
from kconvert.sizing.deploy import (
    GIB,
    Parallelism,
    kv_bytes_per_token_layer,
    kv_layers_per_stage,
    max_context_tokens,
    per_gpu_bytes,
)
from kconvert.sizing.predict import COMPONENTS, Options, component_bytes, predict


@dataclass
class Fit:
    """The served checkpoint on the given GPUs."""

    parallelism: Parallelism
    per_stage_gpu_bytes: list[int]
    kv_dtype: str
    kv_bytes_per_token_layer: int
    stage_layers: list[int]  # decoder layers per pipeline stage holding a per-token KV cache
    gpu_mem_bytes: int | None = None
    context: int | None = None

    @property
    def per_gpu_bytes(self) -> int:
        return max(self.per_stage_gpu_bytes)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self.kv_bytes_per_token_layer * max(self.stage_layers)

    @property
    def max_context_tokens(self) -> int | None:
        if self.gpu_mem_bytes is None:
            return None
        return max_context_tokens(self.per_stage_gpu_bytes, self.stage_layers,
                                  self.kv_bytes_per_token_layer, self.gpu_mem_bytes)


@dataclass
class InspectReport:
    source: dict
    checkpoint_bytes: int
    checkpoint_components: dict[str, int]
    checkpoint_tensors: int
    recipe: str | None
    options: Options
    output_bytes: int
    output_file_bytes: int
    output_components: dict[str, int]
    output_tensors: int
    num_layers: int
    max_position_embeddings: int | None
    kv_bytes_per_token: int
    fit: Fit
    warnings: list[str] = field(default_factory=list)
    hub_disk: HubDisk | None = None  # a Hub repo id: the disk of a streamed vs a cached run
    # GPU memory each GPU command plans on this model at its defaults (gpu_budget)
    gpu_budget: int | None = None
    gpu_plans: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        fit = self.fit
        context = None
        if fit.context is not None:
            kv = fit.context * fit.kv_bytes_per_token_per_gpu
            context = {"tokens": fit.context, "kv_bytes_per_gpu": kv,
                       "fits": (None if fit.gpu_mem_bytes is None
                                else fit.per_gpu_bytes + kv <= fit.gpu_mem_bytes)}
        return {
            "source": self.source,
            "checkpoint": {"total_bytes": self.checkpoint_bytes,
                           "components": self.checkpoint_components,
                           "tensors": self.checkpoint_tensors},
            "output": {"recipe": self.recipe,
                       "options": {k: v for k, v in asdict(self.options).items()
                                   if v is not None},
                       "total_bytes": self.output_bytes, "file_bytes": self.output_file_bytes,
                       "components": self.output_components, "tensors": self.output_tensors},
            "parallelism": asdict(fit.parallelism),
            "per_gpu_bytes": fit.per_gpu_bytes,
            "per_stage_gpu_bytes": fit.per_stage_gpu_bytes,
            "gpu_mem_bytes": fit.gpu_mem_bytes,
            "kv_dtype": fit.kv_dtype,
            "num_layers": self.num_layers,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_gpu": fit.kv_bytes_per_token_per_gpu,
            "max_context_tokens": fit.max_context_tokens,
            "max_position_embeddings": self.max_position_embeddings,
            "context": context,
            "gpu_memory": {"budget": self.gpu_budget, "commands": {
                name: {k: v for k, v in plan.items() if k != "lines"}
                for name, plan in self.gpu_plans.items()}},
            "warnings": self.warnings,
            "disk_from_hub": self.hub_disk.to_json() if self.hub_disk is not None else None,
        }

    def render(self) -> str:
        data = self.to_json()
        fit = self.fit
        par = fit.parallelism
        what = self.recipe or "unchanged"
        lines = [f"{'component':<20} {'checkpoint':>14} {'output':>14}"]
        for name in COMPONENTS:
            lines.append(f"{name:<20} {human_bytes(self.checkpoint_components[name]):>14} "
                         f"{human_bytes(self.output_components[name]):>14}")
        lines.append(f"{'total':<20} {human_bytes(self.checkpoint_bytes):>14} "
                     f"{human_bytes(self.output_bytes):>14}")
        lines.append(f"output: {what}; {self.output_bytes:,} tensor bytes, "
                     f"{self.output_file_bytes:,} bytes of shard files")
        lines.append(f"GPUs: {par.gpus} (TP {par.tp}, EP {par.ep}, PP {par.pp}): "
                     f"{human_bytes(fit.per_gpu_bytes)} of weights on the fullest GPU")
        lines.append(f"KV cache ({fit.kv_dtype}, MLA): {self.kv_bytes_per_token:,} bytes per "
                     f"token over {sum(fit.stage_layers)} layers, "
                     f"{fit.kv_bytes_per_token_per_gpu:,} per GPU")
        if fit.gpu_mem_bytes is not None:
            tokens = fit.max_context_tokens
            limit = (f" (the model's own limit: {self.max_position_embeddings:,})"
                     if self.max_position_embeddings else "")
            if tokens:
                lines.append(f"longest context beside the weights in "
                             f"{fit.gpu_mem_bytes / GIB:.1f} GiB per GPU: {tokens:,} tokens"
                             + limit)
            else:
                lines.append(f"does not fit: {human_bytes(fit.per_gpu_bytes)} of weights per "
                             f"GPU, {fit.gpu_mem_bytes / GIB:.1f} GiB usable")
        if data["context"] is not None:
            c = data["context"]
            verdict = {None: "", True: ": fits", False: ": does not fit"}[c["fits"]]
            lines.append(f"context {c['tokens']:,} tokens: {human_bytes(c['kv_bytes_per_gpu'])}"
                         f" of KV cache per GPU{verdict}")
        if self.hub_disk is not None:
            lines += self.hub_disk.lines()
        if self.gpu_plans:
            lines.append(f"GPU memory of each command at its defaults, on one GPU with a "
                         f"{self.gpu_budget / GIB:.1f} GiB budget (--gpu-memory):")
            for name, plan in self.gpu_plans.items():
                lines += plan["lines"] if plan["fits"] else [f"{name}: {plan['error']}"]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def inspect_checkpoint(src: str, options: Options, *, gpus: int | None = None,
                       gpu_mem: float | None = None, mem_util: float = 0.9,
                       tp: int | None = None, ep: int | None = None, pp: int | None = None,
                       context: int | None = None, kv_dtype: str = "bf16",
                       revision: str | None = None, token: str | None = None,
                       cache_dir: str | None = None, window: int = STREAM_WINDOW,
                       gpu_memory: str | int | None = None) -> InspectReport:
    """Inspect SRC (a directory or Hub repo id) from its headers and config alone; the GPU
    memory plans are for `gpu_memory` (default: this machine's first GPU's default budget,
    else an 80 GB H100's)."""
    from kconvert.gpu.budget import GpuRequest, size_option
    from kconvert.gpu.devices import pick_device
    from kconvert.io.remote import open_headers
    from kconvert.sizing.gpu_memory import command_plans

    par = Parallelism.resolve(gpus, tp, ep, pp)
    ckpt = open_headers(src, revision, token=token, cache_dir=cache_dir)
    try:
        prediction = predict(ckpt, options)
        text = ckpt.text_config
        num_layers = int(text.get("num_hidden_layers", 0))
        per_layer = kv_bytes_per_token_layer(text, kv_dtype)
        fit = Fit(par, per_gpu_bytes(prediction.tensors, num_layers, par), kv_dtype, per_layer,
                  kv_layers_per_stage(text, num_layers, par.pp),
                  None if gpu_mem is None else int(gpu_mem * mem_util * GIB), context)
        source = [(parse_name(n), i.nbytes) for n, i in ckpt.tensors.items()]
        budget = GpuRequest(pick_device("auto"), size_option(gpu_memory)).context.plan_budget
        warnings = []
        if context and text.get("max_position_embeddings") and \
                context > text["max_position_embeddings"]:
            warnings.append(f"--context {context} is beyond the model's max_position_embeddings "
                            f"{text['max_position_embeddings']}")
        return InspectReport(
            source=ckpt.identity, checkpoint_bytes=sum(n for _, n in source),
            checkpoint_components=component_bytes(source), checkpoint_tensors=len(source),
            recipe=prediction.recipe, options=options, output_bytes=prediction.total_bytes,
            output_file_bytes=prediction.file_bytes,
            output_components=prediction.components, output_tensors=len(prediction.tensors),
            num_layers=num_layers, max_position_embeddings=text.get("max_position_embeddings"),
            kv_bytes_per_token=per_layer * sum(fit.stage_layers), fit=fit, warnings=warnings,
            hub_disk=hub_disk(prediction.plan, window, token),
            gpu_budget=budget, gpu_plans=command_plans(text, budget))
    finally:
        ckpt.close()
