"""compressed-tensors' quantization_config (docs/formats.md §1, §3a): how it names the
formats and modules it covers, the scheme checks its formats share, and the block kconvert
writes for an NVFP4 or MXFP4 output.

The block is laid out as compressed-tensors' ModelCompressor writes it, from its preset schemes
(CT_PRESETS: the dumps of its pydantic models, which tests/formats/test_ct_config.py holds equal
to the installed library's). compressed-tensors itself is not imported: it loads transformers,
torch._dynamo and scipy, seconds of a conversion process that uses none of them.
"""

from __future__ import annotations

import copy
import importlib.metadata
import re
from collections.abc import Iterable, Mapping

from kconvert.errors import KconvertError
from kconvert.formats.base import INPUT_SCALE_POLICY, Linear, OutputModule, input_scale_policy
from kconvert.model.names import Role

# compressed-tensors target regexes per role (vLLM matches them against module names): the
# first is DeepSeek-V3's spelling, the others Kimi-K3's (block_sparse_moe, experts w1/w2/w3;
# KDA's projections). A config lists those that name a module it quantizes (`ct_targets`).
CT_TARGETS = {
    Role.ROUTED_EXPERT: (r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$",
                         r"re:.*block_sparse_moe\.experts\.\d+\.(w1|w2|w3)$"),
    Role.SHARED_EXPERT: (r"re:.*mlp\.shared_experts\.(gate|up|down)_proj$",
                         r"re:.*block_sparse_moe\.shared_experts\.(gate|up|down)_proj$"),
    Role.DENSE_MLP: (r"re:.*mlp\.(gate|up|down)_proj$",),
    Role.ATTENTION: (r"re:.*self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$",
                     r"re:.*self_attn\.(q_proj|k_proj|v_proj|g_proj|f_a_proj|f_b_proj|b_proj)$"),
}
QUANT_METHOD = "compressed-tensors"  # the config family's quant_method

# compressed-tensors' preset schemes that kconvert writes (quant_scheme.PRESET_SCHEMES), as
# QuantizationScheme.model_dump(mode="json") lays them out, less `targets` and `format`.
_NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "symmetric": True,
               "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"}
_MXFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "group", "symmetric": True,
               "group_size": 32, "scale_dtype": "torch.uint8"}
CT_PRESETS: dict[str, dict] = {
    "NVFP4A16": {"weights": {**_NVFP4_ARGS, "dynamic": False}, "input_activations": None,
                 "output_activations": None},
    "NVFP4": {"weights": {**_NVFP4_ARGS, "dynamic": False},
              "input_activations": {**_NVFP4_ARGS, "dynamic": "local", "observer": "static_minmax"},
              "output_activations": None},
    "MXFP4A16": {"weights": {**_MXFP4_ARGS, "dynamic": False}, "input_activations": None,
                 "output_activations": None},
    "MXFP4": {"weights": {**_MXFP4_ARGS, "dynamic": False},
              "input_activations": {**_MXFP4_ARGS, "dynamic": True}, "output_activations": None},
}


def target_matches(name: str, target: str, linear: bool) -> bool:
    """compressed-tensors' matching: 're:' regex (re.match), exact name, or class 'Linear'."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or (target == "Linear" and linear)


def ct_targets(role: Role, modules: Iterable[Linear]) -> list[str]:
    """The target regexes of `role` that name one of `modules` (those of the role) at least."""
    names = [m.tn.module for m in modules if m.tn.role is role]
    return [t for t in CT_TARGETS[role] if any(target_matches(n, t, True) for n in names)]


def scheme_for(qconfig: dict, name: str, linear: bool) -> tuple[dict | None, str | None]:
    """(the config group covering module `name`, its format), or (None, None) when no group
    covers it or the ignore list excludes it (then it is unquantized)."""
    ignore = qconfig.get("ignore") or []
    for group in (qconfig.get("config_groups") or {}).values():
        if any(target_matches(name, t, linear) for t in group.get("targets") or []):
            if any(target_matches(name, t, linear) for t in ignore):
                return None, None
            return group, group.get("format") or qconfig.get("format")
    return None, None


def tensor_group(m: Linear) -> int | None:
    """Elements per scale of an INT4 / NVFP4 module, read off its weight_scale's shape."""
    scale = m.params.get("weight_scale")
    if scale is None or len(scale.shape) != 2 or len(m.shape) != 2 or not scale.shape[1]:
        return None
    group, rest = divmod(m.shape[1], scale.shape[1])
    return group if not rest else None


def weight_problems(where: str, scheme: dict, m: Linear, weight_type: str) -> list[str]:
    """The scheme's weights (bits, type, group size) against a 4-bit module's tensors."""
    weights = scheme.get("weights") or {}
    want = {"num_bits": 4, "type": weight_type, "group_size": tensor_group(m)}
    return [f"{where} says weights.{k} = {weights.get(k)!r}, the tensors are {v!r}"
            for k, v in want.items() if v is not None and weights.get(k) != v]


def _roles_by_group(modules: Iterable[OutputModule]) -> dict[int, list[Role]]:
    """Quantized roles of the output per scale group size (NVFP4's 16, or 32 for sparse
    kernels; MXFP4's 32)."""
    sizes: dict[Role, set[int]] = {}
    for m in modules:
        if (m.out_codec or m.codec).config_family == QUANT_METHOD:
            # a module copied as it is (pruning an MXFP4 source) has its stored scales' group
            stored = tensor_group(m) if m.out_codec is None else None
            sizes.setdefault(m.tn.role, set()).add(stored or m.group_size)
    mixed = [r.value for r, b in sizes.items() if len(b) > 1]
    if mixed:
        raise KconvertError(f"{mixed}: one role must use one NVFP4 block size")
    by_size: dict[int, list[Role]] = {}
    for role in CT_TARGETS:
        if role in sizes:
            by_size.setdefault(next(iter(sizes[role])), []).append(role)
    return dict(sorted(by_size.items()))


def config_block(preset: str, fmt: str, targets_by_group: Mapping[int, list[str]],
                 ignore: list[str]) -> dict:
    """compressed-tensors' quantization_config for scheme `preset` in format `fmt`: one config
    group per weight group size (its targets), as ModelCompressor writes a QuantizationConfig
    of preset_name_to_scheme(preset, targets) with weights.group_size and format set."""
    groups = {}
    for i, (group_size, targets) in enumerate(targets_by_group.items()):
        scheme = copy.deepcopy(CT_PRESETS[preset])
        scheme["weights"]["group_size"] = group_size
        groups[f"group_{i}"] = {"targets": list(targets), **scheme, "format": fmt}
    return {"version": importlib.metadata.version(QUANT_METHOD), "quant_method": QUANT_METHOD,
            "config_groups": groups, "format": fmt, "global_compression_ratio": None,
            "ignore": list(ignore), "kv_cache_scheme": None, "moe_sparsity_config": None,
            "quantization_status": "compressed"}


def compressed_tensors_config(modules: list[OutputModule], has_vision: bool) -> dict:
    """The output format's W4A16 preset (NVFP4A16, MXFP4A16), or its W4A4 one when
    calibrated input scales were written or activations are quantized at run time (MXFP4);
    one config group per group size (32 is p48's sparse-kernel form, see docs/commands.md); each
    format in the output adds what it needs (`edit_config`). The block has no sparsity or
    transform entry: vLLM refuses some sparsity_config forms (docs/p48.md)."""
    w4a4 = any(m.has_input_scale or m.dynamic_activations for m in modules)
    codecs = {m.out_codec or m.codec for m in modules}
    quantized = [m for m in modules if (m.out_codec or m.codec).config_family == QUANT_METHOD]
    written = next(c for c in codecs if c.config_family == QUANT_METHOD and c.ct_presets)
    targets = {group_size: [t for r in roles for t in ct_targets(r, quantized)]
               for group_size, roles in _roles_by_group(modules).items()}
    ignore = ["lm_head"] + (["re:vision_tower.*", "re:mm_projector.*"] if has_vision else [])
    qconfig = config_block(written.ct_presets[w4a4], written.ct_format, targets, ignore)
    for codec in codecs:
        codec.edit_config(qconfig)
    policy = input_scale_policy(modules)
    if policy is not None:
        qconfig[INPUT_SCALE_POLICY] = policy
    return qconfig


def write_config(modules: list[OutputModule], names: Mapping[str, tuple[int, ...]]
                 ) -> tuple[dict, dict[str, dict]]:
    """Codec.write_config of the compressed-tensors family (no files of its own)."""
    has_vision = any(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
    return compressed_tensors_config(modules, has_vision), {}
