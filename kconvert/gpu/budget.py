"""One GPU memory budget for every GPU command (docs/gpu-memory.md): what it is
(--gpu-memory, or what the card has free less a safety margin), resolved once per run, and its
enforcement.

A run states what it asks of its device once (`GpuRequest`: the device --device picked, the
--gpu-memory bytes) and resolves it the first time a step needs the budget
(`GpuRequest.context`): after what the run loads while CUDA starts on a thread
(kconvert.calibrate.startup), so that the two overlap. Every later step of the run, a stage's
preparation and the conversion after it included, gets the same `GpuContext`. This module is
the only one that reads what a card has free.

`GpuContext.enforced` caps the process at the budget (`torch.cuda.set_per_process_memory_fraction`),
so `torch.cuda.max_memory_reserved()` stays within it and an estimate of the plan
(kconvert.gpu.plan) that falls short ends in a CUDA out-of-memory error, which it turns into
one `kconvert: error:` line (GpuMemoryError).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kconvert.common.options import GPU_MEMORY_MARGIN_FRACTION, GPU_MEMORY_MARGIN_MIN, parse_size
from kconvert.errors import UsageError
from kconvert.gpu.plan import GpuMemoryError, gib

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# What a plan made without a GPU assumes: an 80 GB H100 (79.2 GiB, about 0.5 GiB of it taken
# by the CUDA context), less the margin.
REFERENCE_CARD = 85_031_714_816
REFERENCE_FREE = REFERENCE_CARD - (1 << 29)


@dataclass(frozen=True)
class GpuContext:
    """Where a run computes and the GPU memory it may hold there, resolved once per run
    (`GpuRequest.context`)."""

    device: torch.device
    budget: int | None  # bytes the run may hold on its GPU; None on a CPU (nothing is capped)
    # What the run's GPU memory plans are made for: `budget` on a GPU; without one (a dry run,
    # inspect) --gpu-memory, else an 80 GB H100's default (REFERENCE_CARD).
    plan_budget: int

    @contextlib.contextmanager
    def enforced(self, what: str, lower: str = "") -> Iterator[None]:
        """Cap this process's CUDA allocations at the budget for the block (on a GPU); a CUDA
        out-of-memory error inside it becomes a GpuMemoryError naming `what`, how much it
        asked for and the options that lower it (`lower`, e.g. "--batch-size --samples").
        Logs the process's peak reserved so far (never reset: a conversion's follows its
        calibration's)."""
        import torch

        try:
            with _capped(self.device, self.budget):
                yield
        except torch.OutOfMemoryError as exc:
            raise GpuMemoryError(oom_message(str(exc), what, self.budget, lower)) from exc


@dataclass
class GpuRequest:
    """What a run asks of its device: the device (--device, picked) and --gpu-memory in bytes
    (None: what the card has free less `margin`). `context` resolves them the first time a
    step asks, and every later step of the run gets that same GpuContext."""

    device: torch.device
    memory: int | None = None

    @functools.cached_property
    def context(self) -> GpuContext:
        budget = _resolve(self.device, self.memory)
        if budget is not None:
            return GpuContext(self.device, budget, budget)
        reference = REFERENCE_FREE - margin(REFERENCE_CARD)
        return GpuContext(self.device, None, reference if self.memory is None else self.memory)


def size_option(gpu_memory: str | int | None) -> int | None:
    """--gpu-memory's value in bytes ('40GiB', or a number of bytes from the Python API; None:
    not given), read where a command takes it, so that past that point it is bytes."""
    if gpu_memory is None or isinstance(gpu_memory, int):
        return gpu_memory
    try:
        return parse_size(gpu_memory)
    except ValueError as exc:
        raise UsageError(f"--gpu-memory: {exc}") from exc


def margin(total: int) -> int:
    """What the default budget leaves free of a card's memory (options.py says why)."""
    return max(GPU_MEMORY_MARGIN_MIN, int(total * GPU_MEMORY_MARGIN_FRACTION))


def _resolve(device: torch.device, gpu_memory: int | None) -> int | None:
    """The budget in bytes on `device` (None on a CPU): `gpu_memory`, or by default the
    memory free on the card less `margin`; never more than is free."""
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
    if gpu_memory > free:
        raise GpuMemoryError(f"--gpu-memory {gib(gpu_memory)} is more than {device} has "
                             f"free ({gib(free)} of {gib(total)})")
    return gpu_memory


def _index(device: torch.device) -> int:
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def _capped(device: torch.device, budget: int | None) -> Iterator[None]:
    import torch

    if device.type != "cuda" or budget is None:
        yield
        return
    index = _index(device)  # the cap needs an index: "cuda" alone names none
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    try:
        yield
    finally:
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
