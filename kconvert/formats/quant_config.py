"""The output's quantization_config (config.json) and ModelOpt's hf_quant_config.json.

compressed-tensors blocks are built with compressed-tensors' own pydantic models, laid out as
its ModelCompressor writes them. The block goes wherever the source had one (top level and/or
`text_config` for K2.5/K2.6), or at the top level (and in `text_config`) when the source had
none, so a stale INT4 block can never survive anywhere in config.json.
"""

from __future__ import annotations

import copy
import re

from kconvert import __version__
from kconvert.errors import KconvertError
from kconvert.formats.dense import DenseCodec
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.formats.nvfp4_modelopt import ModeloptNvfp4Codec
from kconvert.formats.nvfp4_pair_bitmask import Nvfp4PairBitmaskCodec
from kconvert.model.names import Role
from kconvert.stages.base import ModuleWork

CT_NVFP4 = (Nvfp4Codec, Nvfp4PairBitmaskCodec)
# compressed-tensors target regexes per role (vLLM matches them against module names).
CT_TARGETS = {
    Role.ROUTED_EXPERT: r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$",
    Role.SHARED_EXPERT: r"re:.*mlp\.shared_experts\.(gate|up|down)_proj$",
    Role.DENSE_MLP: r"re:.*mlp\.(gate|up|down)_proj$",
    Role.ATTENTION: r"re:.*self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$",
}


def output_format(modules: list[ModuleWork]) -> str:
    """'compressed-tensors', 'modelopt' or 'bf16' (no quantized module left)."""
    codecs = {m.out_codec or m.codec for m in modules}
    if ModeloptNvfp4Codec in codecs:
        return "modelopt"
    if codecs & set(CT_NVFP4):
        return "compressed-tensors"
    if codecs <= {DenseCodec}:
        return "bf16"
    return "source"  # nothing re-encoded and the source was quantized: its block stays


def _roles_by_block(modules: list[ModuleWork]) -> dict[int, list[Role]]:
    """NVFP4 roles of the output per scale block size (16; 32 for sparse kernels)."""
    blocks: dict[Role, set[int]] = {}
    for m in modules:
        if (m.out_codec or m.codec) in CT_NVFP4:
            blocks.setdefault(m.tn.role, set()).add(m.group_size)
    mixed = [r.value for r, b in blocks.items() if len(b) > 1]
    if mixed:
        raise KconvertError(f"{mixed}: one role must use one NVFP4 block size")
    by_block: dict[int, list[Role]] = {}
    for role in CT_TARGETS:
        if role in blocks:
            by_block.setdefault(next(iter(blocks[role])), []).append(role)
    return dict(sorted(by_block.items()))


def compressed_tensors_block(modules: list[ModuleWork], has_vision: bool) -> dict:
    """NVFP4A16, or NVFP4 (W4A4) when calibrated input scales were written; one config
    group per block size (group 32 is p48's sparse-kernel form, see the README)."""
    # Imported here: compressed-tensors takes seconds to import (it loads transformers), and
    # only runs that write its config need it.
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    w4a4 = any(m.has_input_scale for m in modules)
    groups = {}
    for i, (group_size, roles) in enumerate(_roles_by_block(modules).items()):
        scheme = preset_name_to_scheme("NVFP4" if w4a4 else "NVFP4A16",
                                       [CT_TARGETS[r] for r in roles])
        scheme.weights.group_size = group_size
        scheme.format = "nvfp4-pack-quantized"
        groups[f"group_{i}"] = scheme
    ignore = ["lm_head"] + (["re:vision_tower.*", "re:mm_projector.*"] if has_vision else [])
    qc = QuantizationConfig(
        config_groups=groups,
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=ignore,
    )
    # The same layout as compressed-tensors' ModelCompressor.update_config, minus the empty
    # sparsity/transform blocks (vLLM refuses some sparsity_config forms: p48.md).
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        **qc.model_dump(mode="json", exclude={"quant_method"}),
    }


def modelopt_exclude(modules: list[ModuleWork], names: list[str]) -> list[str]:
    """Wildcard patterns for every linear left unquantized (vLLM #45102: they carry no scales)."""
    excluded = {m.out_module for m in modules if (m.out_codec or m.codec) is not ModeloptNvfp4Codec}
    patterns = {re.sub(r"\.layers\.\d+\.", ".layers.*.", e) for e in excluded}
    for name in names:
        if name.endswith("mlp.gate.weight"):
            patterns.add(re.sub(r"\.layers\.\d+\.", ".layers.*.", name[: -len(".weight")]))
        elif name.startswith(("lm_head.", "language_model.lm_head.")):
            patterns.add(name.rsplit(".", 1)[0])
        elif name.startswith(("vision_tower.", "mm_projector.")):
            patterns.add(name.split(".", 1)[0] + "*")
    return sorted(patterns)


def modelopt_blocks(modules: list[ModuleWork], names: list[str]) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) for ModelOpt NVFP4."""
    exclude = modelopt_exclude(modules, names)
    producer = {"name": "kconvert", "version": __version__}
    # ModelOpt's "NVFP4" is W4A4 (engines read input_scale); weight-only NVFP4 is
    # "W4A16_NVFP4" (ModelOpt PR #1313, vLLM PR #41769), which needs no input scales.
    w4a4 = any(m.has_input_scale for m in modules)
    quant = {"quant_algo": "NVFP4" if w4a4 else "W4A16_NVFP4", "kv_cache_quant_algo": None,
             "group_size": 16, "exclude_modules": exclude}
    return (
        {"quant_method": "modelopt", **quant, "producer": producer},
        {"producer": producer, "quantization": quant},
    )


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
