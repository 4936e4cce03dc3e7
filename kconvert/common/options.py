"""Defaults and rules of the options that the command line and the Python API share (no torch
here: the command line imports this at start-up)."""

from __future__ import annotations

from kconvert.plugins.input_scales import INPUT_SCALE_POLICIES

# --samples when it is not given: REAP ranks experts on many routed tokens per expert, while
# SparseGPT's per-expert Hessians are good from a few dozen sequences and cost far more each.
REAP_SAMPLES = 1024
SPARSEGPT_SAMPLES = 128

# How calibration data is read and run, when not given.
SEQ_LEN = 2048
BATCH_SIZE = 8
SEED = 0
EVAL_SAMPLES = 128  # eval's --samples

# FP8 block-scale rules of NVFP4 encoding (formats/nvfp4.py).
BLOCK_SCALE_RULES = ("amax", "mse")
# quantize's --cast: how an MXFP4 source becomes NVFP4: decoded and encoded by the block-scale
# rule ("none"), or its codes kept with exact scales where NVFP4 holds them, the other blocks
# by the rule ("exact", kconvert.formats.nvfp4_cast).
CASTS = ("none", "exact")
# quantize's --input-scale: the per-tensor input scale of NVFP4 W4A4 routed experts, by the
# policies declared in kconvert.plugins.input_scales; the default was chosen by measurement
# (docs/input-scales.md).
INPUT_SCALES = INPUT_SCALE_POLICIES.names()
INPUT_SCALE = INPUT_SCALE_POLICIES.default("quantize").name

# Options that only act beside another one: given alone they would be silently dropped.
ONLY_WITH = {
    # first: what needs --data says so before --keep asks for a source of scores
    "repair": ("data",), "compensate": ("data",),
    "samples": ("data",), "seq_len": ("data",), "batch_size": ("data",), "seed": ("data",),
    "save_stats": ("data",), "allow_short_data": ("data",),
    "keep": ("data", "stats", "plan"), "prune_ratio": ("data", "stats", "plan"),
    "criterion": ("data", "stats"),
}

# The choices of the stage options, here so that the command line lists them without importing
# the stages (torch); the stages and libraries check their values against these same names.
# (The plug-ins' names, methods and pruning kinds, are their declarations': kconvert.plugins.)
SPARSIFY_STORAGES = ("dense", "pair-bitmask")
# `--format NAME` of the quantize stage: each is an output codec's `cli_name`
# (kconvert.formats.OUTPUT_CODECS; a test keeps the two equal).
OUTPUT_FORMATS = ("compressed-tensors", "modelopt", "mxfp4-pack-quantized", "quark-mxfp4")
# `inspect --as`: the numbers an output holds (a codec's `grid`: bf16 by dequant, nvfp4 and
# mxfp4 by quantize, int4 an INT4 source as it is; kconvert.sizing.predict checks it against the
# registry).
AS_FORMATS = ("bf16", "int4", "nvfp4", "mxfp4")
# MXFP4's --activations: W4A16, or W4A4 with activations quantized at run time
# (kconvert.stages.quantize).
ACTIVATIONS = ("none", "dynamic")
# --stream-window: a streamed run's source shards on disk at once (kconvert.io.stream)
STREAM_WINDOW = 3


def calibration_run(options: dict, samples: int) -> tuple[int, int, int, int]:
    """(samples, seq_len, batch_size, seed) of a stage's calibration from the options given,
    the defaults where not given (`samples`: the stage's own)."""
    return (options.get("samples") or samples, options.get("seq_len") or SEQ_LEN,
            options.get("batch_size") or BATCH_SIZE, options.get("seed", SEED))

# --gpu-memory when it is not given: the memory free on the card when the command starts, less
# a safety margin of GPU_MEMORY_MARGIN_FRACTION of the card (at least GPU_MEMORY_MARGIN_MIN)
# for what torch's allocator does not count (the CUDA context, cuBLAS/cuDNN/Triton workspaces),
# its fragmentation, and other processes on the card (4 GiB of an 80 GB H100, 7 GiB of an H200).
GPU_MEMORY_MARGIN_FRACTION = 0.05
GPU_MEMORY_MARGIN_MIN = 2 << 30
GPU_MEMORY_HELP = ("GPU memory the command may use, e.g. 40GiB (GiB/MiB binary, GB/MB "
                   "decimal) [default: what the card has free, less 5% of it (at least 2 GiB)]. "
                   "Micro-batches and OBS batches shrink to fit; a command that cannot fit "
                   "says so before it starts.")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'40GiB', '40G' -> 40 * 2^30; '40GB' -> 40 * 10^9; '512MiB', '1.5TiB'; a bare number is
    bytes. Raises ValueError on anything else or on less than 1 MiB."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size such as 40GiB or 512MiB")
    prefix, binary = (m.group(2) or "").lower(), m.group(3)
    decimal = prefix and not binary and text.strip().lower().endswith("b")
    unit = 10 ** (3 * " kmgt".index(prefix)) if decimal else _UNITS[prefix]
    value = int(float(m.group(1)) * unit)
    if value < 1 << 20:
        raise ValueError(f"{text!r} is less than 1 MiB")
    return value
