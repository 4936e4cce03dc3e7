"""The output a conversion would write, planned on headers by the converter's own code.

A hypothetical option (`--as`, `--keep`, `--p48`) picks the built-in recipe the matching
command runs (`int4-to-nvfp4`, `quantize`, `dequant`, `sparsify`, ...; `--keep` puts the
`reap` prune stage in front), its stages are built from the registry, and the engine's
`build_work_plan` plans every output tensor, exactly as a run does before it writes a byte.
The sizes are then the plan's own: tensor bytes, and shard files as `engine.work` lays them
out. No tensor data is read: INT4's logical shapes, which a run reads from the 8-byte
`weight_shape` tensors, come from `weight_packed`'s header shape ([out, in / 8] int32).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

from kconvert.driver.recipes import Recipe, build_stages, builtin_dir, load_recipe
from kconvert.engine.stage import PRUNE
from kconvert.engine.work import (
    WorkPlan,
    build_work_plan,
    header_shape_values,
    shard_file_bytes,
)
from kconvert.errors import KconvertError
from kconvert.formats import OUTPUT_CODECS
from kconvert.formats.int4 import Int4Codec
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import tensor_nbytes
from kconvert.model.names import Role, TensorName, parse_name

P48_STORAGES = ("pair-bitmask", "dense")

# Checkpoint components, by tensor role (kconvert.model.names), in the order they are shown.
COMPONENTS: dict[str, tuple[Role, ...]] = {
    "routed_experts": (Role.ROUTED_EXPERT,),
    "shared_experts": (Role.SHARED_EXPERT,),
    "dense_mlp": (Role.DENSE_MLP,),
    "attention": (Role.ATTENTION,),
    "router": (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS),
    "latent_projection": (Role.LATENT,),
    "attn_res": (Role.ATTN_RES,),
    "embeddings_lm_head": (Role.EMBEDDING, Role.LM_HEAD),
    "vision_projector": (Role.VISION, Role.PROJECTOR),
    "other": (Role.NORM, Role.OTHER, Role.MTP),
}
COMPONENT_OF = {role: name for name, roles in COMPONENTS.items() for role in roles}

# (recipe candidates, first whose required source format the checkpoint has) per option
# that is not an output format's grid (those: `int4-to-GRID` where it exists, then quantize).
RECIPES = {"p48": ("int4-p48-nvfp4", "sparsify"), "bf16": ("dequant",), "int4": ()}


def as_formats() -> tuple[str, ...]:
    """What `--as` may name: dequant's bf16, an INT4 source as it is, and the grid of every
    output format (kconvert.formats.OUTPUT_CODECS)."""
    return ("bf16", "int4", *dict.fromkeys(c.grid for c in OUTPUT_CODECS.values()))


def output_codec(grid: str, fmt: str | None):
    """The --format of `--as GRID` (the first output format of that grid where none is
    given)."""
    if fmt is None:
        return next(c for c in OUTPUT_CODECS.values() if c.grid == grid)
    codec = OUTPUT_CODECS.get(fmt)
    if codec is None or codec.grid != grid:
        ours = [f for f, c in OUTPUT_CODECS.items() if c.grid == grid]
        raise KconvertError(f"--format {fmt} does not write {grid}: choose from "
                            f"{', '.join(ours)}")
    return codec


def component_bytes(tensors: Iterable[tuple[TensorName, int]]) -> dict[str, int]:
    out = dict.fromkeys(COMPONENTS, 0)
    for tn, nbytes in tensors:
        out[COMPONENT_OF[tn.role]] += nbytes
    return out


@dataclass(frozen=True)
class Options:
    """The hypothetical conversion: `as_format` (`as_formats()`), `keep` routed experts
    per layer, `p48` storage (pair-bitmask | dense), and a quantized output's `targets` and
    `format`."""

    as_format: str | None = None
    keep: int | None = None
    p48: str | None = None
    targets: str | None = None
    format: str | None = None


@dataclass
class Prediction:
    """The planned output: its recipe (None: nothing changes) and the work plan."""

    recipe: str | None
    plan: WorkPlan

    @cached_property
    def tensors(self) -> list[tuple[TensorName, int]]:
        return [(parse_name(t.name), tensor_nbytes(t.dtype, t.shape))
                for t in self.plan.outputs.values()]

    @property
    def total_bytes(self) -> int:
        """Tensor bytes (what the output index's metadata.total_size says)."""
        return sum(n for _, n in self.tensors)

    @cached_property
    def file_bytes(self) -> int:
        """Bytes of the weight shard files, headers included (the manifest's summary.bytes)."""
        return sum(shard_file_bytes(self.plan).values())

    @property
    def components(self) -> dict[str, int]:
        return component_bytes(self.tensors)


def candidate_recipes(options: Options) -> list[Recipe | None]:
    """The built-in recipes that could write what `options` describe, in order of preference:
    the first whose required source format the checkpoint has is the one its command runs
    (None: nothing changes). `--keep` puts `reap`'s prune stage in front."""
    fmt = options.as_format
    if fmt is not None and fmt not in as_formats():
        raise KconvertError(f"--as {fmt}: choose from {', '.join(as_formats())}")
    if options.p48 is not None and options.p48 not in P48_STORAGES:
        raise KconvertError(f"--p48 {options.p48}: choose from {', '.join(P48_STORAGES)}")
    if options.p48 is not None and fmt not in (None, "nvfp4"):
        raise KconvertError(f"--p48 writes NVFP4 routed experts, not {fmt}: drop --as {fmt}")
    if options.p48 is not None or fmt in RECIPES:
        names = RECIPES["p48" if options.p48 is not None else fmt]
    elif fmt is not None:
        output_codec(fmt, options.format)
        names = tuple(n for n in (f"int4-to-{fmt}", "quantize")
                      if (builtin_dir() / f"{n}.toml").is_file())
    else:
        names = ()
    if options.p48 is None and fmt in (None, *RECIPES) and (options.targets is not None
                                                           or options.format is not None):
        raise KconvertError("--targets and --format describe a quantized output: add --as "
                            + " or --as ".join(g for g in as_formats() if g not in RECIPES))
    bases: list[Recipe | None] = [load_recipe(n) for n in names] or [None]
    if options.keep is None:
        return bases
    reap = load_recipe("reap")
    return [reap if base is None else
            replace(base, name=f"reap+{base.name}", stages=reap.stages + base.stages)
            for base in bases]


def predict(ckpt: Checkpoint, options: Options) -> Prediction:
    """Plan the output `options` describe, on the headers of `ckpt`."""
    shape_values = header_shape_values(ckpt)
    inputs = {PRUNE: _prune_first(ckpt, options.keep)} if options.keep else {}
    fmt = options.format
    if options.as_format not in (None, *RECIPES):
        fmt = output_codec(options.as_format, fmt).cli_name
    settings = {"storage": options.p48, "targets": options.targets, "format": fmt}
    for recipe in candidate_recipes(options):
        stages = build_stages(recipe, settings, inputs) if recipe is not None else []
        plan = build_work_plan(ckpt, stages, 1 << 24, shape_values)
        formats = {m.codec.name for m in plan.modules}
        if recipe is None or recipe.requires_source in (None, *formats):
            break
    if options.as_format == "int4" and formats - {"dense"} != {Int4Codec.name}:
        have = ", ".join(sorted(formats - {"dense"})) or "no quantized modules"
        raise KconvertError("kconvert writes no INT4: --as int4 only describes an INT4 source "
                            f"as it is, and this one has {have}")
    return Prediction(recipe.name if recipe is not None else None, plan)


def _prune_first(ckpt: Checkpoint, keep: int):
    """A prune stage keeping experts 0..keep-1 of every MoE layer: any plan keeping `keep`
    writes the same bytes (kept experts keep theirs), and `reap` checks it the same way."""
    from kconvert.pruning.plan import PruneLayer, PrunePlan
    from kconvert.pruning.reap import keep_count, moe_layers
    from kconvert.stages.prune import prune_stage

    keep = keep_count(ckpt, keep, None)
    layers = {str(layer): PruneLayer(keep=list(range(keep))) for layer in moe_layers(ckpt)}
    if not layers:
        raise KconvertError("--keep: this checkpoint has no routed experts to prune")
    return prune_stage(PrunePlan(criterion="inspect", layers=layers), ckpt)
