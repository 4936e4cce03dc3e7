"""The Python API: one function per command, the command line's options as keyword arguments.

    import kconvert
    report = kconvert.inspect("moonshotai/Kimi-K2-Thinking", as_format="nvfp4", gpus=8,
                              gpu_mem=179)

Every function raises kconvert.KconvertError with the command line's message on bad input.
"""

from __future__ import annotations

from kconvert.sizing.predict import Options
from kconvert.sizing.report import InspectReport, inspect_checkpoint


def inspect(src: str, *, as_format: str | None = None, keep: int | None = None,
            p48: str | None = None, targets: str | None = None, format: str | None = None,
            gpus: int | None = None, gpu_mem: float | None = None, mem_util: float = 0.9,
            tp: int | None = None, ep: int | None = None, pp: int | None = None,
            context: int | None = None, kv_dtype: str = "bf16", revision: str | None = None,
            token: str | None = None, cache_dir: str | None = None) -> InspectReport:
    """`kconvert inspect`: bytes of SRC by component, of the output `as_format` / `keep` /
    `p48` would write (planned by the converter itself), per GPU under TP/EP/PP, the MLA KV
    cache per token and the longest context beside the weights in `gpu_mem` GiB per GPU.
    Reads headers and config.json only. `report.to_json()` has the `--json` keys."""
    return inspect_checkpoint(
        src, Options(as_format, keep, p48, targets, format), gpus=gpus, gpu_mem=gpu_mem,
        mem_util=mem_util, tp=tp, ep=ep, pp=pp, context=context, kv_dtype=kv_dtype,
        revision=revision, token=token, cache_dir=cache_dir)
