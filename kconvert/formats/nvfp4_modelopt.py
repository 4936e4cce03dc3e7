"""ModelOpt's HF export of NVFP4 (docs/formats.md §3b): the compressed-tensors bytes with a
reciprocal scalar global scale, its config block and hf_quant_config.json."""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from kconvert.errors import KconvertError
from kconvert.formats import nvfp4
from kconvert.formats.base import INPUT_SCALE_POLICY, Encoded, OutputModule, input_scale_policy
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.model.names import Role, language_model_name, parse_name
from kconvert.version import __version__

HF_QUANT_CONFIG = "hf_quant_config.json"
QUANT_METHOD = "modelopt"  # the config family's quant_method


class ModeloptNvfp4Codec(Nvfp4Codec):
    """ModelOpt's HF export of NVFP4 (formats.md §3b): same bytes, reciprocal scalar scale."""

    name = "nvfp4-modelopt"
    params = ("weight", "weight_scale", "weight_scale_2")
    weight_dtypes = frozenset({"U8"})
    packed_param = "weight"
    description = "NVFP4 (ModelOpt)"
    global_scale_param = "weight_scale_2"
    input_scale_param = "input_scale"
    ct_format = None
    # Plain NVFP4 is W4A4 (a static input_scale per module expected); the weight-only export
    # is spelled W4A16_NVFP4 (vLLM #41769; older ModelOpt code NVFP4_W4A16).
    modelopt_algos: ClassVar[dict[str, str]] = {
        "NVFP4": "w4a4", "W4A16_NVFP4": "w4a16", "NVFP4_W4A16": "w4a16"}
    config_family = QUANT_METHOD
    cli_name = "modelopt"
    arithmetic = "modelopt"
    sparse_forms = frozenset({(16, "dense")})
    scale_shape = None  # ModelOpt's exports store scalars, other tools [1]

    @classmethod
    def scheme_problems(cls, where, scheme, m):
        group_size = modelopt_view(scheme)["group_size"] or nvfp4.BLOCK
        if group_size == nvfp4.BLOCK:
            return []
        return [f"{where} group_size {group_size}, ModelOpt NVFP4 uses {nvfp4.BLOCK}"]

    @classmethod
    def write_config(cls, modules, names):
        qconfig, hf_quant = modelopt_config(modules, list(names))
        return qconfig, {HF_QUANT_CONFIG: hf_quant}

    @classmethod
    def decode(cls, t, shape):
        return nvfp4.dequantize(t["weight"], t["weight_scale"], t["weight_scale_2"],
                                cls.arithmetic)

    @classmethod
    def unpack(cls, t):
        raise NotImplementedError("ModelOpt's reciprocal scale does not re-layout losslessly")

    @classmethod
    def specs(cls, shape, input_scale=False, group_size=nvfp4.BLOCK):
        if group_size != nvfp4.BLOCK:
            raise KconvertError(f"ModelOpt NVFP4 has block size {nvfp4.BLOCK}, not {group_size}")
        out, inp = shape
        specs = [
            ("weight", "U8", (out, inp // 2)),
            ("weight_scale", "F8_E4M3", (out, inp // nvfp4.BLOCK)),
            ("weight_scale_2", "F32", ()),
        ]
        if input_scale:
            specs.append(("input_scale", "F32", ()))
        return specs

    @classmethod
    def stored(cls, q, amax):
        return Encoded({"weight": q.packed, "weight_scale": q.block_scales,
                        "weight_scale_2": q.global_scale},  # amax / 2688, ModelOpt's
                       q.err_sq, q.ref_sq,
                       nvfp4.recorded_scale(q.global_scale, amax, cls.arithmetic))

    @classmethod
    def input_scale(cls, input_amax):
        amax = torch.tensor(input_amax, dtype=torch.float32)
        return {"input_scale": amax / nvfp4.GLOBAL_NUMERATOR}  # fp32, as ModelOpt computes it


def excluded(qconfig: dict, name: str) -> bool:
    """Whether a ModelOpt config's excluded modules (wildcards) leave module `name`
    unquantized; config.json's block lists them as `ignore` (ModelOpt's own export), older
    writers as `exclude_modules`."""
    return any(_wildcard(p).fullmatch(name) or name.startswith(p + ".")
               for p in modelopt_view(qconfig)["exclude_modules"])


def modelopt_view(qconfig: dict) -> dict:
    """What a ModelOpt quantization config says, in hf_quant_config.json's terms, whether it is
    that file's `quantization` block, config.json's block as ModelOpt exports it
    (`config_block`), or config.json's block in the older flat spelling."""
    groups = qconfig.get("config_groups") or {}
    weights = next(iter(groups.values()), {}).get("weights") or {}
    return {"quant_algo": qconfig.get("quant_algo"),
            "group_size": qconfig.get("group_size", weights.get("group_size")),
            "exclude_modules": qconfig.get("exclude_modules", qconfig.get("ignore")) or [],
            "kv_cache_quant_algo": qconfig.get("kv_cache_quant_algo",
                                               qconfig.get("kv_cache_scheme"))}


def config_block(hf_quant: dict) -> dict:
    """config.json's quantization_config for an hf_quant_config.json, in the shape ModelOpt's
    own export writes it (modelopt.torch.export.convert_hf_config.convert_hf_quant_config_format,
    for the NVFP4 algorithms kconvert writes; a test holds the two equal). Written by kconvert
    itself rather than by ModelOpt, so the output's bytes do not depend on whether ModelOpt is
    installed."""
    quant = hf_quant["quantization"]
    weights = {"dynamic": False, "num_bits": 4, "type": "float",
               "group_size": quant.get("group_size", nvfp4.BLOCK)}
    group: dict = {"weights": weights, "targets": ["Linear"]}
    if quant["quant_algo"] == "NVFP4":  # W4A4: static input scales
        group = {"input_activations": dict(weights), **group}
    block: dict = {"config_groups": {"group_0": group},
                   "ignore": quant.get("exclude_modules") or [],
                   "quant_algo": quant["quant_algo"]}
    if quant.get("kv_cache_quant_algo"):
        block["kv_cache_scheme"] = quant["kv_cache_quant_algo"]
    if INPUT_SCALE_POLICY in quant:
        block[INPUT_SCALE_POLICY] = quant[INPUT_SCALE_POLICY]
    return {**block, "producer": hf_quant["producer"], "quant_method": QUANT_METHOD}


def _wildcard(pattern: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(p) for p in pattern.split("*")))


# Linears kconvert never quantizes: routers, and Kimi-K3's latent projections and AttnRes
# projections (with their norms, as ModelOpt's own K3 export lists them).
UNQUANTIZED_ROLES = (Role.ROUTER_WEIGHT, Role.LATENT, Role.ATTN_RES)


def modelopt_exclude(modules: list[OutputModule], names: list[str]) -> list[str]:
    """Wildcard patterns for every linear left unquantized (vLLM #45102: they carry no scales).
    A language model's patterns are also given without the wrapper's `language_model.` prefix:
    a config in `text_config` names its modules so (docs/kimi.md), as ModelOpt's K3 export
    spells them both ways."""
    excluded_modules = {m.out_module for m in modules
                        if not issubclass(m.out_codec or m.codec, ModeloptNvfp4Codec)}
    patterns = {re.sub(r"\.layers\.\d+\.", ".layers.*.", e) for e in excluded_modules}
    for name in names:
        tn = parse_name(name)
        if tn.role in UNQUANTIZED_ROLES and tn.param == "weight":
            patterns.add(re.sub(r"\.layers\.\d+\.", ".layers.*.", tn.module))
        elif name.startswith(("lm_head.", "language_model.lm_head.")):
            patterns.add(name.rsplit(".", 1)[0])
        elif name.startswith(("vision_tower.", "mm_projector.")):
            patterns.add(name.split(".", 1)[0] + "*")
    patterns |= {p for p in map(language_model_name, patterns) if p is not None}
    return sorted(patterns)


def modelopt_config(modules: list[OutputModule], names: list[str]) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) for ModelOpt NVFP4."""
    exclude = modelopt_exclude(modules, names)
    producer = {"name": "kconvert", "version": __version__}
    # ModelOpt's "NVFP4" is W4A4 (engines read input_scale); weight-only NVFP4 is
    # "W4A16_NVFP4" (ModelOpt PR #1313, vLLM PR #41769), which needs no input scales.
    w4a4 = any(m.has_input_scale for m in modules)
    quant = {"quant_algo": "NVFP4" if w4a4 else "W4A16_NVFP4", "kv_cache_quant_algo": None,
             "group_size": nvfp4.BLOCK, "exclude_modules": exclude}
    policy = input_scale_policy(modules)
    if policy is not None:
        quant[INPUT_SCALE_POLICY] = policy
    hf_quant = {"producer": producer, "quantization": quant}
    return config_block(hf_quant), hf_quant
