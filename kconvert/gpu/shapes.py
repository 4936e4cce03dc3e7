"""A model's shapes as the GPU memory plan sees them (kconvert.gpu.plan): the sizes it reads
from the model config (DeepSeek-V3 / Kimi-K2 / Kimi-K3 key names) and the element counts of a
decoder layer's parts derived from them."""

from __future__ import annotations

from dataclasses import dataclass

from kconvert.model.arch import arch_of


@dataclass(frozen=True)
class Shapes:
    """What the plan needs of the model config (DeepSeek-V3 / Kimi-K2 text config)."""

    hidden: int
    moe_inter: int
    dense_inter: int
    experts: int
    shared: int
    top_k: int
    heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    vocab: int
    dense_layers: int
    layers: int

    @classmethod
    def from_config(cls, text: dict) -> Shapes:
        arch = arch_of(text)  # DeepSeek-V3's or Kimi-K3's key names
        return cls(hidden=text["hidden_size"], moe_inter=text.get("moe_intermediate_size") or 0,
                   dense_inter=text["intermediate_size"],
                   experts=arch.get("experts") or 0,
                   shared=arch.get("shared") or 0,
                   top_k=arch.get("top_k") or 0,
                   heads=text["num_attention_heads"],
                   q_lora=text.get("q_lora_rank") or 0, kv_lora=text["kv_lora_rank"],
                   qk_nope=text["qk_nope_head_dim"], qk_rope=text["qk_rope_head_dim"],
                   v_head=text["v_head_dim"], vocab=text["vocab_size"],
                   dense_layers=min(text.get("first_k_dense_replace", 0),
                                    text["num_hidden_layers"]),
                   layers=text["num_hidden_layers"])

    @property
    def qk(self) -> int:
        return self.qk_nope + self.qk_rope

    def attention_elems(self) -> int:
        h, q_in = self.hidden, self.q_lora or self.hidden
        return (h * self.q_lora + q_in * self.heads * self.qk
                + h * (self.kv_lora + self.qk_rope)
                + self.kv_lora * self.heads * (self.qk_nope + self.v_head)
                + self.heads * self.v_head * h)

    def attention_inputs(self) -> list[int]:
        """Input widths of an MLA attention's fused sets (linears that see one input): q_a
        with kv_a (or q_proj, and kv_a alone), q_b, kv_b, o."""
        q = [self.hidden] if self.q_lora else [self.hidden, self.hidden]
        return [*q, *([self.q_lora] if self.q_lora else []), self.kv_lora,
                self.heads * self.v_head]

    def attention_matrices(self) -> list[tuple[int, int]]:
        """(rows, in) of an MLA attention's linears."""
        q_in = self.q_lora or self.hidden
        return [*([(self.q_lora, self.hidden)] if self.q_lora else []),
                (self.heads * self.qk, q_in), (self.kv_lora + self.qk_rope, self.hidden),
                (self.heads * (self.qk_nope + self.v_head), self.kv_lora),
                (self.hidden, self.heads * self.v_head)]

    def dense_inputs(self) -> list[int]:
        """Input widths of a dense MLP's fused sets: gate with up, down."""
        return [self.hidden, self.dense_inter]

    def dense_matrices(self) -> list[tuple[int, int]]:
        """(rows, in) of a dense MLP's matrices: gate and up as one (one input), down."""
        return [(2 * self.dense_inter, self.hidden), (self.hidden, self.dense_inter)]

    def expert_elems(self) -> int:
        """gate, up and down of one routed expert."""
        return 3 * self.hidden * self.moe_inter

    @property
    def has_moe(self) -> bool:
        return self.experts > 0 and self.layers > self.dense_layers

    def expert_set(self) -> int:
        """Decoded elements of a routed expert's gate and up (one fused set)."""
        return 2 * self.hidden * self.moe_inter

    def layer_elems(self, routed: int | None = None) -> int:
        """Decoded weight elements of the largest decoder layer (an MoE layer when there is
        one: routed and shared experts, router, attention); `routed`: the routed experts held
        (an expert-parallel rank's share; default all)."""
        dense = 3 * self.hidden * self.dense_inter
        routed = self.experts if routed is None else routed
        moe = ((routed + self.shared) * self.expert_elems()
               + self.experts * self.hidden)
        if not self.has_moe:
            return self.attention_elems() + dense
        # the first layers are dense: the largest layer is whichever holds more
        return self.attention_elems() + max(moe, dense if self.dense_layers else 0)
