"""What the data-driven methods (GPTQ, SparseGPT, the learned ones) share: their calibration,
which streams layers forward beside the conversion and hands each MoE layer's inputs over
(kconvert.methods.hessians), whose layers' inputs come from the source (`--hessian source`)
or from the already-compressed model (`sequential`: each routed and shared expert's written
values go back into the layer, which is run again before the next), and the memory and
work-item sizes that follow from it."""

from __future__ import annotations

import torch

from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.formats import nvfp4
from kconvert.formats.linear import Transformed
from kconvert.methods import obs
from kconvert.methods.base import Method
from kconvert.methods.hessians import Calibration
from kconvert.plugins.methods import DataMethodSettings

# The inverse's and the column loop's matrix products run on TF32 tensor cores on a GPU (on a
# CPU, in fp32): on full-size Kimi experts this halves GPTQ's inverse and takes a third off its
# loop, while the held-out output error stays within 0.04% of fp32's and on either side of it
# (docs/obs.md, "TF32").
PRECISION = "tf32"


class ObsMethod(Method):
    """Base of the methods that solve OBS batches on calibration Hessians (docs/obs.md)."""

    ordered_layers = True
    grid = "NVFP4"
    shared_experts = False  # whether it solves the shared experts too (their Hessians: every token)
    against_rtn = False  # whether each result is kept only where it beats round-to-nearest
    # Under torchrun a subclass must say it works on its rank's share of the routed experts
    # (their Hessians from the expert-parallel calibration, kconvert.calibrate.expert_ranks).
    across_ranks = False

    def __init__(self, inputs) -> None:
        if distributed.world() > 1 and not self.across_ranks:
            raise KconvertError(f"--method {self.name} does not run across ranks; run it "
                                "without torchrun")
        super().__init__(inputs)
        self.hessian = str(self.settings["hessian"])
        self.calibration.hessians.sequential = self.hessian == "sequential"

    @property
    def calibration(self) -> Calibration:
        return self.inputs.calibration  # type: ignore[return-value]

    def transform(self, batches):
        """Each batch on its own; with sequential inputs its written values go back into the
        calibration's layer as soon as it is done (a layer's down_proj batches come first in
        its items, so their Hessians are the layer's as it came)."""
        out = []
        for batch in batches:
            made = self.transform_batch(batch)
            if self.calibration.hessians.sequential:
                self.write_back(batch, made)
            out.append(made)
        return out

    def write_back(self, batch, made: Transformed) -> None:
        """The values the encoder writes for `batch` (`made` on NVFP4's grid) into the
        calibration's layer, for its run again (routed and shared experts)."""
        values = made.weights
        if made.codes is not None:
            b, m, k = values.shape
            gs = nvfp4.tensor_scale(batch.amax, batch.codec.arithmetic).to(values.device)
            blocks = values.reshape(b * m, made.codes.shape[-1], -1)
            values = nvfp4.fake_quantize(blocks, made.codes.reshape(b * m, -1),
                                         gs.repeat_interleave(m).reshape(-1, 1),
                                         batch.codec.arithmetic).reshape(b, m, k)
        for i, mod in enumerate(batch.modules):
            if mod.tn.role in obs.EXPERT_ROLES:
                self.calibration.hessians.replace(mod.tn.layer, mod.tn.expert, mod.tn.proj,
                                                  values[i])

    @classmethod
    def supports(cls, codec) -> bool:
        """The engine's grid is NVFP4's: E2M1 values with FP8 block scales."""
        return codec.arithmetic in nvfp4.ARITHMETIC

    def record(self) -> dict[str, object]:
        on_gpu = self.calibration.hessians.device.type == "cuda"
        return {"method": self.name, "percdamp": obs.PERCDAMP, "blocksize": obs.BLOCKSIZE,
                "data": self.calibration.data, **({"obs_precision": PRECISION} if on_gpu else {})}

    def sequential_record(self) -> dict[str, object]:
        """`hessian` in the record where it is not the default (records made before the
        option existed are unchanged)."""
        default = DataMethodSettings.model_fields["hessian"].default
        return {"hessian": self.hessian} if self.hessian != default else {}

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
