"""The one place that knows how Kimi-K2 / DeepSeek-V3 and Kimi-K3 tensor names are spelled.

Every name is parsed into a `TensorName`: its role (routed expert, router bias, vision, ...),
the decoder layer and expert id where there is one, the module path and the parameter suffix.
Names this module does not recognise get the role OTHER and pass through untouched.

Kimi-K3 (docs/kimi.md "Kimi-K3") spells its MoE block `block_sparse_moe` and its routed
experts `experts.E.w1|w2|w3` (gate, down, up); its latent projections, AttnRes tensors and
KDA attention have roles of their own. KDA and MLA layers both hold a `self_attn.g_proj`: the
name cannot tell them apart, the config's layer lists do (kconvert.model.arch).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from enum import StrEnum


class Role(StrEnum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    DENSE_MLP = "dense_mlp"
    ROUTER_WEIGHT = "router_weight"
    ROUTER_BIAS = "router_bias"
    ATTENTION = "attention"
    NORM = "norm"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    VISION = "vision"
    PROJECTOR = "projector"
    # Kimi-K3: routed_expert_down_proj / routed_expert_up_proj (hidden <-> the experts'
    # latent) and routed_expert_norm; the AttnRes residual tensors (*_res_norm, *_res_proj,
    # output_attn_res_*).
    LATENT = "latent_projection"
    ATTN_RES = "attn_res"
    # What only a DeepSeek-V3 multi-token-prediction layer (num_nextn_predict_layers) holds
    # besides a decoder layer: its embedding copy, enorm, hnorm, eh_proj and shared_head (norm,
    # head). vLLM's deepseek_mtp.py and SGLang's deepseek_nextn.py build them as a plain
    # nn.Linear, embedding and lm head that no quantization config reaches: never quantized,
    # never a config's "Linear" (docs/mtp.md).
    MTP = "mtp"
    OTHER = "other"


# Parameter suffixes of a quantized or dense linear (no dots in any). A name whose last
# component is one of these splits into module + param. A format's codec adds its own when it
# is registered (kconvert.formats.register).
PARAM_SUFFIXES = {
    "weight_global_scale",
    "input_global_scale",
    "weight_sparse_packed",
    "weight_sparse_mask",
    "weight_zero_point",
    "weight_scale_inv",
    "weight_scale_2",
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "input_scale",
    "weight",
    "bias",
}


def register_param_suffixes(suffixes: tuple[str, ...]) -> None:
    """Parameter suffixes of a newly registered format (no dots in any)."""
    if any("." in s for s in suffixes):
        raise ValueError(f"a parameter suffix holds no dot: {suffixes}")
    PARAM_SUFFIXES.update(suffixes)

# What each projection of an MLP is, whatever the spelling (Kimi-K3's experts: w1 gate, w3 up,
# w2 down).
MLP_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
            "w1": "gate", "w3": "up", "w2": "down"}

# Targets a user can name in --targets, mapped to the roles they select.
TARGET_ROLES: dict[str, Role] = {
    "experts": Role.ROUTED_EXPERT,
    "shared_experts": Role.SHARED_EXPERT,
    "dense_mlp": Role.DENSE_MLP,
    "attention": Role.ATTENTION,
}

_LAYER = re.compile(
    r"^(?P<prefix>language_model\.model\.|language_model\.|model\.)layers\.(?P<layer>\d+)\.(?P<rest>.+)$"
)
_MOE = r"(?:mlp|block_sparse_moe)"  # DeepSeek-V3's MoE block, Kimi-K3's
_EXPERT = re.compile(rf"^{_MOE}\.experts\.(?P<expert>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_SHARED = re.compile(rf"^{_MOE}\.shared_experts\.(?P<proj>gate_proj|up_proj|down_proj)$")
_DENSE = re.compile(r"^mlp\.(?P<proj>gate_proj|up_proj|down_proj)$")
_ROUTER = re.compile(rf"^{_MOE}\.gate$")
_LATENT = re.compile(r"^block_sparse_moe\.routed_expert_(?P<proj>down_proj|up_proj|norm)$")
_MTP = re.compile(r"^(?:embed_tokens|enorm|hnorm|eh_proj|shared_head\.(?:norm|head))$")
_ATTN_RES = re.compile(r"^(?P<proj>(?:self_attention|mlp|output_attn)_res_(?:norm|proj))$")
# KDA's names hold digits (q_conv1d) and capitals (A_log), and some have no parameter suffix.
_ATTN = re.compile(r"^self_attn\.(?P<proj>[A-Za-z0-9_]+)$")
_TOP = re.compile(r"^(?P<prefix>language_model\.model\.|language_model\.|model\.)(?P<rest>.+)$")


@dataclass(frozen=True, slots=True)
class TensorName:
    """A parsed tensor name. `module` + "." + `param` == `name` whenever `param` is set."""

    name: str
    role: Role
    prefix: str = ""
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None
    module: str = ""
    param: str = ""

    @property
    def part(self) -> str | None:
        """"gate", "up" or "down" for an MLP's projection (routed, shared or dense), else
        None."""
        if self.role in (Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.DENSE_MLP):
            return MLP_PART.get(self.proj or "")
        return None

    @property
    def fused_set(self) -> str:
        """Name of the group of linears that must share one NVFP4 global scale.

        Serving engines fuse gate_proj and up_proj (K3: w1 and w3) into one GEMM with ONE
        global scale (formats.md §2), and likewise q_a_proj with kv_a_proj_with_mqa; every
        other linear is its own set.
        """
        if self.part in ("gate", "up"):
            return self.module.rsplit(".", 1)[0] + (
                ".w13" if self.proj in ("w1", "w3") else ".gate_up_proj")
        if self.role is Role.ATTENTION and self.proj in ("q_a_proj", "kv_a_proj_with_mqa"):
            return self.module.rsplit(".", 1)[0] + ".q_a_kv_a_proj"
        return self.module

    def with_expert(self, expert: int) -> TensorName:
        """The same parameter of another expert id (used when experts are renumbered)."""
        assert self.role is Role.ROUTED_EXPERT and self.layer is not None
        module = self.module.replace(f".experts.{self.expert}.", f".experts.{expert}.", 1)
        return replace(self, name=f"{module}.{self.param}", expert=expert, module=module)


def split_param(name: str) -> tuple[str, str]:
    """('a.b.weight_scale_2') -> ('a.b', 'weight_scale_2'); unknown suffix -> (name, '').

    A suffix holds no dot, so it is the name's last component or nothing: one split and one
    lookup per name (a full-size checkpoint has 208,215; trying every suffix was a third of
    parse_name's time)."""
    module, dot, last = name.rpartition(".")
    if dot and (last in PARAM_SUFFIXES or last == "e_score_correction_bias"):
        return module, last
    return name, ""


@functools.cache
def parse_name(name: str) -> TensorName:
    # Kept per name (a TensorName is immutable): a full-size checkpoint's plan asks for its
    # 208,215 names about four times each (docs/performance.md, planning a full-size Kimi).
    module, param = split_param(name)
    if name.startswith("vision_tower."):
        return TensorName(name, Role.VISION, module=module, param=param)
    if name.startswith("mm_projector."):
        return TensorName(name, Role.PROJECTOR, module=module, param=param)
    if name.startswith(("lm_head.", "language_model.lm_head.")):
        return TensorName(name, Role.LM_HEAD, module=module, param=param)

    m = _LAYER.match(module if param else name)
    if m is None:
        top = _TOP.match(name)
        if top is None:
            return TensorName(name, Role.OTHER, module=module, param=param)
        rest = top["rest"]
        role = (Role.EMBEDDING if rest.startswith("embed_tokens.") else
                Role.NORM if rest.startswith("norm.") else
                Role.ATTN_RES if rest.startswith("output_attn_res_") else Role.OTHER)
        return TensorName(name, role, top["prefix"], module=module, param=param)

    prefix, layer, rest = m["prefix"], int(m["layer"]), m["rest"]
    role, expert, proj = Role.OTHER, None, None
    if (e := _EXPERT.match(rest)) is not None:
        role, expert, proj = Role.ROUTED_EXPERT, int(e["expert"]), e["proj"]
    elif (sh := _SHARED.match(rest)) is not None:
        role, proj = Role.SHARED_EXPERT, sh["proj"]
    elif (d := _DENSE.match(rest)) is not None:
        role, proj = Role.DENSE_MLP, d["proj"]
    elif _ROUTER.match(rest) is not None:
        role = Role.ROUTER_BIAS if param == "e_score_correction_bias" else Role.ROUTER_WEIGHT
    elif (lat := _LATENT.match(rest)) is not None:
        role, proj = Role.LATENT, lat["proj"]
    elif (res := _ATTN_RES.match(rest)) is not None:
        role, proj = Role.ATTN_RES, res["proj"]
    elif _MTP.match(rest) is not None:
        role, proj = Role.MTP, rest
    elif rest.endswith("layernorm"):
        role = Role.NORM
    elif (a := _ATTN.match(rest)) is not None:
        role, proj = Role.ATTENTION, a["proj"]
    return TensorName(name, role, prefix, layer, expert, proj, module, param)


LANGUAGE_MODEL_PREFIX = "language_model."


def language_model_name(name: str) -> str | None:
    """A K2.5/K2.6 wrapper's module name as its language model names it, or None for a module
    outside the language model (vision tower, projector).

    Loaders build the language model from `text_config` and apply `text_config`'s
    quantization_config to it with module names that lack the wrapper's `language_model.`
    prefix (`lm_head` covers `language_model.lm_head`); the vision tower and the projector are
    built outside it (docs/kimi.md, K2.5 / K2.6 wrapper)."""
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return name[len(LANGUAGE_MODEL_PREFIX):]
    return None
