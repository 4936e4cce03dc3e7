"""What `--json` prints for a conversion: one object on stdout, for scripts (its schema is
committed as manifests/run-summary.schema.json; `python -m kconvert.driver.run_summary` prints it).

A finished run gives the output, bytes written, tensors by role and the run's phase timings; a
dry run gives no output; a failed run gives `error` (the message the command line prints), the
bytes it had written to disk (`WrittenBytes`: its finished shards and the unfinished shards'
data, which --resume keeps or checks) and `exit_code`, the command's non-zero exit status; a usage
error that click finds while parsing gives the same object (KconvertCommand.make_context)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kconvert.model.arch import arch_of
from kconvert.plugins.methods import LearnedEntry
from kconvert.records.manifest import Manifest

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


def learned_outcome(obs: Mapping[str, BaseModel]) -> dict[str, int]:
    """For the manifest's summary, where a learned method ran (its per-matrix records,
    kconvert.plugins.methods.LearnedEntry): its matrices (`learned_of_matrices`), those written
    learned (`learned_matrices`), those that kept the one-shot result because their expert had
    too few routed tokens to train and judge (`learned_too_few_tokens`), and those the guard
    refused (`learned_refused`: not better on held-out tokens, or training diverged)."""
    entries = [e for e in obs.values() if isinstance(e, LearnedEntry)]
    if not entries:
        return {}
    learned = sum(e.method != e.oneshot for e in entries)
    few = sum(e.oneshot_error is None for e in entries)
    return {"learned_matrices": learned, "learned_of_matrices": len(entries),
            "learned_too_few_tokens": few, "learned_refused": len(entries) - learned - few}


def learned_line(summary: Mapping[str, float | int]) -> str | None:
    """The closing line's part for a learned method (learned_outcome's numbers), or None where
    none ran."""
    if "learned_of_matrices" not in summary:
        return None
    few, refused = summary["learned_too_few_tokens"], summary["learned_refused"]
    kept = ([f"{few} kept the one-shot result: too few tokens to judge"] if few else []) + (
        [f"{refused} refused by the guard"] if refused else [])
    return (f"learned {summary['learned_matrices']} of {summary['learned_of_matrices']} matrices"
            + (f" ({'; '.join(kept)})" if kept else ""))


def learned_warning(manifest: Manifest, text_config: dict) -> str | None:
    """Where a learned method could judge no expert (each had too few routed tokens, so every
    matrix is the one-shot result), a warning naming the tokens an expert needs, the
    calibration tokens that takes at this model's top-k routing (evenly routed: uneven routing
    takes more) and what the run's data gave; None otherwise."""
    from kconvert.methods.learned import HELDOUT_MIN, MIN_ROUTED_TOKENS

    s = manifest.summary
    if not s.get("learned_of_matrices") or s["learned_too_few_tokens"] < s["learned_of_matrices"]:
        return None
    # the stage that read calibration data: a learned method's own (its run's data record)
    data = next(o["data"] for o in manifest.options.values()
                if isinstance(o, dict) and o.get("data"))
    arch = arch_of(text_config)
    experts, top_k = int(arch.get("experts")), int(arch.get("top_k"))
    tokens = math.ceil(MIN_ROUTED_TOKENS * experts / top_k)
    oneshot = next(e.oneshot for e in manifest.obs.values() if isinstance(e, LearnedEntry))
    return (f"warning: learned nothing: no expert had the {MIN_ROUTED_TOKENS} routed tokens the "
            f"learned method needs (every 8th held out to judge on, at least {HELDOUT_MIN}), so "
            f"all {s['learned_of_matrices']} matrices are {oneshot}'s; at top-{top_k} routing "
            f"over {experts} experts that takes at least {tokens} calibration tokens (e.g. "
            f"--samples {math.ceil(tokens / data['seq_len'])} --seq-len {data['seq_len']}; "
            f"more where routing is uneven), and this run's data gave {data['tokens']} "
            f"(--samples {data['samples']} x --seq-len {data['seq_len']})")


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
