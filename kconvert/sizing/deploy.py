"""How a checkpoint's bytes spread over GPUs, and how much MLA KV cache fits beside them.

The split follows how vLLM and SGLang place a DeepSeek-V3 model, idealised (no padding, no
runtime buffers):
- pipeline parallel (PP): decoder layers in contiguous, near-equal runs, one per stage (the
  first `layers % pp` stages take one more); embeddings, vision tower and projector on the
  first stage, final norm, lm_head and MTP layers on the last;
- tensor parallel (TP) within a stage: attention's q_b/kv_b/o projections, shared experts,
  the dense MLP, embeddings and lm_head split TP ways; q_a_proj and kv_a_proj_with_mqa (MLA's
  latent projections), router, norms, vision and projector replicated on every GPU;
- expert parallel (EP, a divisor of TP): each EP rank holds ceil(experts / EP) whole routed
  experts of every layer, each split TP / EP ways.
The MLA KV cache stores per token and layer the compressed latent and the rope key,
kv_lora_rank + qk_rope_head_dim values (docs/kimi.md), replicated on every TP rank of the
stage that runs the layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kconvert.errors import KconvertError
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, TensorName

KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
GIB = 1 << 30
REPLICATED_ROLES = {Role.ROUTER_WEIGHT, Role.ROUTER_BIAS, Role.NORM, Role.VISION,
                    Role.PROJECTOR, Role.OTHER, Role.ATTN_RES, Role.LATENT, Role.MTP}
REPLICATED_ATTENTION = {"q_a_proj", "kv_a_proj_with_mqa"}
FIRST_STAGE_ROLES = {Role.EMBEDDING, Role.VISION, Role.PROJECTOR}


@dataclass(frozen=True)
class Parallelism:
    gpus: int
    tp: int
    ep: int
    pp: int

    @classmethod
    def resolve(cls, gpus: int | None, tp: int | None, ep: int | None,
                pp: int | None) -> Parallelism:
        """Fill in what was not given: TP = GPUs / PP, GPUs = TP x PP, EP = 1; refuse a
        split that does not add up."""
        for name, value in (("gpus", gpus), ("tp", tp), ("ep", ep), ("pp", pp)):
            if value is not None and value < 1:
                raise KconvertError(f"--{name} must be at least 1, not {value}")
        pp = pp or 1
        if tp is None:
            tp = (gpus or pp) // pp
            if tp * pp != (gpus or pp):
                raise KconvertError(f"--gpus {gpus} is not a multiple of --pp {pp}")
        gpus = gpus or tp * pp
        if tp * pp != gpus:
            raise KconvertError(f"--tp {tp} x --pp {pp} = {tp * pp} GPUs, but --gpus is {gpus}")
        ep = ep or 1
        if tp % ep:
            raise KconvertError(f"--ep {ep} must divide --tp {tp} (expert parallel ranks "
                                "split the tensor-parallel group of a stage)")
        return cls(gpus, tp, ep, pp)


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The decoder layers each pipeline stage runs."""
    if pp > num_layers:
        raise KconvertError(f"--pp {pp} is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def per_gpu_bytes(tensors: Iterable[tuple[TensorName, int]], num_layers: int,
                  par: Parallelism) -> list[int]:
    """Bytes on one GPU of each pipeline stage (the busiest GPU where shares are uneven)."""
    stages = stage_layers(num_layers, par.pp)
    stage_of = {layer: s for s, run in enumerate(stages) for layer in run}
    per_stage = [0] * par.pp
    routed: dict[int, int] = {}  # layer -> routed expert bytes
    expert_ids: dict[int, set[int]] = {}
    for tn, nbytes in tensors:
        if tn.role is Role.ROUTED_EXPERT:
            routed[tn.layer] = routed.get(tn.layer, 0) + nbytes
            expert_ids.setdefault(tn.layer, set()).add(tn.expert)
            continue
        if tn.layer is not None:
            stage = stage_of.get(tn.layer, par.pp - 1)  # MTP layers follow the last layer
        else:
            stage = 0 if tn.role in FIRST_STAGE_ROLES else par.pp - 1
        replicated = tn.role in REPLICATED_ROLES or (
            tn.role is Role.ATTENTION and tn.proj in REPLICATED_ATTENTION)
        per_stage[stage] += nbytes if replicated else math.ceil(nbytes / par.tp)
    for layer, nbytes in routed.items():
        n = len(expert_ids[layer])
        held = math.ceil(n / par.ep)  # whole experts on the busiest EP rank
        share = math.ceil(nbytes * held / n / (par.tp // par.ep))
        per_stage[stage_of.get(layer, par.pp - 1)] += share
    return per_stage


def kv_bytes_per_token_layer(text_config: dict, kv_dtype: str) -> int:
    """MLA's cache per token and layer: (kv_lora_rank + qk_rope_head_dim) x element size."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise KconvertError(f"unknown KV-cache dtype {kv_dtype!r}; choose from "
                            f"{sorted(KV_DTYPE_BYTES)}")
    missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim") if k not in text_config]
    if missing:
        raise KconvertError(f"config has no {', '.join(missing)}: not an MLA model, so its "
                            "KV cache is not sized here", file="config.json")
    width = text_config["kv_lora_rank"] + text_config["qk_rope_head_dim"]
    return width * KV_DTYPE_BYTES[kv_dtype]


def kv_layers_per_stage(text_config: dict, num_layers: int, pp: int) -> list[int]:
    """Per pipeline stage, its layers that hold a per-token KV cache: every layer of an MLA
    model; Kimi-K3's MLA layers only (its KDA layers keep a fixed-size state instead)."""
    arch = arch_of(text_config)
    return [sum(arch.attention(layer) == "mla" for layer in run)
            for run in stage_layers(num_layers, pp)]


def max_context_tokens(weights_per_gpu: list[int], kv_layers: list[int],
                       kv_per_token_layer: int, gpu_mem_bytes: int) -> int:
    """Longest context (tokens of KV cache) that fits beside the weights on every stage's
    GPUs (`kv_layers`: each stage's layers holding a KV cache); 0 when the weights alone do
    not fit."""
    fits = []
    for weights, layers in zip(weights_per_gpu, kv_layers, strict=True):
        free = gpu_mem_bytes - weights
        per_token = kv_per_token_layer * layers
        fits.append(max(free, 0) // per_token if per_token else 0)
    return min(fits)
