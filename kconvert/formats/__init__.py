"""On-disk formats of a linear's parameters, one module per format, and their registry.

A format module holds its codec class (kconvert.formats.base.Codec): decode and encode of
batched parameters (one signature for every format, the numbers in an EncodeSpec), how it is
recognised, the dtypes and shapes of its parameters, how a quantization_config names it and
what its scheme must agree with, and (an output format) how its config family's
quantization_config is written. Adding a format: its module here and one `register(codec)`
below; an output format that the command line offers also needs its name in the command
line's choices (kconvert.common.options.OUTPUT_FORMATS, which imports no torch; a test keeps the two
lists equal).
"""

from __future__ import annotations

from kconvert.formats.base import (
    DEFAULT_SCALE_RULE,
    OPTIONAL_PARAMS,
    Codec,
    Encoded,
    EncodeSpec,
    encode_spec,
)
from kconvert.formats.dense import DenseCodec
from kconvert.formats.fp8_block import Fp8BlockCodec
from kconvert.formats.int4 import Int4Codec
from kconvert.formats.mxfp4_ct import Mxfp4Codec
from kconvert.formats.mxfp4_quark import QuarkMxfp4Codec
from kconvert.formats.nvfp4 import cpu_threads, warm_cpu_kernels
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.formats.nvfp4_modelopt import HF_QUANT_CONFIG, ModeloptNvfp4Codec
from kconvert.formats.nvfp4_pair_bitmask import Nvfp4PairBitmaskCodec
from kconvert.io.shards import TensorInfo
from kconvert.model.names import register_param_suffixes

# Tried in this order: the first codec whose parameters a module has is its format.
SOURCE_CODECS: list[type[Codec]] = []
# What `--format NAME` writes.
OUTPUT_CODECS: dict[str, type[Codec]] = {}


def register(codec: type[Codec]) -> None:
    """Make `codec` a format kconvert reads (tried before the plain dense format) and, when it
    has a `cli_name`, writes; its parameter names become names the model knows."""
    if codec in SOURCE_CODECS:
        return
    register_param_suffixes(codec.params)
    at = SOURCE_CODECS.index(DenseCodec) if DenseCodec in SOURCE_CODECS else len(SOURCE_CODECS)
    SOURCE_CODECS.insert(at, codec)
    if codec.cli_name:
        OUTPUT_CODECS[codec.cli_name] = codec


for _codec in (Int4Codec, Nvfp4Codec, Nvfp4PairBitmaskCodec, ModeloptNvfp4Codec, Mxfp4Codec,
               QuarkMxfp4Codec, Fp8BlockCodec, DenseCodec):
    register(_codec)
# (a format, an on-disk storage other than "dense") -> the codec that writes that storage.
STORAGE_CODECS: dict[tuple[type[Codec], str], type[Codec]] = {
    (Nvfp4Codec, "pair-bitmask"): Nvfp4PairBitmaskCodec,
}


def stored_as(codec: type[Codec], storage: str) -> type[Codec]:
    """The codec that writes `codec`'s values in `storage` ("dense": the codec itself)."""
    if storage == "dense":
        return codec
    try:
        return STORAGE_CODECS[codec, storage]
    except KeyError:
        raise KeyError(f"{codec.description} has no {storage} storage") from None


def sparse_form_formats(group_size: int, storage: str) -> list[str]:
    """The output formats (`--format` names) that write paired-4:8 blocks of `group_size` in
    `storage` (docs/p48.md)."""
    return [name for name, codec in OUTPUT_CODECS.items()
            if (group_size, storage) in codec.sparse_forms]


def dense_storage(codec: type[Codec]) -> type[Codec] | None:
    """The codec of the dense storage whose values `codec` stores in another layout (a
    re-layout back to it changes no byte of a value: densify), or None."""
    return next((dense for (dense, _), stored in STORAGE_CODECS.items() if stored is codec), None)


def detect_codec(infos: dict[str, TensorInfo]) -> type[Codec] | None:
    """The codec whose parameters exactly match a module's, or None (not a linear we know)."""
    return next((c for c in SOURCE_CODECS if c.matches(infos)), None)


def router_format(params: dict[str, TensorInfo]) -> tuple[type[Codec], tuple[int, int]] | None:
    """(format, logical shape) of a router from its weight parameters (`mlp.gate.weight`, and
    `weight_scale` where AMD's MXFP4 recipe quantized it; not e_score_correction_bias), or None
    when they match no format a router may have (plain float or MXFP4)."""
    codec = detect_codec(params)
    if codec is None or not codec.router_form:
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


__all__ = ["DEFAULT_SCALE_RULE", "HF_QUANT_CONFIG", "OPTIONAL_PARAMS", "OUTPUT_CODECS",
           "SOURCE_CODECS", "STORAGE_CODECS", "Codec", "DenseCodec", "EncodeSpec", "Encoded",
           "Fp8BlockCodec", "Int4Codec", "ModeloptNvfp4Codec", "Mxfp4Codec", "Nvfp4Codec",
           "Nvfp4PairBitmaskCodec", "QuarkMxfp4Codec", "cpu_threads", "ct_codec",
           "dense_storage", "detect_codec", "encode_spec", "method_codec", "modelopt_codec",
           "register", "router_format", "stored_as", "warm_cpu_kernels"]
