"""The output's quantization_config (config.json) and the files its format family adds.

The config goes wherever the source had one (top level and/or `text_config` for K2.5/K2.6),
or at the top level (and in `text_config`) when the source had none, so a stale INT4 block
can never survive anywhere in config.json.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from kconvert.formats import ct_config, mxfp4_quark, nvfp4_modelopt
from kconvert.formats.base import Codec, OutputModule

# The output tensors: name -> shape.
Shapes = Mapping[str, tuple[int, ...]]

# Config families in order of precedence: the first family an output module's codec names
# describes the whole output (its codec's `write_config`); a family not listed comes after.
PRECEDENCE = (nvfp4_modelopt.QUANT_METHOD, mxfp4_quark.QUANT_METHOD, ct_config.QUANT_METHOD)


def _describing(modules: list[OutputModule]) -> type[Codec] | None:
    """The codec whose config family describes the output, None if no module's has one."""
    codecs = sorted({c for m in modules if (c := m.out_codec or m.codec).config_family},
                    key=lambda c: (PRECEDENCE.index(c.config_family)
                                   if c.config_family in PRECEDENCE else len(PRECEDENCE),
                                   c.config_family, c.name))
    return codecs[0] if codecs else None


def output_format(modules: list[OutputModule]) -> str:
    """A config family ('modelopt', 'quark', 'compressed-tensors', ...), 'bf16' (no
    quantized module left) or 'source' (nothing re-encoded and the source was quantized: its
    config stays)."""
    codec = _describing(modules)
    if codec is not None:
        return codec.config_family  # type: ignore[return-value]
    if not any((m.out_codec or m.codec).quantized for m in modules):
        return "bf16"
    return "source"


def output_config(modules: list[OutputModule], names: Shapes, config: dict
                  ) -> tuple[str, dict | None, dict[str, dict]]:
    """(output format, the output's quantization_config or None, files the format adds
    (name -> JSON)) for modules as converted, `names` the output tensors (name -> shape),
    `config` the source's config.json."""
    fmt = output_format(modules)
    codec = _describing(modules)
    if codec is not None:
        qconfig, files = codec.write_config(modules, names)
        return fmt, qconfig, files
    if fmt == "source":
        text = config.get("text_config", config)
        return fmt, config.get("quantization_config") or text.get("quantization_config"), {}
    return fmt, None, {}


def rewrite_config(config: dict, qconfig: dict | None) -> dict:
    """config.json with every quantization_config replaced by `qconfig` (or removed if None)."""
    new = copy.deepcopy(config)
    text = new.get("text_config")
    had = [d for d in (new, text) if isinstance(d, dict) and "quantization_config" in d]
    for d in (new, text):
        if isinstance(d, dict):
            d.pop("quantization_config", None)
    if qconfig is not None:
        for d in had or [d for d in (new, text) if isinstance(d, dict)]:
            d["quantization_config"] = copy.deepcopy(qconfig)
    return new
