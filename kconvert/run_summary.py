"""What `--json` prints for a conversion: one object on stdout, for scripts (its schema is
committed as manifests/run-summary.schema.json; `python -m kconvert.run_summary` prints it).

A finished run gives the output, bytes written, tensors by role and the run's phase timings; a
dry run gives no output; a failed run gives `error` (the message the command line prints) and
the command exits non-zero."""

from __future__ import annotations

import json
from typing import Literal

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
    bytes_written: int = Field(description="bytes of the output's shard files")
    tensors_by_role: dict[str, int] = Field(
        description="output tensors by role (kconvert.model.names.Role)")
    summary: dict[str, float | int] = Field(description="the manifest's summary")
    timings: dict[str, float] = Field(
        description="seconds: `total`, and each phase of the run (read_shape_values, "
                    "build_work_plan, execute)")
    messages: list[str] = Field(description="warnings and notes, as printed")
    error: str | None = Field(description="why the run failed; None when it did not")

    @classmethod
    def failed(cls, command: str, src: str, dry_run: bool, error: str, seconds: float,
               messages: list[str]) -> RunSummary:
        return cls(command=command, src=src, output=None, ok=False, dry_run=dry_run,
                   bytes_written=0, tensors_by_role={}, summary={},
                   timings={"total": seconds}, messages=messages, error=error)


if __name__ == "__main__":
    print(json.dumps(RunSummary.model_json_schema(), indent=2, sort_keys=True))
