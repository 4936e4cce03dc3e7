"""What every check family of `kconvert audit` reads: the audited checkpoint and the source,
each opened by kconvert.io.checkpoint and grouped into modules by the converter's own
grouping (kconvert.formats.linear), the manifest and the typed record of the run that made it,
the pruning plan, and what earlier families established (the MoE layers, the expert mapping,
the stored fused-set scales, which source tensors have a counterpart)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from kconvert.audit.report import Report
from kconvert.checks.findings import Checks
from kconvert.errors import KconvertError
from kconvert.formats.base import Codec
from kconvert.formats.linear import ModuleWork, as_linear, module_params
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import ShardReader, TensorInfo
from kconvert.model.names import Role, parse_name
from kconvert.pruning.plan import PrunePlan
from kconvert.records.manifest import Manifest
from kconvert.stages.records import RunRecord

ROUTER_ROLES = (Role.ROUTER_WEIGHT, Role.ROUTER_BIAS)


@dataclass
class Side:
    """One opened checkpoint: its tensors, its modules (every parameter set a format
    matches, whatever its role; the router stays plain) and a reader per shard file."""

    ckpt: Checkpoint
    tensors: dict[str, TensorInfo]
    modules: dict[str, ModuleWork]  # by module name
    readers: dict[Path, ShardReader]  # by the file a TensorInfo names

    @property
    def root(self) -> Path:
        return self.ckpt.root

    def read(self, info: TensorInfo) -> torch.Tensor:
        return self.readers[info.file].read(info)

    def read_into(self, info: TensorInfo, out: torch.Tensor, offset: int = 0) -> None:
        self.readers[info.file].read_into(info, out, offset)

    def will_need(self, info: TensorInfo, offset: int = 0, length: int | None = None) -> None:
        self.readers[info.file].will_need(info, offset, length)

    def routers(self) -> dict[int, tuple[TensorInfo | None, TensorInfo | None]]:
        """MoE layer -> (router weight, e_score_correction_bias)."""
        out: dict[int, list] = defaultdict(lambda: [None, None])
        for name, info in self.tensors.items():
            tn = parse_name(name)
            if tn.role is Role.ROUTER_WEIGHT and tn.param == "weight":
                out[tn.layer][0] = info
            elif tn.role is Role.ROUTER_BIAS:
                out[tn.layer][1] = info
        return {k: (v[0], v[1]) for k, v in out.items()}

    def close(self) -> None:
        self.ckpt.close()


def open_side(ckpt: Checkpoint, checks: Checks, group: str) -> Side:
    """The checkpoint's tensors and modules; a parameter set that looks quantized but matches
    no format, or whose logical shape cannot be read, is a finding of `group`."""
    tensors = ckpt.tensors
    shape_values = ckpt.shape_values()
    modules = {}
    grouped = module_params(tensors, lambda tn: tn.param != "bias" and tn.role not in
                            ROUTER_ROLES)
    for name, params in grouped.items():
        try:
            m = as_linear(name, params, shape_values)
        except KconvertError as exc:
            checks.add(group, "shape", str(exc), tensor=exc.tensor)
            continue
        if m is not None:
            modules[name] = m
        elif set(params) != {"weight"}:
            first = params[sorted(params)[0]]
            checks.add(group, "format", f"parameters {sorted(params)} match no known format "
                       "(missing or extra scale tensors)", tensor=first.name)
    readers = {r.path: r for r in ckpt.readers.values()}
    return Side(ckpt, tensors, modules, readers)


class StoredScales(NamedTuple):
    """A module's NVFP4 per-tensor scales as stored (the input scale may be absent)."""

    codec: type[Codec]
    global_scale: torch.Tensor
    input_scale: torch.Tensor | None


@dataclass
class AuditContext:
    report: Report
    ckpt: Side
    source: Side | None
    device: torch.device
    max_rel_mse: float | None  # --max-rel-mse: the decode bound for every re-encoded module
    chunk: int  # bytes per streamed piece of a plain tensor (a multiple of 8)
    progress: bool
    plan: PrunePlan | None = None
    manifest: Manifest | None = None
    record: RunRecord | None = None  # the manifest's options, when they are a RunRecord
    moe_layers: list[int] = field(default_factory=list)
    # MoE layer -> per expert id of CKPT, the source expert id it was made from (None: none).
    mapping: dict[int, list[int | None]] = field(default_factory=dict)
    used_source: set[str] = field(default_factory=set)  # source tensors with a counterpart
    has_counterpart: set[str] = field(default_factory=set)  # CKPT tensors with one
    fused: dict[str, dict[str, StoredScales]] = field(default_factory=lambda: defaultdict(dict))

    @property
    def generated(self) -> dict[str, str]:
        """Files the run that made CKPT generated (name -> xxh3), per its manifest."""
        return self.manifest.generated_files if self.manifest is not None else {}

    @property
    def dropped(self) -> set[str]:
        """Source tensors and files the manifest records as left out on purpose."""
        return set(self.manifest.dropped) if self.manifest is not None else set()

    @property
    def p48_roles(self) -> set[str] | None:
        """Roles the run made paired-4:8 sparse, per its record; None when it made none."""
        sparsify = self.record.sparsify if self.record is not None else None
        return set(sparsify.targets) if sparsify is not None else None

    @property
    def refit(self) -> dict[str, str]:
        """CKPT tensors the plan's compensation re-fitted (name -> xxh3-128 of the bytes)."""
        if self.plan is None:
            return {}
        return {name: digest for entry in self.plan.layers.values()
                if entry.compensation is not None
                for name, digest in entry.compensation.matrices_xxh3.items()}

    def source_name(self, name: str) -> str | None:
        """The source tensor CKPT's tensor `name` was made from, under the expert mapping
        (None: a routed expert the mapping does not trace to a source expert)."""
        tn = parse_name(name)
        if tn.role is Role.ROUTED_EXPERT and tn.layer in self.mapping:
            ids = self.mapping[tn.layer]
            s = ids[tn.expert] if tn.expert < len(ids) else None
            return None if s is None else tn.with_expert(s).name
        return name

    def source_module(self, m: ModuleWork) -> ModuleWork | None:
        name = self.source_name(m.primary.name)
        if name is None or self.source is None:
            return None
        return self.source.modules.get(parse_name(name).module)
