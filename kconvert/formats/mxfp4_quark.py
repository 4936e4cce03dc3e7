"""MXFP4 as AMD Quark exports it (docs/formats.md §6a; amd/Kimi-K2.5-MXFP4's layout): `weight`
uint8 [out, in/2] and `weight_scale` uint8 [out, in/32] (E8M0), and its quantization_config
(quant_method "quark").

The config block is written by kconvert itself, in the shape Quark 0.13's file-to-file
export writes it (quark.torch.quantization.file2file_quantization; a test holds the two
equal), so the output's bytes do not depend on whether Quark is installed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from kconvert.formats import mxfp4
from kconvert.formats.base import Codec, OutputModule
from kconvert.formats.dense import DenseCodec
from kconvert.formats.mxfp4_ct import Mxfp4Codec

QUANT_METHOD = "quark"  # the config family's quant_method
QUARK_VERSION = "0.13"  # the Quark export whose config layout this follows
# Quark's OCP_MXFP4Spec as its export serialises it (weights; activations the same, dynamic).
MXFP4_SPEC = {
    "dtype": "fp4", "is_dynamic": False, "qscheme": "per_group", "ch_axis": -1,
    "group_size": mxfp4.BLOCK, "block_size": None, "symmetric": None,
    "round_method": "half_even", "scale_type": "float", "zero_point_type": "int32",
    "scale_format": "e8m0", "scale_calculation_mode": "even", "mx_element_dtype": None,
    "observer_cls": "PerBlockMXObserver", "is_scale_quant": False,
    "enable_buffer_reuse": False, "max_input_numel": 4194304,
}
# What a config's weight spec must say for kconvert to read its tensors as MXFP4.
SPEC_KEYS = ("dtype", "qscheme", "group_size", "scale_format")
# What an input_tensors spec must say for `kconvert eval` to run it as MXFP4Scheme's dynamic
# activation quantization (the arithmetic of kconvert.formats.mxfp4.fake_quantize).
DYNAMIC_INPUT = {**{k: MXFP4_SPEC[k] for k in (*SPEC_KEYS, "ch_axis", "round_method",
                                                "scale_calculation_mode")},
                 "is_dynamic": True}


class QuarkMxfp4Codec(Mxfp4Codec):
    """AMD Quark's MXFP4 export (formats.md §6a)."""

    name = "mxfp4-quark"
    params = ("weight", "weight_scale")
    description = "MXFP4 (Quark)"
    ct_format = None
    ct_presets = None
    quant_method = QUANT_METHOD
    config_family = QUANT_METHOD
    cli_name = "quark-mxfp4"
    flavour = mxfp4.QUARK
    dynamic_activations = True  # W4A4, as amd/Kimi-K2.5-MXFP4 ships
    quantizes_routers = True

    @classmethod
    def scheme_problems(cls, where, scheme, m):
        weight = module_config(scheme, m.tn.module).get("weight") or {}
        return [f"{where} says weight {k} = {weight.get(k)!r}, the tensors are MXFP4 "
                f"({MXFP4_SPEC[k]!r})" for k in SPEC_KEYS if weight.get(k) != MXFP4_SPEC[k]]

    @classmethod
    def write_config(cls, modules, names):
        return quark_config(modules, names)

    @classmethod
    def declares_dynamic_input(cls, qconfig, name):
        if excluded(qconfig, name):
            return False
        return mxfp4.declared_dynamic(name, module_config(qconfig, name).get("input_tensors"),
                                      DYNAMIC_INPUT, "input_tensors")


def module_config(qconfig: dict, name: str) -> dict:
    """The quant config Quark applies to module `name`: the first `layer_quant_config` entry
    whose fnmatch pattern matches it, else `global_quant_config`."""
    for pattern, layer in (qconfig.get("layer_quant_config") or {}).items():
        if fnmatch.fnmatch(name, pattern):
            return layer or {}
    return qconfig.get("global_quant_config") or {}


def excluded(qconfig: dict, name: str) -> bool:
    """Whether Quark's `exclude` list (exact names or fnmatch patterns) names module `name`."""
    return any(fnmatch.fnmatch(name, p) for p in qconfig.get("exclude") or [])


def quark_expected(qconfig: dict, name: str, linear: bool
                   ) -> tuple[str, type[Codec] | None, dict]:
    """(kind, codec, scheme) a Quark config gives module `name` (as
    kconvert.checks.quant_config.expected_format): unquantized where its `exclude` list (exact
    names or fnmatch patterns, as Quark matches them) names it or it is no linear, else MXFP4."""
    if not linear or excluded(qconfig, name):
        return QUANT_METHOD, DenseCodec, {}
    return QUANT_METHOD, QuarkMxfp4Codec, qconfig


def _quark_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """What Quark's file-to-file export takes for a linear's weight: `<module>.weight` of two
    or more dims, the module not a norm and not an embedding."""
    module, _, param = name.rpartition(".")
    return (param == "weight" and len(shape) >= 2 and not module.endswith("norm")
            and "embed" not in module)


def quark_config(modules: list[OutputModule], shapes: Mapping[str, tuple[int, ...]]
                 ) -> tuple[dict, dict[str, dict]]:
    """(config.json's quantization_config, no added file) for an output whose MXFP4 modules
    are in Quark's layout (a kconvert.formats.quant_config.ConfigWriter); `shapes`: every output
    tensor's shape by name. Every other linear weight of the output is listed in `exclude` by
    its exact name, as Quark's export resolves it."""
    mx = {m.out_module for m in modules if (m.out_codec or m.codec) is QuarkMxfp4Codec}
    dynamic = any(m.dynamic_activations for m in modules if m.out_module in mx)
    exclude = sorted({n.rpartition(".")[0] for n, shape in shapes.items()
                      if _quark_linear_weight(n, shape) and n.rpartition(".")[0] not in mx})
    return {
        "global_quant_config": {
            "input_tensors": {**MXFP4_SPEC, "is_dynamic": True} if dynamic else None,
            "output_tensors": None, "weight": dict(MXFP4_SPEC), "bias": None,
            "target_device": None},
        "exclude": exclude,
        "algo_config": None,
        "softmax_quant_spec": None,
        "quant_method": QUANT_METHOD,
        "layer_type_quant_config": {},
        "layer_quant_config": {},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "quant_mode": "eager_mode",
        "version": QUARK_VERSION,
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }, {}
