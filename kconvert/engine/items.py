"""The work plan as the engine runs it: every output tensor, the work items that make them
(pass-through byte ranges, and decode groups of modules to transform), and the plan that holds
them; kconvert.engine.work builds it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from kconvert.engine.stage import Stage
from kconvert.formats.linear import ModuleWork
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import TensorInfo


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    sources: tuple[str, ...]
    stage: str  # "copy" or the stages that produced it, e.g. "dequant+quantize"


@dataclass(frozen=True)
class Chunk:
    """A byte range of a pass-through tensor; with `rows`, the whole tensor, rows selected;
    with `values`, the whole tensor, replaced."""

    info: TensorInfo
    out_name: str
    offset: int
    length: int
    rows: tuple[int, ...] | None = None
    # The output tensor a stage computed (a repaired router's rows, a re-fitted matrix's
    # parameter), written instead of the source's bytes.
    values: torch.Tensor | None = None


@dataclass
class CopyItem:
    kind: ClassVar[str] = "copy"

    chunks: list[Chunk]

    @cached_property
    def nbytes(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass
class DecodeGroup:
    """Same-codec, same-shape, same-treatment modules decoded as one batch [B, out, in]."""

    modules: list[ModuleWork]

    @property
    def codec(self):
        return self.modules[0].codec

    @property
    def params(self) -> tuple[str, ...]:
        """Source parameters read: the codec's, plus those a re-layout carries over."""
        return self.codec.params + self.modules[0].carried


@dataclass
class TransformItem:
    kind: ClassVar[str] = "transform"

    sets: list[list[ModuleWork]]
    groups: list[DecodeGroup] = field(default_factory=list)

    def __post_init__(self) -> None:
        by_key: dict[tuple, list[ModuleWork]] = defaultdict(list)
        for fused in self.sets:
            for m in fused:
                key = (m.codec.name, m.shape, m.out_codec.__name__, m.group_size, m.repack,
                       m.carried, id(m.transform))
                by_key[key].append(m)
        self.groups = [DecodeGroup(ms) for ms in by_key.values()]

    @cached_property
    def nbytes(self) -> int:
        return sum(i.nbytes for s in self.sets for m in s for i in m.params.values())


Item = CopyItem | TransformItem


@dataclass
class WorkPlan:
    ckpt: Checkpoint
    stages: list[Stage]
    modules: list[ModuleWork]
    outputs: dict[str, OutTensor]
    items: list[Item]
    dropped: dict[str, str]  # source tensor -> why it has no output

    @cached_property
    def shard_entries(self) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
        """Output shard -> its tensors (name, dtype, shape); the outputs never change after
        planning, so it is built once."""
        entries: dict[str, list] = defaultdict(list)
        for t in self.outputs.values():
            entries[t.shard].append((t.name, t.dtype, t.shape))
        return dict(sorted(entries.items()))

    @property
    def scale_rule(self) -> str | None:
        """The block-scale rule a stage chose for the run (None: the encoders' default)."""
        return next((s.scale_rule for s in self.stages if s.scale_rule is not None), None)

    def item_shards(self, item: Item) -> set[str]:
        if isinstance(item, CopyItem):
            return {self.outputs[c.out_name].shard for c in item.chunks}
        return {m.primary.file.name for s in item.sets for m in s}

    def item_outputs(self, item: Item) -> set[str]:
        """The output tensors an item writes (a big pass-through tensor's pieces may lie in
        several items, all of its shard)."""
        if isinstance(item, CopyItem):
            return {c.out_name for c in item.chunks}
        return {f"{m.out_module}.{param}" for s in item.sets for m in s
                for param, _, _ in m.out_specs()}

    def item_sources(self, item: Item) -> set[str]:
        """The source shards an item reads (a module's parameters may lie in two)."""
        if isinstance(item, CopyItem):
            return {c.info.file.name for c in item.chunks}
        return {i.file.name for s in item.sets for m in s for i in m.params.values()}
