"""The exact forward of one decoder layer, loaded from the checkpoint's tensors alone.

transformers' own `DeepseekV3DecoderLayer` (MLA attention with its YaRN rope, RMSNorms,
residuals, dense MLP) built from the checkpoint's text config read as "deepseek_v3", with our
MoE block: transformers' router and shared expert, and a routed-expert loop in which each
expert sees only its routed tokens while the calibration statistics accumulate.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from kconvert.calibrate.data import PAD_ID
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, parse_name
from kconvert.stages.base import ModuleWork, group_modules

PROJS = ("gate_proj", "up_proj", "down_proj")


# KV-cache quantization scales some exports carry: no effect on an unquantized forward.
KV_SCALES = {"k_scale", "v_scale"}


# Decoded fp32 elements per batch of routed experts while a layer's weights are loaded.
DECODE_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 24}


def model_config(ckpt: Checkpoint):
    """transformers' DeepseekV3Config from the checkpoint's text config ("kimi_k2" read as
    "deepseek_v3", the architecture it is), attention through SDPA."""
    from transformers import DeepseekV3Config

    text = copy.deepcopy(ckpt.text_config)
    for key in ("model_type", "quantization_config", "auto_map", "architectures"):
        text.pop(key, None)
    if text.get("scoring_func", "sigmoid") != "sigmoid" or text.get(
            "topk_method", "noaux_tc") != "noaux_tc":
        raise KconvertError(
            f"router {text.get('scoring_func')}/{text.get('topk_method')}: calibration "
            "implements DeepSeek-V3 routing (sigmoid, noaux_tc) only")
    if text.get("attention_bias"):
        raise KconvertError("attention_bias is not supported (no Kimi/DeepSeek-V3 has it)")
    cfg = DeepseekV3Config(**text)
    cfg._attn_implementation = "sdpa"
    return cfg


class _LinearStats:
    """Input amax and per-column sum of squares of one linear, accumulated on the device."""

    def __init__(self, n_in: int, device: torch.device):
        self.amax = torch.zeros((), dtype=torch.float32, device=device)
        self.sq = torch.zeros(n_in, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        if x.shape[0]:
            _accumulate(x, self.amax, self.sq)


def _accumulate(x: torch.Tensor, amax: torch.Tensor, sq: torch.Tensor) -> None:
    """amax <- max(amax, max|x|); sq += sum over rows of x^2 (fp32 reductions, no x-sized temp)."""
    torch.maximum(amax, torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32), out=amax)
    sq += torch.linalg.vector_norm(x, ord=2, dim=0, dtype=torch.float32).double().square()


class ForwardContext:
    """Per-batch state shared by the hooks and the MoE block: which positions are real."""

    valid: torch.Tensor | None = None  # [b, s] bool, None when every position is real

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, ...] or [b, 1, s, ...] (MLA latents) as rows of real positions [n, in]."""
        if self.valid is None:
            return x.reshape(-1, x.shape[-1])
        b, s = self.valid.shape
        return x.reshape(b, s, -1)[self.valid]


@dataclass
class _Experts:
    """A layer's routed experts decoded to the compute dtype, stacked like transformers'."""

    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor  # [E, H, I]
    names: list[dict[str, str]]  # expert -> proj -> checkpoint module


class MoEBlock(nn.Module):
    """DeepseekV3MoE with our routed-expert loop, which gathers each expert's tokens and
    accumulates the REAP and activation statistics. `gate` and `shared_experts` are
    transformers' own modules (same names, so the checkpoint's tensors load into them)."""

    def __init__(self, cfg, ctx: ForwardContext, experts: _Experts, device: torch.device):
        from transformers.activations import ACT2FN
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3MLP,
            DeepseekV3TopkRouter,
        )

        super().__init__()
        with torch.device("meta"):
            self.gate = DeepseekV3TopkRouter(cfg)
            self.shared_experts = DeepseekV3MLP(
                cfg, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.act_fn = ACT2FN[cfg.hidden_act]
        self.ctx, self.experts = ctx, experts
        n, inter, hidden = experts.down.shape[0], experts.down.shape[2], experts.down.shape[1]
        self.n_experts, self.inter = n, inter
        f64 = {"dtype": torch.float64, "device": device}
        self.count = torch.zeros(n, dtype=torch.int64, device=device)
        self.gate_sum = torch.zeros(n, **f64)
        self.reap_sum = torch.zeros(n, **f64)
        self.ean_sum = torch.zeros(n, **f64)
        self.ean_sq_sum = torch.zeros(n, **f64)
        self.amax_in = torch.zeros(n, dtype=torch.float32, device=device)
        self.amax_down = torch.zeros(n, dtype=torch.float32, device=device)
        self.sq_in = torch.zeros(n, hidden, **f64)
        self.sq_down = torch.zeros(n, inter, **f64)
        # With `capture`, the real rows of every batch's input and their top-k expert ids are
        # kept (SparseGPT builds each expert's Hessian from them); `captured()` joins them.
        self.capture = False
        # Without `collect`, the block only computes its output (no REAP/activation sums).
        self.collect = True
        self._inputs: list[torch.Tensor] = []
        self._indices: list[torch.Tensor] = []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, topk_weights, topk_indices = self.gate(x)
        if self.capture:
            real = self.ctx.valid.reshape(-1) if self.ctx.valid is not None else slice(None)
            self._inputs.append(x[real])
            self._indices.append(topk_indices[real])
        routed = self._routed(x, topk_indices, topk_weights)
        return routed.to(x.dtype).reshape(shape) + self.shared_experts(hidden_states)

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        k = indices.shape[1]
        tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
        exp, w = indices.reshape(-1), weights.reshape(-1).float()
        if self.ctx.valid is not None:  # padding is never routed, so never counted
            keep = self.ctx.valid.reshape(-1)[tok]
            tok, exp, w = tok[keep], exp[keep], w[keep]
        order = torch.argsort(exp, stable=True)
        tok, exp, w = tok[order], exp[order], w[order]
        counts = torch.bincount(exp, minlength=self.n_experts)
        xs = x[tok]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        norms = torch.empty(tok.shape[0], dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            rows = slice(start, start + c)
            xe = xs[rows]
            gate, up = nn.functional.linear(xe, self.experts.gate_up[e]).chunk(2, dim=-1)
            a = self.act_fn(gate) * up
            f = nn.functional.linear(a, self.experts.down[e])  # f_j(x): before gating
            # A token reaches an expert at most once: no repeated index, a plain += is exact
            # (and far cheaper than index_add_ on a busy multi-threaded CPU).
            out[tok[rows]] += f.float() * w[rows, None]
            start += c
            if self.collect:
                norms[rows] = torch.linalg.vector_norm(f, dim=-1, dtype=torch.float32)
                _accumulate(xe, self.amax_in[e], self.sq_in[e])
                _accumulate(a, self.amax_down[e], self.sq_down[e])
        if not self.collect:
            return out
        n = self.n_experts
        self.count += counts
        self.gate_sum += torch.bincount(exp, weights=w.double(), minlength=n)
        self.reap_sum += torch.bincount(exp, weights=(w * norms).double(), minlength=n)
        self.ean_sum += torch.bincount(exp, weights=norms.double(), minlength=n)
        self.ean_sq_sum += torch.bincount(exp, weights=norms.double().square(), minlength=n)
        return out

    def captured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [tokens, hidden], top-k expert ids [tokens, k]) of every real token."""
        if len(self._inputs) > 1:  # joined once; later calls reuse the joined tensors
            self._inputs, self._indices = [torch.cat(self._inputs)], [torch.cat(self._indices)]
        return self._inputs[0], self._indices[0]

    def routed_inputs(self, expert: int) -> torch.Tensor:
        """The inputs of gate/up [tokens, hidden] over the tokens routed to `expert`."""
        x, idx = self.captured()
        return x[(idx == expert).any(-1)]

    def expert_inputs(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs of gate/up, inputs of down) over the tokens routed to `expert`."""
        xe = self.routed_inputs(expert)
        gate, up = nn.functional.linear(xe, self.experts.gate_up[expert]).chunk(2, dim=-1)
        return xe, self.act_fn(gate) * up

    def results(self, layer: int) -> dict[str, torch.Tensor]:
        count = self.count.cpu()
        reap_sum = self.reap_sum.cpu()
        saliency = torch.where(count > 0, reap_sum / count.clamp(min=1), 0.0)
        base = f"layers.{layer}"
        out = {f"{base}.count": count, f"{base}.saliency": saliency,
               f"{base}.reap_sum": reap_sum, f"{base}.gate_sum": self.gate_sum.cpu(),
               f"{base}.ean_sum": self.ean_sum.cpu(), f"{base}.ean_sq_sum": self.ean_sq_sum.cpu()}
        amax_in, amax_down = self.amax_in.cpu(), self.amax_down.cpu()
        sq_in, sq_down = self.sq_in.float().cpu(), self.sq_down.float().cpu()
        for e in range(self.n_experts):
            for proj, amax, sq in (("gate_proj", amax_in, sq_in), ("up_proj", amax_in, sq_in),
                                   ("down_proj", amax_down, sq_down)):
                key = f"layers.{layer}.experts.{e}.{proj}"
                out[f"{key}.input_amax"] = amax[e].clone()
                out[f"{key}.input_sq_sum"] = sq[e].clone()
        return out


@dataclass
class _Layer:
    module: nn.Module  # transformers' DeepseekV3DecoderLayer, weights loaded
    moe: MoEBlock | None
    linear_stats: dict[str, _LinearStats]  # checkpoint module -> accumulator (non-expert)
    hooks: list = field(default_factory=list)

    def stat_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(sums, maxima): the accumulators of the layer's statistics (reduced over ranks)."""
        sums = [acc.sq for acc in self.linear_stats.values()]
        maxima = [acc.amax for acc in self.linear_stats.values()]
        if self.moe is not None:
            m = self.moe
            sums += [m.count, m.gate_sum, m.reap_sum, m.ean_sum, m.ean_sq_sum, m.sq_in,
                     m.sq_down]
            maxima += [m.amax_in, m.amax_down]
        return sums, maxima


def _read(ckpt: Checkpoint, info: TensorInfo) -> torch.Tensor:
    return ckpt.reader_for(info).read(info)


def _decode_one(ckpt: Checkpoint, m: ModuleWork, device: torch.device, dtype: torch.dtype
                ) -> torch.Tensor:
    t = {p: _read(ckpt, m.params[p]).to(device).unsqueeze(0) for p in m.codec.params}
    return m.codec.decode(t, m.shape)[0].to(dtype)


def _load_experts(ckpt: Checkpoint, cfg, modules: list[ModuleWork], layer: int,
                  device: torch.device, dtype: torch.dtype) -> _Experts:
    n, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    by_id: dict[int, dict[str, ModuleWork]] = {}
    for m in modules:
        by_id.setdefault(m.tn.expert, {})[m.tn.proj] = m
    missing = [e for e in range(n) if set(by_id.get(e, {})) != set(PROJS)]
    extra = sorted(set(by_id) - set(range(n)))
    if missing or extra:
        raise KconvertError(f"layer {layer}: routed experts must be 0..{n - 1} with gate/up/down "
                            f"(n_routed_experts); incomplete {missing[:8]}, unexpected "
                            f"{extra[:8]}", file=modules[0].primary.file.name if modules else None)
    want = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    for projs in by_id.values():
        for proj, m in projs.items():
            if tuple(m.shape) != want[proj]:
                raise KconvertError(f"expert linear is {list(m.shape)}, config says "
                                    f"{list(want[proj])}", file=m.primary.file.name,
                                    tensor=m.module)
    gate_up = torch.empty(n, 2 * inter, hidden, dtype=dtype, device=device)
    down = torch.empty(n, hidden, inter, dtype=dtype, device=device)
    groups: dict[tuple, list[tuple[int, str, ModuleWork]]] = {}
    for e in range(n):
        for proj, m in by_id[e].items():
            groups.setdefault((m.codec, tuple(m.shape)), []).append((e, proj, m))
    budget = DECODE_ELEMS.get(device.type, DECODE_ELEMS["cpu"])
    for (codec, shape), members in groups.items():
        step = max(1, budget // (shape[0] * shape[1]))
        for i in range(0, len(members), step):
            chunk = members[i:i + step]
            params = {}
            for p in codec.params:
                first = chunk[0][2].params[p]
                raw = torch.empty(len(chunk), first.nbytes, dtype=torch.uint8)
                for j, (_, _, m) in enumerate(chunk):
                    info = m.params[p]
                    if info.shape != first.shape or info.dtype != first.dtype:
                        raise KconvertError(f"{p} is {info.dtype}{list(info.shape)} but its "
                                            f"siblings are {first.dtype}{list(first.shape)}",
                                            file=info.file.name, tensor=info.name)
                    ckpt.reader_for(info).read_into(info, raw[j])
                params[p] = raw.view(first.torch_dtype).reshape(len(chunk), *first.shape).to(
                    device)
            w = codec.decode(params, shape).to(dtype)
            for j, (e, proj, _) in enumerate(chunk):
                if proj == "gate_proj":
                    gate_up[e, :inter] = w[j]
                elif proj == "up_proj":
                    gate_up[e, inter:] = w[j]
                else:
                    down[e] = w[j]
            del w, params
    names = [{proj: by_id[e][proj].module for proj in PROJS} for e in range(n)]
    return _Experts(gate_up, down, names)


def load_layer(ckpt: Checkpoint, cfg, layer: int, tensors: dict[str, TensorInfo],
                ctx: ForwardContext, device: torch.device, dtype: torch.dtype,
                stats: bool = True) -> _Layer:
    """transformers' decoder layer L holding exactly the checkpoint's layer-L tensors; with
    `stats` False it computes the forward alone (no calibration statistics)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    prefix = f"{parse_name(next(iter(tensors))).prefix}layers.{layer}."
    shape_values = {n: tuple(int(v) for v in _read(ckpt, i).tolist())
                    for n, i in tensors.items() if n.endswith(".weight_shape")}
    modules, others = group_modules(tensors, shape_values)
    experts = [m for m in modules if m.tn.role is Role.ROUTED_EXPERT]
    state: dict[str, torch.Tensor] = {}
    for m in modules:
        if m.tn.role is not Role.ROUTED_EXPERT:
            state[m.module[len(prefix):] + ".weight"] = _decode_one(ckpt, m, device, dtype)
    for info in others:
        if info.name.endswith(".weight_shape") or info.name.rsplit(".", 1)[-1] in KV_SCALES:
            continue
        rel = info.name[len(prefix):]
        t = _read(ckpt, info).to(device)
        if not t.is_floating_point():
            raise KconvertError("unexpected non-float tensor in a decoder layer",
                                file=info.file.name, tensor=info.name)
        # e_score_correction_bias stays F32 (transformers keeps it in fp32 too).
        state[rel] = t.float() if rel.endswith("e_score_correction_bias") else t.to(dtype)

    with torch.device("meta"):
        module = DeepseekV3DecoderLayer(cfg, layer)
    moe = None
    is_moe = layer >= cfg.first_k_dense_replace
    if is_moe != bool(experts):
        raise KconvertError(f"layer {layer}: first_k_dense_replace={cfg.first_k_dense_replace} "
                            f"but the layer has {len(experts)} routed expert linears")
    if is_moe:
        moe = MoEBlock(cfg, ctx, _load_experts(ckpt, cfg, experts, layer, device, dtype), device)
        module.mlp = moe
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise KconvertError(f"layer {layer} does not match the config: {exc}",
                            tensor=prefix.rstrip(".")) from exc
    module.eval()

    linear_stats: dict[str, _LinearStats] = {}
    hooks = []
    if moe is not None:
        moe.collect = stats
    for rel, sub in module.named_modules() if stats else ():
        if isinstance(sub, nn.Linear):
            acc = linear_stats[prefix + rel] = _LinearStats(sub.in_features, device)
            hooks.append(sub.register_forward_pre_hook(
                lambda _mod, args, acc=acc: acc.add(ctx.real_rows(args[0]))))
    return _Layer(module, moe, linear_stats, hooks)


def tensors_by_layer(ckpt: Checkpoint, n_layers: int) -> dict[int, dict[str, TensorInfo]]:
    layers: dict[int, dict[str, TensorInfo]] = {}
    for name, info in ckpt.tensors.items():
        tn = parse_name(name)
        if tn.layer is not None:
            layers.setdefault(tn.layer, {})[name] = info
    missing = [L for L in range(n_layers) if L not in layers]
    if missing:
        raise KconvertError(f"decoder layers {missing[:8]} have no tensors "
                            f"(num_hidden_layers={n_layers})")
    return layers


def embed(ckpt: Checkpoint, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Embedding rows of `ids` (PAD_ID -> zeros), reading only the rows that are used."""
    names = [n for n in ckpt.weight_map if parse_name(n).role is Role.EMBEDDING]
    if len(names) != 1:
        raise KconvertError(f"expected one embed_tokens tensor, found {names}")
    info = ckpt.tensors[names[0]]
    if info.dtype not in ("BF16", "F16", "F32") or len(info.shape) != 2:
        raise KconvertError(f"embedding is {info.dtype}{list(info.shape)}; a float matrix is "
                            "needed", file=info.file.name, tensor=info.name)
    vocab, hidden = info.shape
    real = ids[ids != PAD_ID]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        raise KconvertError(f"token ids must lie in 0..{vocab - 1} (or be {PAD_ID}, padding)")
    used = torch.unique(real)
    row_bytes = info.nbytes // vocab
    if used.numel() > vocab // 4:
        table = _read(ckpt, info)[used]
    else:
        raw = torch.empty(used.numel(), row_bytes, dtype=torch.uint8)
        reader = ckpt.reader_for(info)
        for i, t in enumerate(used.tolist()):
            reader.read_into(info, raw[i], t * row_bytes)
        table = raw.view(info.torch_dtype).reshape(-1, hidden)
    out = torch.zeros(*ids.shape, hidden, dtype=dtype)
    mask = ids != PAD_ID
    out[mask] = table.to(dtype)[torch.searchsorted(used, ids[mask])]
    return out


def padding_aware_mask(valid: torch.Tensor, all_valid: bool) -> torch.Tensor | None:
    """None (SDPA's causal kernel) when nothing is padding; else causal AND real keys, as a
    boolean [b, 1, s, s] mask. A padding query with no real key left attends to itself
    (its output is never used: real tokens never attend to it)."""
    if all_valid:
        return None
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    mask = causal & valid[:, None, None, :]
    return mask | torch.eye(s, dtype=torch.bool, device=valid.device)


def position_embeddings(cfg, seq_len: int, device: torch.device, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(positions [1, seq_len], the rope's (cos, sin)) for positions 0..seq_len-1."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    rotary = DeepseekV3RotaryEmbedding(cfg).to(device)
    return positions, rotary(torch.empty(0, device=device, dtype=dtype), positions)


def layer_forward(layer: _Layer, ctx: ForwardContext, x: torch.Tensor, valid: torch.Tensor,
                  positions: torch.Tensor, pos_emb) -> torch.Tensor:
    """One loaded decoder layer on hidden states x [b, s, hidden] whose real positions are
    `valid` [b, s] (both on the layer's device)."""
    all_valid = bool(valid.all())
    ctx.valid = None if all_valid else valid
    return layer.module(x, attention_mask=padding_aware_mask(valid, all_valid),
                        position_ids=positions, position_embeddings=pos_emb)


@dataclass
class Head:
    """The final RMSNorm and lm_head: hidden states [..., hidden] -> logits [..., vocab]."""

    norm: nn.Module  # transformers' DeepseekV3RMSNorm
    weight: torch.Tensor  # lm_head [vocab, hidden]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.norm(hidden), self.weight)


def load_head(ckpt: Checkpoint, cfg, device: torch.device, dtype: torch.dtype) -> Head:
    """The checkpoint's final norm and lm_head (any prefix, K2.5/K2.6 wrappers included)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    found: dict[Role, list[str]] = {Role.NORM: [], Role.LM_HEAD: []}
    for name in ckpt.weight_map:
        tn = parse_name(name)
        if tn.layer is None and tn.role in found:
            found[tn.role].append(name)
    loaded = {}
    for role, shape in ((Role.NORM, (cfg.hidden_size,)),
                        (Role.LM_HEAD, (cfg.vocab_size, cfg.hidden_size))):
        if len(found[role]) != 1:
            raise KconvertError(f"expected one {role} tensor of the language model, found "
                                f"{found[role]}")
        info = ckpt.tensors[found[role][0]]
        if info.dtype not in ("BF16", "F16", "F32") or tuple(info.shape) != shape:
            raise KconvertError(f"{role} is {info.dtype}{list(info.shape)}; a float tensor of "
                                f"shape {list(shape)} is needed", file=info.file.name,
                                tensor=info.name)
        loaded[role] = _read(ckpt, info).to(device, dtype)
    with torch.device("meta"):
        norm = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    norm.load_state_dict({"weight": loaded[Role.NORM]}, assign=True)
    return Head(norm, loaded[Role.LM_HEAD])
