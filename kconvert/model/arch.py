"""The model families kconvert reads, and what each one's text config calls things.

Two families: the DeepSeek-V3 architecture of Kimi-K2, K2.5 and K2.6 (DeepSeek's key names:
n_routed_experts, num_experts_per_tok, n_shared_experts; MLA in every layer), and Kimi-K3
(text_config model_type "kimi_linear", Kimi-Linear's key names: num_experts,
num_experts_per_token, num_shared_experts; routed experts on a latent of
routed_expert_hidden_size; KDA linear attention in the layers `linear_attn_config.kda_layers`
lists, MLA in the rest; docs/kimi.md "Kimi-K3"). Everything that reads a config key that the
two families spell differently reads it here.
"""

from __future__ import annotations

from dataclasses import dataclass

DEEPSEEK_V3 = "deepseek_v3"
KIMI_K3 = "kimi_k3"


@dataclass(frozen=True)
class Arch:
    """A text config, read by its family's key names."""

    family: str
    text: dict

    @property
    def _keys(self) -> dict[str, str]:
        if self.family == KIMI_K3:
            return {"experts": "num_experts", "top_k": "num_experts_per_token",
                    "shared": "num_shared_experts", "groups": "num_expert_group"}
        return {"experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                "shared": "n_shared_experts", "groups": "n_group"}

    @property
    def experts_key(self) -> str:
        """The key of the routed experts per MoE layer (what pruning rewrites)."""
        return self._keys["experts"]

    @property
    def top_k_key(self) -> str:
        return self._keys["top_k"]

    @property
    def shared_key(self) -> str:
        return self._keys["shared"]

    @property
    def groups_key(self) -> str:
        """The key of the router's expert groups (group-limited top-k)."""
        return self._keys["groups"]

    def get(self, what: str, default: object = None) -> object:
        """The config's value for `what` ("experts", "top_k", "shared", "groups"), by the
        family's key."""
        return self.text.get(self._keys[what], default)

    @property
    def mtp_layers(self) -> range:
        """The multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers), stored
        after the decoder layers: num_hidden_layers .. num_hidden_layers + n - 1 (docs/mtp.md).
        Kimi-K3 has none."""
        first = self.text.get("num_hidden_layers")
        count = self.text.get("num_nextn_predict_layers") or 0
        if self.family == KIMI_K3 or not isinstance(first, int) or not isinstance(count, int):
            return range(0)
        return range(first, first + count)

    @property
    def expert_input(self) -> int | None:
        """A routed expert's input width: the hidden size, or K3's latent."""
        if self.family == KIMI_K3:
            return self.text.get("routed_expert_hidden_size")
        return self.text.get("hidden_size")

    @property
    def kda_layers(self) -> frozenset[int]:
        """0-based layers with KDA attention (the config's lists count from 1)."""
        lists = self.text.get("linear_attn_config") or {}
        return frozenset(i - 1 for i in lists.get("kda_layers") or ())

    def attention(self, layer: int) -> str:
        """"kda" or "mla": which attention layer `layer` (0-based) has."""
        return "kda" if layer in self.kda_layers else "mla"

    def unsupported_forward(self) -> str | None:
        """Why kconvert's layer-streamed forward (calibrate, eval, REAP's calibration, GPTQ,
        SparseGPT) cannot run this model, or None when it can."""
        if self.family == KIMI_K3:
            return ("not supported for this architecture yet: Kimi-K3 (kimi_linear) needs its "
                    "own modeling code (KDA linear attention, latent MoE, AttnRes); the "
                    "data-free commands (inspect, dequant, audit, quantize, mxfp4-to-nvfp4) "
                    "work on it")
        return None


def arch_of(text: dict) -> Arch:
    """The family of a text config (a K2.5/K2.6/K3 wrapper's `text_config`, else config.json)."""
    k3 = text.get("model_type") == "kimi_linear" or "linear_attn_config" in text or (
        "num_experts" in text and "n_routed_experts" not in text)
    return Arch(KIMI_K3 if k3 else DEEPSEEK_V3, text)
