"""A GPU conversion's kernels loaded on a thread while its first items are read.

The first work item that encodes on a GPU pays for every kernel's first use: Triton compiles
the block-scale kernels (or loads them from its cache) and CUDA loads the rest. On the H200
machine that item took 1.98-3.64 s where the others take 0.02 s, while the readers, their
read-ahead full, and the writer waited (benchmarks/results/README.md, "Session 20"). So the
engine computes a zero-filled copy of the first item that encodes, all its groups and modules
alike (a kernel compiled for other sizes could differ in its specialisations), on a thread
from the start of the run, while the copy items before it are read and written; the compute
thread waits for that thread before its own first such item, so the two never hold device
memory at once and the GPU plan's one item in flight stands.

Only an item without a method is warmed: a method's first item computes far longer than its
kernels take to load, and would run on data it cannot have."""

from __future__ import annotations

import logging
import threading
import time

import torch

from kconvert.engine.compute import compute_item, zero_buffers
from kconvert.engine.items import Item, TransformItem, WorkPlan

log = logging.getLogger(__name__)


def first_to_warm(items: list[Item]) -> TransformItem | None:
    """The first item that encodes, where none of its modules runs a method; else None."""
    first = next((it for it in items if isinstance(it, TransformItem)), None)
    if first is None or any(m.transform is not None for g in first.groups for m in g.modules):
        return None
    return first


def warm_up(plan: WorkPlan, item: TransformItem, device: torch.device, chunk_elems: int) -> None:
    """Compute `item` on zero-filled buffers on `device`, its result thrown away."""
    compute_item(plan, item, zero_buffers(item, pin=device.type == "cuda"), device, -1,
                 chunk_elems)


def start_warm_up(plan: WorkPlan, items: list[Item], device: torch.device, chunk_elems: int
                  ) -> threading.Thread | None:
    """On a GPU: a started thread warming the kernels of `items`' first item that encodes
    (`first_to_warm`); None on a CPU (its kernels are loaded before the run:
    formats.warm_cpu_kernels) or where there is nothing to warm. A failure there is only
    logged (-vv): the compute thread meets the same failure in the real item and reports
    it."""
    item = first_to_warm(items) if device.type == "cuda" else None
    if item is None:
        return None
    if device.index is None:
        # "cuda" is the compute thread's current device (a torchrun rank's own); a new
        # thread's current device is device 0
        device = torch.device("cuda", torch.cuda.current_device())
    thread = threading.Thread(target=_run, args=(plan, item, device, chunk_elems),
                              name="kconvert-warm-up", daemon=True)
    thread.start()
    return thread


def _run(plan: WorkPlan, item: TransformItem, device: torch.device, chunk_elems: int) -> None:
    t0 = time.perf_counter()
    try:
        with torch.cuda.device(device):
            warm_up(plan, item, device, chunk_elems)
    except Exception as exc:  # the compute thread reports it where it meets it
        log.debug("warming the GPU kernels on a thread failed: %s", exc)
        return
    log.info("GPU kernels warmed on a thread in %.2f s", time.perf_counter() - t0)
