"""The layer-streamed forward's GPU memory (docs/gpu-memory.md): the forward as the planner
(kconvert.gpu.plan) sees it, with this package's own term, a layer's decode; and the start
shared by the commands that run it alone (calibrate, eval, reap --data).

Those commands start CUDA on a thread before they load their data (startup.start_device), then
enter `planned_forward`: transformers' model code imported while CUDA finishes starting, the
run's GpuContext (resolved once per run, kconvert.gpu.budget), the forward's plan on it and the
budget enforced around the forward. The OBS engine's calibration runs beside a conversion and
is planned with it (kconvert.gpu.plan.plan_gpu, kconvert.driver.convert).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kconvert.calibrate.load import decode_bytes
from kconvert.calibrate.startup import model_code_and_device
from kconvert.common import distributed
from kconvert.gpu.budget import GpuContext, GpuRequest
from kconvert.gpu.parts import Forward
from kconvert.gpu.plan import GpuPlan, plan_forward
from kconvert.gpu.shapes import Shapes
from kconvert.io.checkpoint import Checkpoint


def forward(shapes: Shapes, sequences: int, seq_len: int, batch_size: int,
            dtype_bytes: int = 2, **terms) -> Forward:
    """The forward of `sequences` sequences of `seq_len` tokens, `batch_size` a step, as the
    planner sees it: a layer's decode beside it (kconvert.calibrate.load), and `terms`, the
    other fields of gpu.parts.Forward (what the forward keeps, the other owners' bytes).

    Under torchrun, this rank's part (docs/many-gpus.md): the hidden states of its batches
    (dealt round-robin, distributed.own_batches: rank 0's share is the largest), and in a
    calibration (not eval, `models`) its block of each MoE layer's routed experts and the
    exchange; REAP's repair stream, and every expert gathered for it, on rank 0 alone."""
    ranks = distributed.world()
    batches = -(-sequences // batch_size)
    mine = min(sequences, -(-batches // ranks) * batch_size)
    if ranks > 1 and not distributed.is_main():
        terms.pop("repair_bytes", None)
    gathered = ranks > 1 and bool(terms.get("repair_bytes"))
    return Forward(mine, seq_len, batch_size, dtype_bytes,
                   decode_bytes=decode_bytes(torch.device("cuda"), shapes.layer_elems()),
                   ranks=1 if terms.get("models") else ranks, job_sequences=sequences,
                   gathered=gathered, **terms)


def forward_plan(ckpt: Checkpoint, gpu: GpuContext, shape: tuple[int, int], batch_size: int,
                 dtype: torch.dtype, what: str, **terms) -> GpuPlan | None:
    """The plan of the forward over `shape` = (sequences, seq_len) of the checkpoint's tokens
    in `dtype` on the run's GPU (`terms`: as `forward`'s, which says what a rank holds under
    torchrun); None on a CPU."""
    if gpu.budget is None:
        return None
    shapes = Shapes.from_config(ckpt.text_config)
    return plan_forward(shapes, forward(shapes, shape[0], shape[1], batch_size,
                                        dtype.itemsize, **terms), gpu.budget, what)


@contextlib.contextmanager
def planned_forward(request: GpuRequest, ckpt: Checkpoint, shape: tuple[int, int],
                    batch_size: int, dtype: torch.dtype, what: str, **terms
                    ) -> Iterator[GpuPlan | None]:
    """After a command has loaded its data (CUDA started on a thread before it): the model
    code imported while CUDA finishes starting, the run's GpuContext, the plan of the forward
    (`forward_plan`; None on a CPU), and the budget enforced for the block, where an
    out-of-memory error names `what` and the options that lower it."""
    model_code_and_device(request.device)  # what the budget waits for, after the overlap
    gpu = request.context
    plan = forward_plan(ckpt, gpu, shape, batch_size, dtype, what, **terms)
    with gpu.enforced(what, "--batch-size --samples"):
        yield plan
