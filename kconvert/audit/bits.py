"""Values compared and located as stored: on their raw bits, and by their index."""

from __future__ import annotations

import numpy as np
import torch

from kconvert.io.shards import TensorInfo


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal dtype, shape and bytes (so NaN equals itself and 0.0 differs from -0.0)."""
    if a is None or b is None:
        return a is b
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def first_true(mask: torch.Tensor) -> int:
    idx = mask.reshape(-1).nonzero()
    return int(idx[0]) if idx.numel() else 0


def where(info: TensorInfo, element: int) -> str:
    """Flat element index -> "[row, column]" (or "[i]" for a vector) in `info`'s shape."""
    if len(info.shape) < 2:
        return f"[{element}]"
    idx = []
    for dim in reversed(info.shape):
        idx.append(element % dim)
        element //= dim
    return "[" + ", ".join(str(i) for i in reversed(idx)) + "]"


def short_float(t: torch.Tensor) -> str:
    """A scale's first value as Python prints it (every digit: scales must match exactly)."""
    return repr(float(t.reshape(-1)[0])) if t.numel() else "[]"


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first byte where the uint8 tensors `a` and `b` (equally long) differ, or
    None; compared 8 bytes at a time with numpy, so that it runs in reader threads."""
    x, y = a.numpy(), b.numpy()
    whole = len(x) // 8 * 8
    if np.array_equal(x[:whole].view(np.uint64), y[:whole].view(np.uint64)) and \
            np.array_equal(x[whole:], y[whole:]):
        return None
    return int(np.flatnonzero(x != y)[0])
