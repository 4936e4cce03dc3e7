"""The output's quantization_config (config.json) and the files its format family adds.

The config goes wherever the source had one (top level and/or `text_config` for K2.5/K2.6),
or at the top level (and in `text_config`) when the source had none, so a stale INT4 block
can never survive anywhere in config.json.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from kconvert.formats import ct_config, nvfp4_modelopt
from kconvert.formats.base import OutputModule

# (modules as converted, the output tensors' names) -> (quantization_config, files it adds).
ConfigWriter = Callable[[list[OutputModule], list[str]], tuple[dict, dict[str, dict]]]


def _modelopt(modules: list[OutputModule], names: list[str]) -> tuple[dict, dict[str, dict]]:
    qconfig, hf_quant = nvfp4_modelopt.modelopt_config(modules, names)
    return qconfig, {nvfp4_modelopt.HF_QUANT_CONFIG: hf_quant}


def _compressed_tensors(modules: list[OutputModule], names: list[str]
                        ) -> tuple[dict, dict[str, dict]]:
    has_vision = any(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
    return ct_config.compressed_tensors_config(modules, has_vision), {}


# The config families an output can be described by (Codec.config_family), by name, in order of
# precedence: the first family an output module's codec names describes the whole output. A
# new family is its writer here.
CONFIG_WRITERS: dict[str, ConfigWriter] = {
    nvfp4_modelopt.QUANT_METHOD: _modelopt,
    ct_config.QUANT_METHOD: _compressed_tensors,
}


def output_format(modules: list[OutputModule]) -> str:
    """A config family of CONFIG_WRITERS ('modelopt', 'compressed-tensors'), 'bf16' (no
    quantized module left) or 'source' (nothing re-encoded and the source was quantized: its
    config stays)."""
    codecs = {m.out_codec or m.codec for m in modules}
    families = {c.config_family for c in codecs}
    for family in CONFIG_WRITERS:
        if family in families:
            return family
    if not any(c.quantized for c in codecs):
        return "bf16"
    return "source"


def output_config(modules: list[OutputModule], names: list[str], config: dict
                  ) -> tuple[str, dict | None, dict[str, dict]]:
    """(output format, the output's quantization_config or None, files the format adds
    (name -> JSON)) for modules as converted, `names` the output tensors, `config` the
    source's config.json."""
    fmt = output_format(modules)
    if fmt in CONFIG_WRITERS:
        qconfig, files = CONFIG_WRITERS[fmt](modules, names)
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
