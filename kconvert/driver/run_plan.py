"""What a conversion run will do, decided before anything is written: its stages, the work
plan, the GPU memory plan on the run's GpuContext and, under torchrun, which rank computes
which routed experts; with the checks of the source that need the plan (kconvert.driver.convert runs
it)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kconvert.checks.structure import validate_source
from kconvert.common import distributed, events
from kconvert.driver.recipes import Recipe, build_stages
from kconvert.engine.execute import gpu_encode
from kconvert.engine.stage import Stage
from kconvert.engine.work import Part, TransformItem, WorkPlan, build_work_plan, header_shape_values
from kconvert.errors import KconvertError
from kconvert.formats.linear import ModuleWork
from kconvert.gpu.budget import GpuContext
from kconvert.gpu.plan import GpuMemoryError, GpuPlan, gib, plan_gpu
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.remote import HeaderOnlyShard
from kconvert.io.stream import StreamedShard
from kconvert.model.names import Role

log = logging.getLogger(__name__)


def plan_run(ckpt: Checkpoint, recipe: Recipe, settings: Mapping[str, object],
             inputs: Mapping[str, object], dry_run: bool, context: GpuContext, say
             ) -> tuple[list, WorkPlan, GpuPlan | None, Part | None]:
    """The stages, the work plan, the GPU memory plan on the run's GpuContext and, under
    torchrun, which rank computes which routed experts (`expert_part`), after the checks of
    the source."""
    stages = build_stages(recipe, settings, inputs)
    part = expert_part(ckpt, stages)
    device = context.device
    # GPU items as the GPU memory plan sizes them (engine.execute.gpu_encode). On a CPU, items
    # of 2^24 elements (~one expert matrix; the fused kernel is per row anyway) keep the
    # decode temporaries to ~200 MB (measured in tests/engine/test_memory_bound.py).
    def gpu_plan(budget: int, largest: int | None = None) -> GpuPlan | None:
        """The plan on a GPU; on a CPU (a dry run shows it) what the run would need on one:
        told, never a refusal of a run on this device."""
        try:
            return plan_gpu(ckpt, stages, budget, recipe.name, largest, encode=gpu_encode())
        except GpuMemoryError as exc:
            if device.type == "cuda":
                raise
            say(f"note: on a GPU with a {gib(budget)} budget this run would not fit ({exc}); "
                f"on {device} it runs without a GPU memory plan")
            return None

    gpu = gpu_plan(context.plan_budget) if device.type == "cuda" or dry_run else None
    if device.type == "cuda":
        work_elems = gpu.work_elems
    else:
        work_elems = max([1 << 24] + [n for s in stages if (n := s.work_elems(device))])
    # Shards not on disk yet (a dry run's or a streamed run's): INT4 shapes from the headers.
    header_only = any(isinstance(r, HeaderOnlyShard | StreamedShard)
                      for r in ckpt.readers.values())
    plan = build_work_plan(ckpt, stages, work_elems,
                           header_shape_values(ckpt) if header_only else None, part)
    largest = max((sum(m.shape[0] * m.shape[1] for fused in item.sets for m in fused)
                    for item in plan.items if isinstance(item, TransformItem)), default=0)
    if gpu is not None and largest > (gpu.work_elems or 0):  # a fused set beyond the item size
        gpu = gpu_plan(gpu.budget, largest)
    log.info("planned on %s: %d modules, %d work items, %d output shard(s), %d tensors",
             device, len(plan.modules), len(plan.items), len(plan.shard_entries),
             len(plan.outputs))
    with events.span("phase", name="validate_source"):
        warnings = validate_source(ckpt.config, ckpt.tensors, plan.modules, ckpt.root)
    for warning in warnings:
        say(f"kconvert: warning: {warning}")
    if recipe.requires_source and not any(recipe.requires_source in (m.codec.name, m.codec.grid)
                                          for m in plan.modules):
        raise KconvertError(f"{recipe.name} needs a source with {recipe.requires_source} modules "
                            "and this one has none", file=str(ckpt.root / "config.json"))
    return stages, plan, gpu, part


def expert_part(ckpt: Checkpoint, stages: list[Stage]) -> Part | None:
    """Under torchrun, with a stage that streams calibration layers beside the conversion
    (GPTQ, SparseGPT): the rank of each MoE layer's routed expert, the rank whose share of the
    expert-parallel calibration holds its Hessian (kconvert.calibrate.expert_ranks); None
    otherwise (every item goes with its shard)."""
    if distributed.world() == 1 or not any(s.ordered_layers for s in stages):
        return None
    from kconvert.calibrate.expert_ranks import model_ranks
    from kconvert.calibrate.load import tensors_by_layer

    text = ckpt.text_config
    n_layers, n_experts = text["num_hidden_layers"], text.get("n_routed_experts") or 0
    if n_experts < distributed.world():
        raise KconvertError(f"a layer's {n_experts} routed experts cannot be shared by "
                            f"{distributed.world()} ranks; run with at most {n_experts}")
    ranks = model_ranks(tensors_by_layer(ckpt, n_layers), n_experts,
                        range(text.get("first_k_dense_replace", 0), n_layers))

    def part(m: ModuleWork) -> int | None:
        layer = ranks.get(m.tn.layer) if m.tn.role is Role.ROUTED_EXPERT else None
        return None if layer is None else layer.owner(m.tn.expert)

    return part
