"""On-disk formats of a linear's parameters, one module per format, and their registry.

A format module holds its codec (decode/encode of batched parameters, output specs). Adding a
format: its module here, and its codec in the registry below (SOURCE_CODECS, and
OUTPUT_CODECS when kconvert can write it).
"""

from __future__ import annotations

from kconvert.formats.base import OPTIONAL_PARAMS, Codec
from kconvert.formats.dense import DenseCodec
from kconvert.formats.fp8_block import Fp8BlockCodec
from kconvert.formats.int4 import Int4Codec
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.formats.nvfp4_modelopt import ModeloptNvfp4Codec
from kconvert.formats.nvfp4_pair_bitmask import Nvfp4PairBitmaskCodec
from kconvert.io.shards import TensorInfo

SOURCE_CODECS: tuple[type[Codec], ...] = (
    Int4Codec, Nvfp4Codec, Nvfp4PairBitmaskCodec, ModeloptNvfp4Codec, Fp8BlockCodec, DenseCodec,
)


OUTPUT_CODECS = {"compressed-tensors": Nvfp4Codec, "modelopt": ModeloptNvfp4Codec}


def detect_codec(infos: dict[str, TensorInfo]) -> type[Codec] | None:
    """The codec whose parameters exactly match a module's, or None (not a linear we know)."""
    names = set(infos) - OPTIONAL_PARAMS
    weight = infos.get("weight")
    for codec in SOURCE_CODECS:
        if names != set(codec.params):
            continue
        if codec is DenseCodec and weight.dtype not in ("BF16", "F16", "F32"):
            continue
        if codec is Fp8BlockCodec and weight.dtype != "F8_E4M3":
            continue
        if codec is ModeloptNvfp4Codec and weight.dtype != "U8":
            continue
        return codec
    return None


__all__ = ["OPTIONAL_PARAMS", "OUTPUT_CODECS", "SOURCE_CODECS", "Codec", "DenseCodec",
           "Fp8BlockCodec", "Int4Codec", "ModeloptNvfp4Codec", "Nvfp4Codec",
           "Nvfp4PairBitmaskCodec", "detect_codec"]
