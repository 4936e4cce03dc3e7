"""The NaN/Inf test every float byte read passes, on the raw bits (no float conversion)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from kconvert.errors import KconvertError
from kconvert.io.shards import TensorInfo

# Per float dtype: its bits as an unsigned integer, and the bits that are all ones exactly for
# Inf and NaN (the exponent field; FP8 e4m3fn has no Inf, and its NaN is exponent and mantissa
# all ones). Pass-through bytes are checked on these bits with numpy, single-threaded: torch's
# isfinite from a reader thread starts a thread pool of its own for that thread, and on a CPU
# run, with the reader threads kept to a core or two, those pools fought over them (the
# full-size set's pass-through reads took 2.6x as long).
NONFINITE_BITS = {torch.float16: np.uint16(0x7C00), torch.bfloat16: np.uint16(0x7F80),
                   torch.float32: np.uint32(0x7F800000),
                   torch.float64: np.uint64(0x7FF0000000000000),
                   torch.float8_e4m3fn: np.uint8(0x7F), torch.float8_e5m2: np.uint8(0x7C)}


# Values tested at a time: the masked copy of a block stays in the CPU's cache, which makes
# the test several times faster than one pass over a whole piece.
BLOCK = 1 << 18
_scratch = threading.local()


def find_nonfinite(raw: torch.Tensor, dtype: torch.dtype) -> tuple[int, int] | None:
    """(how many NaN/Inf values, index of the first) in the uint8 bytes `raw` of values of
    `dtype`, or None when there is none (always for integers; safetensors is little-endian,
    as every machine torch runs on)."""
    ones = NONFINITE_BITS.get(dtype)
    if ones is None:
        return None
    bits = raw.numpy().view(ones.dtype)
    scratch = getattr(_scratch, ones.dtype.name, None)
    if scratch is None:
        scratch = np.empty(BLOCK, ones.dtype)
        setattr(_scratch, ones.dtype.name, scratch)
    for start in range(0, len(bits), BLOCK):
        block = bits[start:start + BLOCK]
        masked = np.bitwise_and(block, ones, out=scratch[:len(block)])
        if masked.max() == ones:  # no masked value exceeds the mask: max == mask iff a hit
            hits = np.flatnonzero(np.bitwise_and(bits[start:], ones) == ones)
            return len(hits), start + int(hits[0])
    return None


def has_nonfinite(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the uint8 bytes `raw` of values of `dtype` hold a NaN or Inf."""
    return find_nonfinite(raw, dtype) is not None


def check_finite(raw: torch.Tensor, info: TensorInfo) -> None:
    """Raise if the uint8 bytes `raw` of a piece of `info` hold a NaN or Inf."""
    if has_nonfinite(raw, info.torch_dtype):
        raise KconvertError("NaN or Inf in the source weights", file=info.file.name,
                            tensor=info.name)
