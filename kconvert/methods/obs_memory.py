"""What the OBS engine (kconvert.methods.obs) asks of the memory it runs in: the device bytes
of one matrix of a batch, how many matrices a batch takes within a budget, and what the engine
runs on the GPU beside a conversion, for the command's memory plan (kconvert.gpu.plan)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import TypeVar

import torch

from kconvert.calibrate.forward import gram_bytes
from kconvert.gpu.parts import OBS_BATCH, Forward, GpuWork, Obs
from kconvert.gpu.shapes import Shapes
from kconvert.model.names import Role

T = TypeVar("T")


def experts_per_batch(rows: int, k: int, budget: int | None, tokens: int = 0,
                      against_rtn: bool = False) -> int:
    """How many Hessian-sharing matrices [rows, k] one OBS batch takes: OBS_BATCH, or fewer
    where `budget` bytes (`batch_bytes`) hold fewer; OBS_BATCH when the budget is None (a
    CPU)."""
    return per_batch(budget, batch_bytes(rows, k, tokens, against_rtn))


def per_batch(budget: int | None, matrix_bytes: int) -> int:
    """Matrices of `matrix_bytes` one batch (OBS or training) takes: OBS_BATCH, or fewer where
    `budget` bytes hold fewer (at least one); OBS_BATCH when the budget is None (a CPU)."""
    if budget is None:
        return OBS_BATCH
    return max(1, min(OBS_BATCH, budget // matrix_bytes))


def pads_batches(device: torch.device) -> bool:
    """Whether batches on `device` are solved or trained at one count, the last one padded
    (`padded`): on a GPU a batched product's rounding depends on its batch count (cuBLAS picks
    its kernel by it), so an expert's bits would depend on how many came with it; on a CPU they
    do not, and padding would only cost time."""
    return device.type == "cuda"


def padded(members: list[T], size: int, device: torch.device) -> list[T]:
    """A batch's `members` as `device` solves or trains them: where it `pads_batches`, the last
    one repeated up to `size` (the repeats' results are dropped), else as they are."""
    if not pads_batches(device):
        return members
    return members + members[-1:] * (size - len(members))


def batch_bytes(rows: int, k: int, tokens: int = 0, against_rtn: bool = False) -> int:
    """Device bytes one matrix [rows, k] of an OBS batch needs: the Hessian, its factor and
    their temporaries, the weights, their copy and the result, the routed inputs, and with
    `against_rtn` the held-out Hessian, RTN's values, the difference and its product with H."""
    return 4 * ((5 if against_rtn else 4) * k * k + (7 if against_rtn else 4) * rows * k
                + tokens * k)


def gpu_work(shapes: Shapes, forward: Forward, *, shared: bool, against_rtn: bool,
             linears: Collection[Role] = (), held_out: bool = False) -> GpuWork:
    """What the OBS engine runs on the GPU beside a conversion, for the command's memory plan
    (kconvert.gpu.plan): the calibration `forward` that captures the Hessians' inputs, and the
    OBS batches. An expert's gate and up share a Hessian and solve as one [2 * moe_inter,
    hidden] matrix, the largest shape of an expert batch; with `shared` the shared experts are
    solved too (their Hessians from every token), with `against_rtn` each result is compared
    with RTN's (`batch_bytes`). `linears`: the attention and dense MLP roles solved too, their
    Hessians the input Grams the forward collects (two per fused set with `held_out`), held
    while their layer is solved; a batch holds at least one of the largest such matrix."""
    n_shared = shapes.shared if shared else 0
    rows = 2 * shapes.moe_inter * max(1, n_shared)
    widths, matrices = [], []
    if Role.ATTENTION in linears:
        widths += shapes.attention_inputs()
        matrices += shapes.attention_matrices()
    # the dense MLP's Grams sit beside attention's in the first layers (the largest layer)
    if Role.DENSE_MLP in linears and shapes.dense_layers:
        widths += shapes.dense_inputs()
        matrices += shapes.dense_matrices()
    least = max((batch_bytes(r, k, against_rtn=against_rtn) for r, k in matrices), default=0)
    # OBS_BATCH matrices a batch however few experts there are (a small model, or an
    # expert-parallel rank's block): on a GPU every batch is padded to the plan's count
    # (`padded`), so a rank holding fewer than OBS_BATCH experts solves them at the count one
    # process does and writes its bytes
    return GpuWork(replace(forward, gram_bytes=gram_bytes(widths, held_out)),
                   Obs(batch_bytes(rows, shapes.hidden, against_rtn=against_rtn), OBS_BATCH,
                       shapes.hidden, every_token=n_shared > 0, least_bytes=least))
