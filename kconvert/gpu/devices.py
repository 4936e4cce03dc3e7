"""Where compute runs: `--device auto | cpu | cuda | cuda:N` as a torch device; how long
phases take there (`Stopwatch`); and torch's deterministic kernels for a block
(`deterministic`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kconvert.common import distributed
from kconvert.errors import KconvertError


def pick_device(spec: str) -> torch.device:
    """The torch device for `--device` (auto | cpu | cuda | cuda:N), or a clear error."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise KconvertError(f"--device {spec!r} is not a device; use auto, cpu, cuda or "
                            "cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise KconvertError(f"--device {spec!r}: kconvert runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KconvertError(f"--device {spec}: no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise KconvertError(f"--device {spec}: this machine has "
                                f"{torch.cuda.device_count()} CUDA device(s)")
        if device.index is None and distributed.launched():
            # A torchrun rank's own GPU, by index: a bare "cuda" means the current device of
            # the thread that uses it, and the reader, prefetch and calibration threads start
            # on GPU 0, not on the card distributed.init chose for this rank.
            distributed.init()
            device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class Stopwatch:
    """Seconds per phase. Each boundary waits for the work queued on the current stream, so a
    phase is charged for its own kernels (CUDA runs them after the host has moved on), not
    for other streams' (a layer read ahead, copies to the host)."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self._now() - start


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic kernels (warn-only where none exists) for the block: a backward
    that accumulates through indexing (REAP's router fit) is summed in varying order by
    multi-threaded CPU kernels otherwise."""
    was, warn = (torch.are_deterministic_algorithms_enabled(),
                 torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
