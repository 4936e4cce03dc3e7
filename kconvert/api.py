"""The Python API: one function per command, the command line's options as keyword arguments
(`--block-scale amax` is `block_scale="amax"`), the same checks and the same messages.

    import kconvert

    report = kconvert.inspect("moonshotai/Kimi-K2-Thinking", as_format="nvfp4", gpus=8,
                              gpu_mem=179)
    result = kconvert.int4_to_nvfp4("Kimi-K2-Thinking", "Kimi-K2-Thinking-NVFP4",
                                    block_scale="amax", device="cuda")
    print(result.summary_line(), result.summary["bytes"])
    assert kconvert.audit(result.output, source="Kimi-K2-Thinking").passed

Every function raises kconvert.KconvertError, with the message the command line prints, on
bad input or options (kconvert.errors.UsageError, a subclass, for options that do not go
together). Nothing is printed unless `echo` or `progress` is given (the command line passes
its own); conversions show no progress bar unless `quiet=False`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kconvert.audit import audit
from kconvert.audit.serve import serve_warnings
from kconvert.calibrate import calibrate_to as calibrate
from kconvert.common import distributed, events
from kconvert.common.options import BATCH_SIZE, EVAL_SAMPLES, SEED, SEQ_LEN, STREAM_WINDOW
from kconvert.driver.convert import RunControl
from kconvert.driver.manifest_writer import summary_line
from kconvert.driver.run_summary import RunSummary
from kconvert.evaluate.report import EvalReport
from kconvert.gpu.budget import size_option
from kconvert.model.names import parse_name
from kconvert.records.manifest import Manifest
from kconvert.sizing.predict import Options
from kconvert.sizing.report import InspectReport, inspect_checkpoint
from kconvert.stages import KINDS

log = logging.getLogger(__name__)

# The keyword options the conversions take beside the run controls: every stage kind's
# settings and command-line inputs (kconvert.stages.KINDS, its plug-ins' settings included).
OPTIONS = tuple(dict.fromkeys(o for kind in KINDS.values() for o in kind.options))


def _silent(_message: str) -> None:
    """Where messages go when the caller gives no `echo`."""


@dataclass
class ConversionResult:
    """What a conversion wrote: `output` (None on a dry run), its manifest (the parsed
    `kconvert-manifest.json`), and the run's wall time."""

    command: str
    src: str
    output: Path | None
    manifest: Manifest | None
    seconds: float
    messages: list[str] = field(default_factory=list)  # warnings and notes, as printed
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase of the run

    @property
    def summary(self) -> dict:
        """Tensors, bytes and shards written, modules quantized / dequantized / sparsified,
        experts pruned, relative quantization error (the manifest's `summary`)."""
        return dict(self.manifest.summary) if self.manifest is not None else {}

    def summary_line(self) -> str:
        """The line the command line prints at the end of a run."""
        if self.manifest is None:
            return f"dry run of {self.command} on {self.src}: nothing written"
        return summary_line(self.manifest, str(self.output))

    def to_summary(self) -> RunSummary:
        """What `--json` prints (kconvert.driver.run_summary)."""
        tensors = self.manifest.tensors if self.manifest is not None else {}
        roles = Counter(str(parse_name(name).role) for name in tensors)
        return RunSummary(
            command=self.command, src=self.src,
            output=None if self.output is None else str(self.output), ok=True,
            dry_run=self.manifest is None, bytes_written=int(self.summary.get("bytes", 0)),
            tensors_by_role=dict(sorted(roles.items())), summary=self.summary,
            timings={"total": self.seconds, **self.timings}, messages=self.messages,
            error=None)


def run_recipe(recipe: str, src: str, dst: str, *, revision: str | None = None,
               device: str = "auto", gpu_memory: str | int | None = None,
               resume: bool = False, overwrite: bool = False,
               dry_run: bool = False, quiet: bool = True, readers: int = 4,
               trust_complete: bool = False, token: str | None = None,
               cache_dir: str | None = None, stream: bool = False,
               stream_window: int = STREAM_WINDOW, echo: Callable[[str], None] | None = None,
               **options) -> ConversionResult:
    """`kconvert run RECIPE SRC DST`: RECIPE (a pipelines/ name or a .toml path) on SRC (a
    directory or Hub repo id: only its index's shards and its non-weight files are downloaded,
    with `token` into `cache_dir`; a dry run fetches config, index and headers; `stream`:
    the shards are fetched `stream_window` at a time during the run and deleted once converted)
    into DST. `gpu_memory` ('40GiB', or bytes) is the GPU memory budget of every step on a GPU
    (kconvert.gpu.budget; default: what the card has free less a safety margin).
    `options` are the stage options by name (`OPTIONS`, the command line's long options with
    `_` for `-`); one the recipe does not use is an error."""
    from kconvert.driver.commands import run_conversion

    messages: list[str] = []

    def note(message: str) -> None:
        messages.append(message)
        (echo or _silent)(message)

    timings: dict[str, float] = {}

    def timed(event: str, info: dict) -> None:
        if event == "phase":
            seconds = info["end"] - info["start"]
            timings[info["name"]] = timings.get(info["name"], 0.0) + seconds
            log.info("%s took %.2f s", info["name"], seconds)

    run = RunControl(device=device, gpu_memory=size_option(gpu_memory), resume=resume,
                     overwrite=overwrite, dry_run=dry_run, quiet=quiet, readers=readers,
                     trust_complete=trust_complete, token=token, cache_dir=cache_dir,
                     stream=stream, stream_window=stream_window)
    start = time.perf_counter()
    unsubscribe = events.subscribe(timed, timings=True)
    try:
        manifest = run_conversion(recipe, src, dst, options, run, revision, note)
    finally:
        unsubscribe()
    output = None if manifest is None else Path(dst)
    if output is not None and distributed.is_main():
        for line in serve_warnings(output):  # what `audit --serve` refuses warns here
            note(line)
    return ConversionResult(recipe, src, output, manifest, time.perf_counter() - start,
                            messages, timings)


def int4_to_nvfp4(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert int4-to-nvfp4`: INT4 pack-quantized -> NVFP4 in one pass. Options: `format`
    (compressed-tensors | modelopt), `block_scale` (mse | amax), `targets`, `act_stats`,
    `method` and its settings (with `data`, `samples`, `seq_len`, `batch_size`, `seed` where
    it needs data), and the run controls of `run_recipe`."""
    return run_recipe("int4-to-nvfp4", src, dst, **kwargs)


def int4_to_mxfp4(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert int4-to-mxfp4`: INT4 pack-quantized -> MXFP4 in one pass. Options: `format`
    (quark-mxfp4 | mxfp4-pack-quantized), `block_scale` (mse | amax), `targets`,
    `activations` (dynamic | none), and the run controls of `run_recipe`."""
    return run_recipe("int4-to-mxfp4", src, dst, **kwargs)


def mxfp4_to_nvfp4(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert mxfp4-to-nvfp4`: MXFP4 -> NVFP4, the codes kept and exact wherever NVFP4
    holds the scales (`cast="exact"`; docs/formats.md §7). Options: `format`
    (compressed-tensors | modelopt), `block_scale` (the blocks outside the exact window),
    `targets`, `act_stats`, and the run controls of `run_recipe`."""
    return run_recipe("mxfp4-to-nvfp4", src, dst, **kwargs)


def quantize(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert quantize`: any checkpoint -> NVFP4 or MXFP4 on the targets (options as
    `int4_to_nvfp4`, `format` any of the four, `activations` for MXFP4)."""
    return run_recipe("quantize", src, dst, **kwargs)


def dequant(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert dequant`: quantized -> BF16 (`dtype="F32"`: INT4's values exactly)."""
    return run_recipe("dequant", src, dst, **kwargs)


def reap(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert reap`: prune routed experts by `plan` (a file), or `keep` / `prune_ratio`
    ranked by `criterion` on `stats` (a calibrate output) or `data` (calibrated first), with
    `repair` and `compensate` fitted on `data`."""
    return run_recipe("reap", src, dst, **kwargs)


def sparsify(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert sparsify`: paired-4:8 NVFP4 routed experts. Options: `method` and its
    settings, `group_size`, `storage`, `stats` or `data` (what the method needs), and those of
    `int4_to_nvfp4`."""
    return run_recipe("sparsify", src, dst, **kwargs)


def densify(src: str, dst: str, **kwargs) -> ConversionResult:
    """`kconvert densify`: pair-bitmask p48 -> dense NVFP4, byte for byte."""
    return run_recipe("densify", src, dst, **kwargs)


def evaluate_candidates(src: str, candidates: list[str], data: str, out: str | None = None, *,
         samples: int = EVAL_SAMPLES, seq_len: int = SEQ_LEN, batch_size: int = BATCH_SIZE,
         seed: int = SEED,
         device: str = "auto", dtype: str = "bfloat16", tokenizer: str | None = None,
         quiet: bool = True, echo: Callable[[str], None] = print,
         gpu_memory: str | int | None = None, allow_short_data: bool = False,
         overwrite: bool = False) -> EvalReport:
    """`kconvert eval`: SRC against each candidate on the JSONL `data`, layer by layer;
    returns the report (`eval.json`'s contents) and writes eval.json and eval.png to `out`
    when it is given (replacing a report there only with `overwrite`). The table goes to
    `echo` unless `quiet`. `gpu_memory` as in `run_recipe`. Data that cannot fill `samples`
    sequences of `seq_len` tokens is an error, or with `allow_short_data` a warning."""
    from kconvert.evaluate.run import run_eval

    return run_eval(src, list(candidates), data, out, samples, seq_len, batch_size, seed,
                    device, dtype, tokenizer, quiet, echo=echo,
                    gpu_memory=size_option(gpu_memory), allow_short_data=allow_short_data,
                    overwrite=overwrite)


def size_report(src: str, *, as_format: str | None = None, keep: int | None = None,
            p48: str | None = None, targets: str | None = None, format: str | None = None,
            gpus: int | None = None, gpu_mem: float | None = None, mem_util: float = 0.9,
            tp: int | None = None, ep: int | None = None, pp: int | None = None,
            context: int | None = None, kv_dtype: str = "bf16", revision: str | None = None,
            token: str | None = None, cache_dir: str | None = None,
            gpu_memory: str | int | None = None) -> InspectReport:
    """`kconvert inspect`: bytes of SRC by component, of the output `as_format` / `keep` /
    `p48` would write (planned by the converter itself), per GPU under TP/EP/PP, the MLA KV
    cache per token and the longest context beside the weights in `gpu_mem` GiB per GPU.
    Reads headers and config.json only; also plans each GPU command's memory on the model's
    shapes for `gpu_memory` (kconvert.gpu.budget). `report.to_json()` has the `--json`
    keys."""
    return inspect_checkpoint(
        src, Options(as_format, keep, p48, targets, format), gpus=gpus, gpu_mem=gpu_mem,
        mem_util=mem_util, tp=tp, ep=ep, pp=pp, context=context, kv_dtype=kv_dtype,
        revision=revision, token=token, cache_dir=cache_dir, gpu_memory=gpu_memory)


# The commands' names, as the API names them (kconvert.eval, kconvert.inspect): bound last, so
# that above this line `eval` and `inspect` keep Python's meaning.
eval = evaluate_candidates
inspect = size_report

__all__ = [
    "OPTIONS",
    "ConversionResult",
    "audit",
    "calibrate",
    "densify",
    "dequant",
    "eval",
    "evaluate_candidates",
    "inspect",
    "int4_to_mxfp4",
    "int4_to_nvfp4",
    "mxfp4_to_nvfp4",
    "quantize",
    "reap",
    "run_recipe",
    "size_report",
    "sparsify",
]

