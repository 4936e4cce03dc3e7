"""Start-up of the data-driven commands (calibrate, eval, reap --data): what runs before the
first decoder layer and after the last, timed, and the GPU started on a thread of its own (a
conversion starts it so too, while it opens SRC: kconvert.driver.convert).

Python's imports (torch, then transformers' DeepSeek-V3 modules: seconds, and transformers'
module imports pull in torch._dynamo, torch.distributed.tensor and scipy whatever is used)
hold the interpreter lock; starting CUDA (the driver, the context, a cuBLAS handle, the first
kernels) mostly waits outside it. So `start_device` starts the device on a thread while the
main thread opens the checkpoint, reads the data and imports transformers' modules, and the
main thread's first CUDA call (`device_ready`) waits only for what is left of it.

With -v each phase logs one line, "phase NAME: S s": imports (torch and kconvert's modules),
open checkpoint, data, model code (transformers' DeepSeek-V3 modules and the config), CUDA
start (what the main thread waited for the device), embedding, write; the thread logs
"CUDA started on a thread in S s". benchmarks/calibrate.py reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# The matrix multiplied on the device thread: creates the cuBLAS handle and its workspace and
# loads the first GEMM kernels; small enough to cost nothing once they exist.
WARM_MATMUL = 256


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Log the seconds the block took as "phase NAME: S s" (-v)."""
    t0 = time.perf_counter()
    yield
    log.info("phase %s: %.2f s", name, time.perf_counter() - t0)


def start_device(device: torch.device) -> threading.Thread | None:
    """On a GPU: a thread (started, not waited for) that starts CUDA on `device` (the main
    thread's current device when `device` names no index); None on a CPU. A failure there is
    only logged (-vv): the main thread's own first CUDA call meets the same failure and
    reports it."""
    if device.type != "cuda":
        return None
    if device.index is None:
        # "cuda" is the main thread's current device (a torchrun rank's own); a new thread's
        # current device is device 0
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    thread = threading.Thread(target=_start_cuda, args=(device,), name="kconvert-cuda-start")
    thread.start()
    return thread


def _start_cuda(device: torch.device) -> None:
    import torch

    t0 = time.perf_counter()
    try:
        with torch.cuda.device(device):
            a = torch.ones(WARM_MATMUL, WARM_MATMUL, dtype=torch.bfloat16, device=device)
            float((a @ a)[0, 0])  # waits for the product: its kernels are loaded and ran
    except Exception as exc:  # the main thread reports it where it meets it
        log.debug("CUDA start on a thread failed: %s", exc)
        return
    log.info("CUDA started on a thread in %.2f s", time.perf_counter() - t0)


def device_ready(device: torch.device) -> None:
    """The main thread's first use of `device`: on a GPU, the CUDA start-up still left (all
    of it where no `start_device` thread runs), logged as the phase "CUDA start"."""
    if device.type != "cuda":
        return
    import torch

    with phase("CUDA start"):
        torch.cuda.init()
        torch.empty(0, device=device)


def model_code_and_device(device: torch.device) -> None:
    """On a GPU: transformers' DeepSeek-V3 modules imported (phase "model code") while CUDA
    starts on its thread, then the device ready (phase "CUDA start"): what a command does
    before the first step that waits for the device (its GPU memory budget,
    kconvert.gpu.budget.GpuRequest.context), so that the two still overlap. The forward's own "model
    code" phase then takes no time. Nothing on a CPU (no budget waits there)."""
    if device.type != "cuda":
        return
    with phase("model code"):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401
    device_ready(device)
