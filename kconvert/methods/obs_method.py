"""What the OBS engine's methods (GPTQ, SparseGPT) share as methods: their calibration, which
streams layers forward beside the conversion and hands each MoE layer's Hessians over
(kconvert.methods.hessians), and the memory and work-item sizes that follow from it."""

from __future__ import annotations

import torch

from kconvert.formats import nvfp4
from kconvert.methods import obs
from kconvert.methods.base import Method
from kconvert.methods.hessians import Calibration


class ObsMethod(Method):
    """Base of the methods that solve OBS batches on calibration Hessians (docs/obs.md)."""

    needs = "data"
    ordered_layers = True
    grid = "NVFP4"
    shared_experts = False  # whether it solves the shared experts too (their Hessians: every token)
    against_rtn = False  # whether each result is kept only where it beats round-to-nearest

    @property
    def calibration(self) -> Calibration:
        return self.inputs.calibration  # type: ignore[return-value]

    @classmethod
    def supports(cls, codec) -> bool:
        """The engine's grid is NVFP4's: E2M1 values with FP8 block scales."""
        return codec.arithmetic in nvfp4.ARITHMETIC

    def record(self) -> dict[str, object]:
        return {"method": self.name, "percdamp": obs.PERCDAMP, "blocksize": obs.BLOCKSIZE,
                "data": self.calibration.data}

    def work_elems(self, device: torch.device) -> int | None:
        """Items on a CPU sized as the engine's batches (on a GPU the memory plan sizes them)."""
        return obs.CPU_WORK_ELEMS

    def gpu_work(self, shapes):
        return self.calibration.hessians.gpu_work(shapes, shared=self.shared_experts,
                                                  against_rtn=self.against_rtn)

    def use_gpu_plan(self, plan) -> None:
        self.calibration.hessians.gpu_plan = plan

    def close(self) -> None:
        self.calibration.hessians.close()
