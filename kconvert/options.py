"""Defaults and rules of the options that the command line and the Python API share (no torch
here: the command line imports this at start-up)."""

from __future__ import annotations

# --samples when it is not given: REAP ranks experts on many routed tokens per expert, while
# SparseGPT's per-expert Hessians are good from a few dozen sequences and cost far more each.
REAP_SAMPLES = 1024
SPARSEGPT_SAMPLES = 128

# How calibration data is read and run, when not given.
SEQ_LEN = 2048
BATCH_SIZE = 8
SEED = 0
EVAL_SAMPLES = 128  # eval's --samples

# Options that only act beside another one: given alone they would be silently dropped.
ONLY_WITH = {
    "samples": ("data",), "seq_len": ("data",), "batch_size": ("data",), "seed": ("data",),
    "save_stats": ("data",),
    "keep": ("data", "stats", "plan"), "prune_ratio": ("data", "stats", "plan"),
    "criterion": ("data", "stats"),
}
