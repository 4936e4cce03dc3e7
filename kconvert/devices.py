"""Where compute runs: `--device auto | cpu | cuda | cuda:N` as a torch device."""

from __future__ import annotations

import torch

from kconvert.errors import KconvertError


def pick_device(spec: str) -> torch.device:
    """The torch device for `--device` (auto | cpu | cuda | cuda:N), or a clear error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise KconvertError(f"--device {spec!r} is not a device; use auto, cpu, cuda or "
                            "cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise KconvertError(f"--device {spec!r}: kconvert runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KconvertError(f"--device {spec}: no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise KconvertError(f"--device {spec}: this machine has "
                                f"{torch.cuda.device_count()} CUDA device(s)")
    return device
