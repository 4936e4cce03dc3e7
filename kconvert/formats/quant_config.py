"""The output's quantization_config (config.json) and the files its format family adds.

The config goes wherever the source had one (top level and/or `text_config` for K2.5/K2.6),
or at the top level (and in `text_config`) when the source had none, so a stale INT4 block
can never survive anywhere in config.json.
"""

from __future__ import annotations

import copy

from kconvert.formats.base import OutputModule
from kconvert.formats.compressed_tensors import compressed_tensors_config
from kconvert.formats.nvfp4_modelopt import HF_QUANT_CONFIG, modelopt_config


def output_format(modules: list[OutputModule]) -> str:
    """'compressed-tensors', 'modelopt', 'bf16' (no quantized module left) or 'source'
    (nothing re-encoded and the source was quantized: its config stays)."""
    codecs = {m.out_codec or m.codec for m in modules}
    families = {c.config_family for c in codecs}
    for family in ("modelopt", "compressed-tensors"):
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
    if fmt == "modelopt":
        qconfig, hf_quant = modelopt_config(modules, names)
        return fmt, qconfig, {HF_QUANT_CONFIG: hf_quant}
    if fmt == "compressed-tensors":
        has_vision = any(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
        return fmt, compressed_tensors_config(modules, has_vision), {}
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
