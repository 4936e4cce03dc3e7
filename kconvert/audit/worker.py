"""The module worker: one thread that runs the streaming pass's torch work (decode comparisons,
batched where modules allow; p48 checks) beside the readers, so that the pass goes at the
speed of the reads. Results are taken into the report in the order the work was handed
over, so a report does not depend on thread timing.

One thread: torch work from many threads would start a CPU thread pool per thread, and on an
accelerator it runs in order anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from kconvert.audit.decode import Compared, DecodeJob, compare, judge
from kconvert.audit.report import Report
from kconvert.checks.findings import Checks

# Host bytes of the modules one batched decode takes (on an accelerator; on the CPU a batch is
# one module: stacking would only copy), and batches handed over but not yet done.
BATCH_BYTES = 64 << 20
PENDING = 2


class Outcome(NamedTuple):
    checks: Checks
    layer: int | None = None
    compared: Compared | None = None


class ModuleWorker:
    def __init__(self, report: Report, device: torch.device):
        self.report, self.device = report, device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kconvert-audit-modules")
        self.pending: deque[Future] = deque()
        self.batch: list[DecodeJob] = []

    def __enter__(self) -> ModuleWorker:
        return self

    def __exit__(self, *exc) -> None:
        for fut in self.pending:
            fut.cancel()
        self.pool.shutdown()

    def decode(self, job: DecodeJob) -> None:
        """Compare `job` (in a batch of jobs alike, once one is full)."""
        if self.batch and (job.key != self.batch[0].key or self.device.type == "cpu"
                           or sum(j.nbytes for j in self.batch) + job.nbytes > BATCH_BYTES):
            self._flush()
        self.batch.append(job)

    def run(self, fn: Callable[[], Checks]) -> None:
        """Run a check that returns its findings."""
        self._flush()
        self._hand_over(lambda: [Outcome(fn())])

    def collect(self) -> None:
        """Take in the results that are done, in order."""
        while self.pending and self.pending[0].done():
            self._take(self.pending.popleft())

    def finish(self) -> None:
        self._flush()
        while self.pending:
            self._take(self.pending.popleft())

    def _flush(self) -> None:
        if self.batch:
            jobs, device, self.batch = self.batch, self.device, []
            self._hand_over(lambda: [Outcome(judge(j, c), j.module.tn.layer, c)
                                     for j, c in zip(jobs, compare(jobs, device), strict=True)])

    def _hand_over(self, work: Callable[[], list[Outcome]]) -> None:
        self.pending.append(self.pool.submit(work))
        while len(self.pending) > PENDING:
            self._take(self.pending.popleft())

    def _take(self, fut: Future) -> None:
        for outcome in fut.result():
            self.report.merge(outcome.checks)
            if outcome.compared is not None and outcome.layer is not None:
                row, c = self.report.row(outcome.layer), outcome.compared
                row.compared += 1
                row.max_rel_mse = max(row.max_rel_mse or 0.0, c.rel_mse)
                row.max_abs_err = max(row.max_abs_err or 0.0, c.max_abs)
