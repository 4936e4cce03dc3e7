"""On-disk formats of a linear's parameters, one module per format, and their registry.

A format module holds its codec class (kconvert.formats.base.Codec): decode/encode of batched
parameters, how it is recognised, the dtypes and shapes of its parameters, how a
quantization_config names it and what its scheme must agree with. Adding a format: its
module here, its codec in SOURCE_CODECS below, and (for an output format, selected by
`--format`) its name in the command line's choices (kconvert/cli/base.py, which imports no
torch; a test keeps the two lists equal).
"""

from __future__ import annotations

from kconvert.formats.base import OPTIONAL_PARAMS, Codec
from kconvert.formats.dense import DenseCodec
from kconvert.formats.fp8_block import Fp8BlockCodec
from kconvert.formats.int4 import Int4Codec
from kconvert.formats.mxfp4_ct import Mxfp4Codec
from kconvert.formats.mxfp4_quark import QuarkMxfp4Codec
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.formats.nvfp4_modelopt import ModeloptNvfp4Codec
from kconvert.formats.nvfp4_pair_bitmask import Nvfp4PairBitmaskCodec
from kconvert.io.shards import TensorInfo

# Tried in this order: the first codec whose parameters a module has is its format.
SOURCE_CODECS: tuple[type[Codec], ...] = (
    Int4Codec, Nvfp4Codec, Nvfp4PairBitmaskCodec, ModeloptNvfp4Codec, Mxfp4Codec, QuarkMxfp4Codec,
    Fp8BlockCodec, DenseCodec,
)
# What `--format NAME` writes.
OUTPUT_CODECS = {c.cli_name: c for c in SOURCE_CODECS if c.cli_name}


def detect_codec(infos: dict[str, TensorInfo]) -> type[Codec] | None:
    """The codec whose parameters exactly match a module's, or None (not a linear we know)."""
    return next((c for c in SOURCE_CODECS if c.matches(infos)), None)


def router_format(params: dict[str, TensorInfo]) -> tuple[type[Codec], tuple[int, int]] | None:
    """(format, logical shape) of a router from its weight parameters (`mlp.gate.weight`, and
    `weight_scale` where AMD's MXFP4 recipe quantized it; not e_score_correction_bias), or None
    when they match no format a router may have (plain float or MXFP4)."""
    codec = detect_codec(params)
    if codec is None or not (codec is DenseCodec or codec.encodes_itself):
        return None
    return codec, codec.logical_shape(params, None)


def ct_codec(fmt: str | None, qconfig: dict) -> type[Codec] | None:
    """The format a compressed-tensors config group's `format` names (a layout flagged in
    the config picks its own codec)."""
    named = [c for c in SOURCE_CODECS if c.ct_format == fmt]
    for c in named:
        if c.ct_layout and (qconfig.get(c.ct_layout_key) or {}).get("layout") == c.ct_layout:
            return c
    return next((c for c in named if c.ct_layout is None), None)


def modelopt_codec(algo: str | None) -> type[Codec] | None:
    """The format a ModelOpt config's quant_algo names."""
    return next((c for c in SOURCE_CODECS if algo in c.modelopt_algos), None)


def method_codec(method: str | None) -> type[Codec] | None:
    """The format a config's quant_method names by itself (FP8-block's "fp8")."""
    return next((c for c in SOURCE_CODECS if c.quant_method and c.quant_method == method), None)


__all__ = ["OPTIONAL_PARAMS", "OUTPUT_CODECS", "SOURCE_CODECS", "Codec", "DenseCodec",
           "Fp8BlockCodec", "Int4Codec", "ModeloptNvfp4Codec", "Mxfp4Codec", "Nvfp4Codec",
           "Nvfp4PairBitmaskCodec", "QuarkMxfp4Codec", "ct_codec", "detect_codec",
           "method_codec", "modelopt_codec", "router_format"]
