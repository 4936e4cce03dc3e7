"""What every on-disk format of one linear's parameters provides: a codec with batched
decode/encode.

A codec turns the parameter tensors of B same-shaped linears (each stacked on a leading batch
dim) into fp32 weights [B, out, in] and back. Which codec a source module uses is read off
the parameters it has (`kconvert.formats.detect_codec`), so mixed checkpoints need no
configuration.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kconvert.io.shards import TensorInfo

ParamSpec = tuple[str, str, tuple[int, ...]]  # (param suffix, safetensors dtype, shape)


class Codec:
    """Base: `params` names the parameter suffixes a module in this format has."""

    name: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    quantized: ClassVar[bool] = True

    @classmethod
    def logical_shape(cls, infos: dict[str, TensorInfo], shape_value: tuple[int, int] | None
                      ) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def decode(cls, t: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        raise NotImplementedError


# Parameters that belong to a format but that a decode does not need (W4A4 input scales).
OPTIONAL_PARAMS = {"input_scale", "input_global_scale"}
