"""What `--json` prints for a conversion: one object on stdout, for scripts (its schema is
committed as manifests/run-summary.schema.json; `python -m kconvert.driver.run_summary` prints it).

A finished run gives the output, bytes written, tensors by role and the run's phase timings; a
dry run gives no output; a failed run gives `error` (the message the command line prints), the
bytes it had written to disk (`WrittenBytes`: its finished shards and the unfinished shards'
data, which --resume keeps or checks) and `exit_code`, the command's non-zero exit status; a usage
error that click finds while parsing gives the same object (KconvertCommand.make_context)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_ID = "kconvert-run-summary/1"


class RunSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_id: Literal["kconvert-run-summary/1"] = SCHEMA_ID
    command: str = Field(description="the recipe run (the command's name, or RECIPE of `run`)")
    src: str
    output: str | None = Field(description="DST when the run wrote it; None on a dry run or "
                                           "a failure")
    ok: bool
    dry_run: bool
    bytes_written: int = Field(description="bytes of the output's shard files; on a failure, "
                                           "the bytes the run had written to disk (finished "
                                           "shards, and the data of unfinished ones)")
    tensors_by_role: dict[str, int] = Field(
        description="output tensors by role (kconvert.model.names.Role)")
    summary: dict[str, float | int] = Field(description="the manifest's summary")
    timings: dict[str, float] = Field(
        description="seconds: `total`, and each phase of the run (prepare: what the stages "
                    "make from the source first, REAP's calibration with --data included; "
                    "read_shape_values, build_work_plan, execute)")
    messages: list[str] = Field(description="warnings and notes, as printed")
    error: str | None = Field(description="why the run failed; None when it did not")
    exit_code: int = Field(0, description="the command's exit status: 0 done, 2 a usage error "
                                          "(found before the run began: `command` only), 1 "
                                          "bad input, 3 a bug in kconvert")

    @classmethod
    def failed(cls, command: str, src: str, dry_run: bool, error: str, seconds: float,
               messages: list[str], bytes_written: int, exit_code: int) -> RunSummary:
        return cls(command=command, src=src, output=None, ok=False, dry_run=dry_run,
                   bytes_written=bytes_written, tensors_by_role={}, summary={},
                   timings={"total": seconds}, messages=messages, error=error,
                   exit_code=exit_code)


class WrittenBytes:
    """A listener (kconvert.common.events, with timings) counting what a run writes to disk: each
    finished shard's file size, and the data written into shards not finished."""

    def __init__(self) -> None:
        self.finished: dict[str, int] = {}
        self.partial: dict[str, int] = {}

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "fsync":
            self.finished[info["shard"]] = info["nbytes"]
        elif event == "pwrite":
            self.partial[info["shard"]] = self.partial.get(info["shard"], 0) + info["nbytes"]

    @property
    def total(self) -> int:
        return sum(self.finished.values()) + sum(
            n for shard, n in self.partial.items() if shard not in self.finished)


if __name__ == "__main__":
    print(json.dumps(RunSummary.model_json_schema(), indent=2, sort_keys=True))
