"""The one check of a text config's values, shared by every command and the audit (through
kconvert.io.checkpoint.load_config): each key kconvert or a loader reads has the type and range
the modeling code needs, so a malformed config.json is refused in one line naming the key and
its value, before any work (a string where an integer belongs would otherwise be copied into an
output, or fail deep inside a forward as a traceback).

The keys are those of each family (kconvert.model.arch): DeepSeek-V3's for Kimi-K2/K2.5/K2.6,
Kimi-Linear's for Kimi-K3 (docs/kimi.md). Keys kconvert does not read are left as they are.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

from kconvert.model.arch import KIMI_K3, arch_of

# Integers only (JSON 16.0, "16" and true are refused: transformers' modules would build a
# float-sized or string-sized layer, or fail with a traceback).
Positive = Annotated[StrictInt, Field(gt=0)]
NonNegative = Annotated[StrictInt, Field(ge=0)]
Number = Annotated[StrictInt | StrictFloat, Field(gt=0)]


class TextConfig(BaseModel):
    """The keys both families spell alike."""

    model_config = ConfigDict(extra="allow")

    hidden_size: Positive
    num_hidden_layers: Positive
    vocab_size: Positive
    num_attention_heads: Positive
    intermediate_size: Positive | None = None
    moe_intermediate_size: Positive | None = None
    first_k_dense_replace: NonNegative = 0
    num_nextn_predict_layers: NonNegative = 0
    routed_scaling_factor: Number | None = None
    topk_group: Positive | None = None
    max_position_embeddings: Positive | None = None
    q_lora_rank: Positive | None = None
    kv_lora_rank: Positive | None = None
    qk_nope_head_dim: Positive | None = None
    qk_rope_head_dim: Positive | None = None
    v_head_dim: Positive | None = None
    rope_scaling: dict | None = None


class DeepSeekV3Config(TextConfig):
    n_routed_experts: Positive
    num_experts_per_tok: Positive
    n_shared_experts: NonNegative | None = None
    n_group: Positive | None = None


class KimiK3Config(TextConfig):
    num_experts: Positive
    num_experts_per_token: Positive
    num_shared_experts: NonNegative | None = None
    num_expert_group: Positive | None = None
    routed_expert_hidden_size: Positive | None = None


def text_config_problem(text: dict) -> str | None:
    """Why the text config `text` cannot be read as its family's, or None: the first bad key
    with its value and what it must be; then the relations between keys (top-k within the
    experts, the selected groups within the groups)."""
    arch = arch_of(text)
    model = KimiK3Config if arch.family == KIMI_K3 else DeepSeekV3Config
    try:
        model.model_validate(text)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "missing":
            return f"config.json has no {key} (the {arch.family} modeling code needs it)"
        return (f"config.json's {key} is {err.get('input')!r}: "
                f"{err['msg'][0].lower()}{err['msg'][1:]}")
    experts, top_k = arch.get("experts"), arch.get("top_k")
    if top_k > experts:
        return (f"config.json's {arch.top_k_key} {top_k} is more than its {arch.experts_key} "
                f"{experts}: a token cannot be routed to more experts than a layer has")
    groups, top_groups = arch.get("groups"), text.get("topk_group")
    if groups is not None and top_groups is not None and top_groups > groups:
        return (f"config.json's topk_group {top_groups} is more than its {arch.groups_key} "
                f"{groups}")
    if groups is not None and experts % groups:
        return (f"config.json's {arch.experts_key} {experts} does not split into its "
                f"{arch.groups_key} {groups} expert groups")
    return None


# The keys text_config_problem judges (either family): other checks leave their findings to it.
CHECKED_KEYS = frozenset(DeepSeekV3Config.model_fields) | frozenset(KimiK3Config.model_fields)
