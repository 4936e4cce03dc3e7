"""compressed-tensors' quantization_config (docs/formats.md §1, §3a): how it names the
formats and modules it covers, the scheme checks its formats share, and the block kconvert
writes for an NVFP4 or MXFP4 output.

The block is built with compressed-tensors' own pydantic models, laid out as its
ModelCompressor writes it.
"""

from __future__ import annotations

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


def compressed_tensors_config(modules: list[OutputModule], has_vision: bool) -> dict:
    """The output format's W4A16 preset (NVFP4A16, MXFP4A16), or its W4A4 one when
    calibrated input scales were written or activations are quantized at run time (MXFP4);
    one config group per group size (32 is p48's sparse-kernel form, see docs/commands.md); each
    format in the output adds what it needs (`edit_config`)."""
    # Imported here: compressed-tensors takes seconds to import (it loads transformers), and
    # only runs that write its config need it.
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    w4a4 = any(m.has_input_scale or m.dynamic_activations for m in modules)
    codecs = {m.out_codec or m.codec for m in modules}
    quantized = [m for m in modules if (m.out_codec or m.codec).config_family == QUANT_METHOD]
    written = next(c for c in codecs if c.config_family == QUANT_METHOD and c.ct_presets)
    groups = {}
    for i, (group_size, roles) in enumerate(_roles_by_group(modules).items()):
        targets = [t for r in roles for t in ct_targets(r, quantized)]
        scheme = preset_name_to_scheme(written.ct_presets[w4a4], targets)
        scheme.weights.group_size = group_size
        scheme.format = written.ct_format
        groups[f"group_{i}"] = scheme
    ignore = ["lm_head"] + (["re:vision_tower.*", "re:mm_projector.*"] if has_vision else [])
    qc = QuantizationConfig(
        config_groups=groups,
        format=written.ct_format,
        quantization_status="compressed",
        ignore=ignore,
    )
    # The same layout as compressed-tensors' ModelCompressor.update_config, minus the empty
    # sparsity/transform blocks (vLLM refuses some sparsity_config forms: docs/p48.md).
    qconfig = {
        "version": compressed_tensors.__version__,
        "quant_method": QUANT_METHOD,
        **qc.model_dump(mode="json", exclude={"quant_method"}),
    }
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
