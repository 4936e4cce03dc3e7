"""The layer prefetcher of every data-driven command: while the loop computes one decoder layer,
a background thread reads the next layer's bytes and, where memory allows, decodes it on the
device, so that a cold run costs max(read, compute) per layer instead of the sum.

Bounded: at most one layer ahead. The thread starts on layer L+1 when the loop takes layer L,
and on L+2 only when the loop asks for L+1 (after it has let go of L). Where the layer lands:
its raw bytes always go to host memory (pinned for a GPU); on a GPU they are copied to the
device, and the layer decoded there, only while the layer fits in the device budget
(`device_bytes`: what the command's GPU memory plan leaves, kconvert.gpu.plan; its decode
temporaries counted); what was not done ahead is done when the loop asks for the layer.
Errors in a prefetched layer (a short file, a tensor of the wrong shape or dtype, ...) are
raised when the loop asks for that layer, as the KconvertError that names its file and tensor.

With -v each layer logs its read seconds (reading and decoding, wherever done), compute seconds
and how much of the read was hidden behind the previous layer's compute (overlap); the run's
end logs the projection for the whole model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from kconvert.calibrate.load import LayerBytes, decode_bytes
from kconvert.io.readahead import read_ahead

log = logging.getLogger(__name__)

J = TypeVar("J")


T = TypeVar("T")


# Decoder layers of the full Kimi-K2 family model, for the projection at the run's end.
FULL_MODEL_LAYERS = 61


@dataclass
class LayerTiming:
    """Where one layer's seconds went."""

    label: str
    moe: bool
    read_s: float = 0.0  # reading, copying and decoding the layer, in the thread or not
    wait_s: float = 0.0  # of which the loop stood waiting for it
    compute_s: float = 0.0  # the layer's forward (set by the loop)

    @property
    def overlap_s(self) -> float:
        """Read seconds hidden behind the previous layer's compute."""
        return max(0.0, self.read_s - self.wait_s)

    @property
    def wall_s(self) -> float:
        return self.wait_s + self.compute_s

    def record(self) -> dict:
        return {"layer": self.label, "read_s": round(self.read_s, 3),
                "compute_s": round(self.compute_s, 3), "overlap_s": round(self.overlap_s, 3),
                "wall_s": round(self.wall_s, 3)}


@dataclass
class _Ahead(Generic[T]):
    """What the thread made of one job: the built layer, or only its bytes."""

    raw: LayerBytes | None
    built: T | None
    seconds: float


def project_full_model(what: str, moe_walls: list[float], dense: float, first_k_dense: int,
                       models: int = 1) -> tuple[float, float]:
    """(a steady MoE layer's seconds, the whole model's) for FULL_MODEL_LAYERS decoder layers
    of each of `models` checkpoints, the first `first_k_dense` dense at `dense` seconds, from
    the MoE layers' measured seconds: every MoE layer at the steady ones' mean (those after
    the first; with one, the first), plus the first's extra once; logged, `what` naming the
    work projected."""
    first, *rest = moe_walls
    steady = sum(rest) / len(rest) if rest else first
    # what the first MoE layer takes beyond a steady one (the kernels compiling) is paid once
    # a process
    seconds = (models * (first_k_dense * dense + (FULL_MODEL_LAYERS - first_k_dense) * steady)
               + first - steady)
    log.info("%sprojection for the whole model (%d decoder layers; %.1f s per steady MoE layer "
             "as measured, the first %.1f s): %.1f min", what, FULL_MODEL_LAYERS, steady, first,
             seconds / 60)
    return steady, seconds


@dataclass
class LayerPrefetcher(Generic[J, T]):
    """Jobs (a decoder layer of a checkpoint) loaded in order, the next one in the background.

    `read(job)` reads a layer's bytes to host memory; `build(job, raw)` decodes them on the
    device into the layer the loop computes. `ahead` False loads each layer only when the loop
    asks for it (no thread). `device_bytes` bounds the device memory the next layer may take
    while the current one runs (None: unbounded, a CPU run without a plan): on a GPU what the
    command's GPU memory plan leaves (GpuPlan.prefetch_bytes), its bytes copied and its decode
    with temporaries; on a CPU the decoded layer. A layer that does not fit waits in (pinned)
    host memory and is built when the loop asks for it."""

    read: Callable[[J], LayerBytes]
    build: Callable[[J, LayerBytes], T]
    device: torch.device
    ahead: bool = True
    device_bytes: int | None = None
    timings: list[LayerTiming] = field(default_factory=list)

    def layers(self, jobs: Iterable[J], label: Callable[[J], str]
               ) -> Iterator[tuple[J, T, LayerTiming]]:
        """(job, its layer, its timing) in order; the loop sets `compute_s` on the timing."""
        if not self.ahead:
            for job in jobs:
                t0 = time.perf_counter()
                raw = self.read(job)
                layer = self.build(job, raw)
                seconds = time.perf_counter() - t0
                timing = self._timing(label(job), raw, seconds, seconds)
                del raw
                yield job, layer, timing
            return
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with ThreadPoolExecutor(1, thread_name_prefix="kconvert-prefetch") as pool:
            t_ask = time.perf_counter()
            for job, ahead in read_ahead(pool, jobs, lambda j: self._ahead(j, stream), 1):
                got = time.perf_counter()
                # read_ahead keeps its result until it has started the next job: empty it,
                # so that only the loop holds the layer
                raw, layer, seconds = ahead.raw, ahead.built, ahead.seconds
                ahead.raw = ahead.built = None
                if layer is None:
                    layer = self.build(job, raw)
                done = time.perf_counter()
                timing = self._timing(label(job), raw, seconds + done - got, done - t_ask)
                del ahead, raw
                yield job, layer, timing
                del layer
                t_ask = time.perf_counter()

    def _ahead(self, job: J, stream: torch.cuda.Stream | None) -> _Ahead[T]:
        """The thread's part: read the layer, then on a GPU copy and decode it there while it
        fits in the budget (on a stream of its own, finished before the loop gets it)."""
        t0 = time.perf_counter()
        raw = self.read(job)
        if stream is None:
            built = self.build(job, raw) if self._fits(raw.decoded_nbytes) else None
            return _Ahead(raw, built, time.perf_counter() - t0)
        built = None
        with torch.cuda.stream(stream):
            if self._fits(raw.nbytes):
                raw = raw.to(self.device)
                if self._fits(raw.decoded_nbytes + decode_bytes(self.device), held=raw.nbytes):
                    built = self.build(job, raw)
            stream.synchronize()
        return _Ahead(raw, built, time.perf_counter() - t0)

    def _fits(self, nbytes: int, held: int = 0) -> bool:
        """Whether `nbytes` more of the next layer fit in the device share, `held` of it
        already on the device."""
        return self.device_bytes is None or held + nbytes <= self.device_bytes

    def _timing(self, label: str, raw: LayerBytes | None, read_s: float, wait_s: float
                ) -> LayerTiming:
        timing = LayerTiming(label, raw is not None and raw.held is not None, read_s, wait_s)
        self.timings.append(timing)
        return timing

    def summary(self, first_k_dense: int, models: int = 1) -> dict:
        """Per-layer records and the projection for the whole model (FULL_MODEL_LAYERS decoder
        layers of each of `models` checkpoints, the first `first_k_dense` dense) from the
        measured layer times: every MoE layer at the steady ones' mean (those after the first;
        with one, the first), plus the first's extra once; logged."""
        out: dict = {"layers": [t.record() for t in self.timings]}
        walls = {moe: [t.wall_s for t in self.timings if t.moe == moe] for moe in (False, True)}
        if walls[True]:
            dense = sum(walls[False]) / len(walls[False]) if walls[False] else 0.0
            steady, seconds = project_full_model("", walls[True], dense, first_k_dense, models)
            out["steady_moe_layer_s"] = round(steady, 3)
            out["projected_full_model_s"] = round(seconds, 1)
        return out

    def report(self, timing: LayerTiming, count: int) -> None:
        """Log one layer's line (-v), once the loop has set its compute seconds."""
        log.info("%s/%d: read %.2f s, compute %.2f s, overlap %.2f s, wall %.2f s",
                 timing.label, count, timing.read_s, timing.compute_s, timing.overlap_s,
                 timing.wall_s)
