"""One GPU memory budget for every GPU command (docs/gpu-memory.md): what it is
(--gpu-memory, or what the card has free less a safety margin), and its enforcement.

`enforced` caps the process at the budget (`torch.cuda.set_per_process_memory_fraction`), so
`torch.cuda.max_memory_reserved()` stays within it and an estimate of the plan
(kconvert.gpu_plan) that falls short ends in a CUDA out-of-memory error, which it turns into
one `kconvert: error:` line (GpuMemoryError).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kconvert.errors import UsageError
from kconvert.gpu_plan import (
    REFERENCE_CARD,
    REFERENCE_FREE,
    REPAIR_TOKENS,
    Forward,
    GpuMemoryError,
    GpuPlan,
    Shapes,
    gib,
    plan_forward,
)
from kconvert.options import GPU_MEMORY_MARGIN_FRACTION, GPU_MEMORY_MARGIN_MIN, parse_size

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def forward_plan(ckpt, shape: tuple[int, int], batch_size: int, dtype: torch.dtype,
                 device: torch.device, budget: int | None, what: str, *, capture: bool = False,
                 rerun: bool = False, repair: bool = False, models: int = 0) -> GpuPlan:
    """plan_forward for `shape` = (sequences, seq_len) of the checkpoint's tokens in `dtype`
    (`repair`: REAP router repair's stream of up to REPAIR_TOKENS tokens rides along). Under
    torchrun each rank holds the hidden states of its own batches only: the plan is the
    busiest rank's (rank 0's: batches are dealt round-robin, distributed.own_batches)."""
    from kconvert import distributed

    if budget is None:
        budget = resolve(device, None)
    batches = -(-shape[0] // batch_size)
    sequences = min(shape[0], -(-batches // distributed.world()) * batch_size)
    fw = Forward(sequences, shape[1], batch_size, dtype.itemsize, models, capture, rerun,
                 min(REPAIR_TOKENS, shape[0] * shape[1]) if repair else 0)
    return plan_forward(Shapes.from_config(ckpt.text_config), fw, budget, what)


def planning_budget(device: torch.device, gpu_memory: str | int | None) -> int:
    """The budget a plan is made for: `resolve`'s on a GPU; with no GPU (a dry run, inspect)
    --gpu-memory, or else an 80 GB H100's default (REFERENCE_CARD)."""
    if device.type == "cuda":
        return resolve(device, gpu_memory)
    if gpu_memory is None:
        return REFERENCE_FREE - margin(REFERENCE_CARD)
    return size_option(gpu_memory)


def size_option(gpu_memory: str | int) -> int:
    """--gpu-memory's value in bytes ('40GiB', or a number of bytes from the Python API)."""
    if isinstance(gpu_memory, int):
        return gpu_memory
    try:
        return parse_size(gpu_memory)
    except ValueError as exc:
        raise UsageError(f"--gpu-memory: {exc}") from exc


def margin(total: int) -> int:
    """What the default budget leaves free of a card's memory (options.py says why)."""
    return max(GPU_MEMORY_MARGIN_MIN, int(total * GPU_MEMORY_MARGIN_FRACTION))


def resolve(device: torch.device, gpu_memory: str | int | None) -> int | None:
    """The budget in bytes on `device` (None on a CPU): `gpu_memory` ('40GiB' or bytes), or
    by default the memory free on the card less `margin`; never more than is free."""
    import torch

    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if gpu_memory is None:
        budget = free - margin(total)
        if budget <= 0:
            raise GpuMemoryError(f"{device} has {gib(free)} free of "
                                 f"{gib(total)}, less than the safety margin "
                                 f"{gib(margin(total))}; give --gpu-memory SIZE")
        return budget
    budget = size_option(gpu_memory)
    if budget > free:
        raise GpuMemoryError(f"--gpu-memory {gib(budget)} is more than {device} has "
                             f"free ({gib(free)} of {gib(total)})")
    return budget


@contextlib.contextmanager
def enforced(device: torch.device, budget: int | None, what: str, lower: str = ""
             ) -> Iterator[None]:
    """Cap this process's CUDA allocations at `budget` for the block (on a GPU); a CUDA
    out-of-memory error inside it becomes a GpuMemoryError naming `what`, how much it asked
    for and the options that lower it (`lower`, e.g. "--batch-size --samples"). Logs the
    process's peak reserved so far (never reset: a conversion's follows its calibration's)."""
    import torch

    try:
        with _capped(device, budget):
            yield
    except torch.OutOfMemoryError as exc:
        raise GpuMemoryError(oom_message(str(exc), what, budget, lower)) from exc


# The budget each GPU (by index) is capped at while an `enforced` block runs.
_CAPS: dict[int, int] = {}


def _index(device: torch.device) -> int:
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


def room(device: torch.device) -> int:
    """Bytes this process may still allocate on the GPU `device`: what its budget leaves
    inside an `enforced` block (torch's cache counted as free), else what the card has free.
    For a step that decides at run time whether something stays on the GPU (REAP
    compensation's re-fitted matrices), within the same cap as the plan."""
    import torch

    allocated = torch.cuda.memory_allocated(device)
    cap = _CAPS.get(_index(device))
    if cap is not None:
        return cap - allocated
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - allocated


@contextlib.contextmanager
def _capped(device: torch.device, budget: int | None) -> Iterator[None]:
    import torch

    if device.type != "cuda" or budget is None:
        yield
        return
    index = _index(device)  # the cap needs an index: "cuda" alone names none
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    _CAPS[index] = budget
    try:
        yield
    finally:
        _CAPS.pop(index, None)
        log.info("GPU memory: peak %s reserved of a %s budget",
                 gib(torch.cuda.max_memory_reserved(device)), gib(budget))
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, index)


def oom_message(allocator: str, what: str, budget: int | None, lower: str = "") -> str:
    """One line for a CUDA out-of-memory error: the step, what it tried to allocate and what
    torch held (from the allocator's message), and the options that lower it (`lower`, e.g.
    "--batch-size --samples")."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]i?B)", allocator)
    held = re.search(r"([\d.]+ [KMGT]i?B) is allocated by PyTorch", allocator)
    need = f"it tried to allocate {asked.group(1)}" if asked else "it needed more"
    if held:
        need += f" with {held.group(1)} allocated"
    cap = f" within its {gib(budget)} budget" if budget else ""
    lowers = " or ".join(lower.split())
    return (f"{what} ran out of GPU memory: {need}{cap}; "
            + (f"lower {lowers}, " if lowers else "")
            + "give --gpu-memory what the card really has free (less if another process uses "
            "it), or run on the CPU (--device cpu)")
