"""Device tensors copied to the host behind the device's next work.

A copy from a GPU into pageable host memory stops the calling thread until it is done, and
the driver stages it through one buffer of its own: every other pageable copy of the process
waits behind it, the few bytes of the next batch's `nonzero` and `item` included (measured on
an H200: a learned-compensation layer's 1.8 GB a batch, copied so on a thread of their own, cost
the training thread 0.9 s a batch). Here the copies run in order on a thread of their own, on a
CUDA stream of their own that starts after the work queued so far, through two pinned buffers
of ours (a copy into pinned memory is the copy engine's alone): one fills from the device
while the other is copied into the pageable result.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

STAGE_BYTES = 64 << 20  # each of the two pinned buffers


class HostCopies:
    """Host copies of device tensors made in the background, each batch of them stored into
    the dict its `submit` names once `wait` has seen it done. Waiting before making the next
    batch's tensors bounds the device memory the copies hold. On a CPU the tensors are the
    host's already (the caller passes copies, not storage it will change). A context manager:
    leaving it ends the thread."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kconvert-to-host")
        self.pending: list[tuple[Future[dict], dict]] = []

    def __enter__(self) -> HostCopies:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True)

    def submit(self, tensors: dict[Any, torch.Tensor], into: dict) -> None:
        """Copy `tensors` to the host once the device has made them, then into `into`."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        self.pending.append((self.pool.submit(self._copy, tensors, ready), into))

    def _copy(self, tensors: dict[Any, torch.Tensor], ready: torch.cuda.Event | None) -> dict:
        if self.stream is None:
            return {k: t.cpu() for k, t in tensors.items()}
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            stages = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True)
                      for _ in range(2)]
            return {k: self._staged(t, stages) for k, t in tensors.items()}

    def _staged(self, t: torch.Tensor, stages: list[torch.Tensor]) -> torch.Tensor:
        """`t` in pageable host memory, its bytes through the pinned `stages` in turn: the
        device fills one while the host copies the other out (each reused only after that)."""
        out = torch.empty(t.shape, dtype=t.dtype)
        src = t.contiguous().view(-1).view(torch.uint8)
        dst = out.view(-1).view(torch.uint8)
        filling = None
        for n, start in enumerate(range(0, src.numel(), STAGE_BYTES)):
            size = min(STAGE_BYTES, src.numel() - start)
            stage = stages[n % 2][:size]
            stage.copy_(src[start:start + size], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
            if filling is not None:
                self._empty(*filling)
            filling = (done, stage, dst[start:start + size])
        if filling is not None:
            self._empty(*filling)
        return out

    @staticmethod
    def _empty(done: torch.cuda.Event, stage: torch.Tensor, into: torch.Tensor) -> None:
        done.synchronize()
        into.copy_(stage)

    def wait(self) -> None:
        """Every copy submitted so far made and stored."""
        pending, self.pending = self.pending, []
        for future, into in pending:
            into.update(future.result())
