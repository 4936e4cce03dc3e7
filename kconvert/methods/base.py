"""What a method is: how a stage's claimed matrices get their new values before their codec
encodes them (round-to-nearest, GPTQ, a paired-4:8 mask, ...).

A method is declared once (its `declaration`, a kconvert.plugins.registry.Declaration: its
name, the stage kind whose `--method` names it, what it needs, its settings and its records;
kconvert.plugins.methods registers them) and is a class with its hooks: which modules it
transforms, the transform itself (decoded fp32 weights in, new weights and optionally their
block-scale codes out), its GPU footprint for the command's memory plan, and what it records
in the manifest. Stages and commands know methods only through this interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kconvert.common.options import SPARSEGPT_SAMPLES
from kconvert.formats import Codec
from kconvert.formats.linear import Batch, ModuleWork, Transformed
from kconvert.model.names import Role
from kconvert.plugins.registry import Declaration

if TYPE_CHECKING:
    from kconvert.gpu.parts import GpuWork
    from kconvert.gpu.plan import GpuPlan
    from kconvert.gpu.shapes import Shapes
    from kconvert.methods.hessians import Calibration

@dataclass(frozen=True)
class MethodInputs:
    """What a stage hands its method."""

    targets: frozenset[Role]  # the roles the stage transforms
    calibration: Calibration | None = None  # needs "data": the layer-streamed calibration
    stats: str | None = None  # needs "stats": a `kconvert calibrate` output directory
    # its own settings, checked, defaults filled in (its declaration's settings model)
    settings: Mapping[str, object] = field(default_factory=dict)


class Method:
    """Base: a method that leaves the decoded weights as they are (the codec's own rounding)."""

    declaration: ClassVar[Declaration]
    # From the declaration (set for every subclass that has one, never written by hand):
    name: ClassVar[str]
    stage: ClassVar[str]  # the stage kind whose --method names it ("quantize", "sparsify")
    needs: ClassVar[str | None] = None  # one of kconvert.plugins.registry.NEEDS
    # True when it streams calibration layers forward beside the conversion (the engine then
    # runs transform items in layer order across shards).
    ordered_layers: ClassVar[bool] = False
    # Whether it runs under torchrun (a method that streams calibration layers works on the
    # routed experts of its rank's share, docs/many-gpus.md).
    across_ranks: ClassVar[bool] = True
    # What the engine hands it at once (kconvert.formats.linear.WeightTransform.unit).
    unit: ClassVar[str] = "matrix"
    # The values it produces where only some formats encode them (GPTQ's: "NVFP4"), for
    # messages; None: any format's.
    grid: ClassVar[str | None] = None
    # --samples when not given, for a method that needs data.
    samples: ClassVar[int] = SPARSEGPT_SAMPLES

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("declaration")
        if declared is not None:
            cls.name, cls.stage, cls.needs = declared.name, declared.kinds[0], declared.needs

    def __init__(self, inputs: MethodInputs) -> None:
        self.inputs = inputs
        # its settings: those given, the declared defaults for the others
        self.settings = {**self.declaration.defaults(), **inputs.settings}

    @classmethod
    def supports(cls, codec: type[Codec]) -> bool:
        """Whether it can produce values `codec` encodes (GPTQ's grid is NVFP4's)."""
        return True

    def transforms(self, m: ModuleWork) -> bool:
        """Whether it changes module `m`'s decoded weights (the stage has claimed m)."""
        return False

    def transform(self, batches: list[Batch]) -> list[Transformed]:
        """kconvert.formats.linear.WeightTransform.transform: by default each batch on its own
        (`transform_batch`)."""
        return [self.transform_batch(b) for b in batches]

    def transform_batch(self, batch: Batch) -> Transformed:
        """New values for one batch of same-shaped matrices."""
        return Transformed(batch.weights)

    def record(self) -> dict[str, object]:
        """What the manifest records of it, in its stage's record (kconvert.stages.records)."""
        return {"method": self.name}

    def input_files(self) -> list[str]:
        """Files besides the source whose contents decide the output bytes."""
        return []

    def work_elems(self, device: torch.device) -> int | None:
        """Decoded elements per transform item it wants on a CPU (None: the engine's)."""
        return None

    def gpu_work(self, shapes: Shapes) -> GpuWork | None:
        """What it runs on the GPU beside the engine's encode, for the memory plan."""
        return None

    def use_gpu_plan(self, plan: GpuPlan) -> None:
        """Take the command's GPU memory plan before the run."""

    def close(self) -> None:
        """Release what it holds for the run (threads, open files)."""
