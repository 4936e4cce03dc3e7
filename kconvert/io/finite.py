"""The NaN/Inf test every float byte read passes, on the raw bits (no float conversion)."""

from __future__ import annotations

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


def has_nonfinite(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the uint8 bytes `raw` of values of `dtype` hold a NaN or Inf (never for
    integers; safetensors is little-endian, as every machine torch runs on)."""
    ones = NONFINITE_BITS.get(dtype)
    return ones is not None and bool(
        np.any(np.bitwise_and(raw.numpy().view(ones.dtype), ones) == ones))


def check_finite(raw: torch.Tensor, info: TensorInfo) -> None:
    """Raise if the uint8 bytes `raw` of a piece of `info` hold a NaN or Inf."""
    if has_nonfinite(raw, info.torch_dtype):
        raise KconvertError("NaN or Inf in the source weights", file=info.file.name,
                            tensor=info.name)
