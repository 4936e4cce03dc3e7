"""What a method is: how a stage's claimed matrices get their new values before their codec
encodes them (round-to-nearest, GPTQ, a paired-4:8 mask, ...).

A method is a class with a name, the stage kind whose `--method` names it, what it needs
(nothing, `kconvert calibrate` statistics, or calibration data it streams itself), its own
settings, and its hooks: which modules it transforms, the transform itself (decoded fp32 weights
in, new weights and optionally their block-scale codes out), its GPU footprint for the
command's memory plan, and what it records in the manifest. kconvert.methods.METHODS
registers them; stages and commands know methods only through this interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kconvert.formats import Codec
from kconvert.formats.linear import Batch, ModuleWork, Transformed
from kconvert.model.names import Role
from kconvert.options import SPARSEGPT_SAMPLES

if TYPE_CHECKING:
    from kconvert.gpu_parts import GpuWork
    from kconvert.gpu_plan import GpuPlan
    from kconvert.gpu_shapes import Shapes
    from kconvert.methods.hessians import Calibration

# What a method may need beyond the decoded weights: nothing, `kconvert calibrate`'s
# statistics (--stats DIR), or calibration data it runs through the model itself (--data FILE).
NEEDS = (None, "stats", "data")


@dataclass(frozen=True)
class MethodInputs:
    """What a stage hands its method."""

    targets: frozenset[Role]  # the roles the stage transforms
    calibration: Calibration | None = None  # needs "data": the layer-streamed calibration
    stats: str | None = None  # needs "stats": a `kconvert calibrate` output directory
    settings: Mapping[str, object] = field(default_factory=dict)  # its own (Method.settings)


class Method:
    """Base: a method that leaves the decoded weights as they are (the codec's own rounding)."""

    name: ClassVar[str]
    stage: ClassVar[str]  # the stage kind whose --method names it ("quantize", "sparsify")
    needs: ClassVar[str | None] = None  # one of NEEDS
    settings: ClassVar[tuple[str, ...]] = ()  # its own recipe/command-line settings
    # True when it streams calibration layers forward beside the conversion (the engine then
    # runs transform items in layer order across shards).
    ordered_layers: ClassVar[bool] = False
    # Whether it runs under torchrun (a method that streams calibration layers works on the
    # routed experts of its rank's share, docs/many-gpus.md).
    across_ranks: ClassVar[bool] = True
    # What the engine hands it at once (kconvert.formats.linear.WeightTransform.unit).
    unit: ClassVar[str] = "matrix"
    # What a run without --method takes for its stage.
    default: ClassVar[bool] = False
    # The values it produces where only some formats encode them (GPTQ's: "NVFP4"), for
    # messages; None: any format's.
    grid: ClassVar[str | None] = None
    # --samples when not given, for a method that needs data.
    samples: ClassVar[int] = SPARSEGPT_SAMPLES

    def __init__(self, inputs: MethodInputs) -> None:
        self.inputs = inputs

    @classmethod
    def supports(cls, codec: type[Codec]) -> bool:
        """Whether it can produce values `codec` encodes (GPTQ's grid is NVFP4's)."""
        return True

    @classmethod
    def check_settings(cls, settings: Mapping[str, object]) -> None:
        """Raise KconvertError on a bad value of one of its settings."""

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
