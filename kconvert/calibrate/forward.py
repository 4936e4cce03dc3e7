"""The exact forward of one decoder layer, loaded from the checkpoint's tensors alone.

transformers' own `DeepseekV3DecoderLayer` (MLA attention with its YaRN rope, RMSNorms,
residuals, dense MLP) built from the checkpoint's text config read as "deepseek_v3", with our
MoE block: transformers' router and shared expert, and the routed experts as grouped matrix
products in which each expert sees only its routed tokens while the calibration statistics
accumulate (per expert, over the same rows, without a host sync).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kconvert.calibrate.data import PAD_ID
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name

PROJS = ("gate_proj", "up_proj", "down_proj")


# Rows per step of the per-expert activation statistics (fp32 temporaries of rows x width).
GROUP_STAT_ROWS = 1 << 15


def model_config(ckpt: Checkpoint):
    """transformers' DeepseekV3Config from the checkpoint's text config ("kimi_k2" read as
    "deepseek_v3", the architecture it is), attention through SDPA. transformers' DeepSeek-V3
    modules (seconds to import) are imported here, before the layers need them, so that the
    import runs while the device starts (kconvert.calibrate.startup).

    Every data-driven command (calibrate, eval, REAP's calibration and repair, GPTQ,
    SparseGPT) builds its model here: a family whose forward kconvert does not implement
    (Kimi-K3) is refused here, for all of them."""
    unsupported = arch_of(ckpt.text_config).unsupported_forward()
    if unsupported is not None:
        raise KconvertError(unsupported, file=str(ckpt.root / "config.json"))
    from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: F401
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

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


class LinearStats:
    """Input amax and per-column sum of squares of one linear, accumulated on the device."""

    def __init__(self, n_in: int, device: torch.device):
        self.amax = torch.zeros((), dtype=torch.float32, device=device)
        self.sq = torch.zeros(n_in, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor) -> None:
        if x.shape[0]:
            _accumulate(x, self.amax, self.sq)


# Rows per step of an input Gram's accumulation (InputGram): its fp32 copy of those rows and
# the copy of the rows that go to one of its two sums.
GRAM_ROWS = 1 << 12


def gram_bytes(widths: list[int], held_out: bool) -> int:
    """Device bytes of the input Grams of linears of input `widths` (one per fused set): an
    fp32 [in, in] sum each, two with `held_out`, and one accumulation step's rows (the GPU
    memory plan's term, kconvert.gpu_plan.Forward.gram_bytes)."""
    if not widths:
        return 0
    return 4 * ((2 if held_out else 1) * sum(w * w for w in widths)
                + 2 * GRAM_ROWS * max(widths))


class InputGram:
    """X^T X of the real input rows one linear sees (its OBS Hessian, kconvert.methods),
    accumulated on the device in fp32, batch by batch in row order: with `held_every` n > 0
    every n-th row (rows n-1, 2n-1, ... counted over the whole pass) goes to `held` instead of
    `fit` (the rows GPTQ's comparison with RTN is judged on); with 0, `held` is None."""

    def __init__(self, n_in: int, device: torch.device, held_every: int = 0):
        self.n_in, self.device = n_in, device
        self.held_every, self.rows = held_every, 0
        # allocated at the first rows (during the layer's forward, not when a prefetched
        # layer is built ahead of it)
        self.fit: torch.Tensor | None = None
        self.held: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        if self.fit is None:
            self.fit = torch.zeros(self.n_in, self.n_in, dtype=torch.float32, device=self.device)
            if self.held_every:
                self.held = torch.zeros_like(self.fit)
        for start in range(0, x.shape[0], GRAM_ROWS):
            chunk = x[start:start + GRAM_ROWS].float()
            n, first = chunk.shape[0], self.rows
            self.rows += n
            if self.held is None:
                self.fit.addmm_(chunk.T, chunk)
                continue
            every = self.held_every
            held = torch.zeros(n, dtype=torch.bool, device=chunk.device)
            held[(every - 1 - first) % every::every] = True
            for acc, rows in ((self.fit, chunk[~held]), (self.held, chunk[held])):
                acc.addmm_(rows.T, rows)


def _accumulate(x: torch.Tensor, amax: torch.Tensor, sq: torch.Tensor) -> None:
    """amax <- max(amax, max|x|); sq += sum over rows of x^2 (fp32 reductions, no x-sized temp)."""
    torch.maximum(amax, torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32), out=amax)
    sq += torch.linalg.vector_norm(x, ord=2, dim=0, dtype=torch.float32).double().square()


def _accumulate_groups(rows: torch.Tensor, counts: torch.Tensor, amax: torch.Tensor,
                       sq: torch.Tensor) -> None:
    """_accumulate per group of consecutive rows (group g: counts[g] rows) into amax[g], sq[g],
    a chunk of rows at a time (bounds the fp32 temporaries)."""
    ends = counts.cumsum(0)
    for start in range(0, rows.shape[0], GROUP_STAT_ROWS):
        stop = min(start + GROUP_STAT_ROWS, rows.shape[0])
        # the rows of each group inside [start, stop)
        lengths = ends.clamp(start, stop) - (ends - counts).clamp(start, stop)
        chunk = rows[start:stop].float()
        row_max = torch.linalg.vector_norm(chunk, ord=math.inf, dim=-1)
        torch.maximum(amax, torch.segment_reduce(row_max, "max", lengths=lengths, initial=0),
                      out=amax)
        sq += torch.segment_reduce(chunk.square(), "sum", lengths=lengths).double()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows x[ends[g-1]:ends[g]] times weight[g]^T for every group g at once ([rows, in] x
    [G, out, in] -> [rows, out]): torch's grouped GEMM (CUTLASS on Hopper in bf16; elsewhere
    torch's own loop over the groups)."""
    return nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=ends)


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
class Experts:
    """A layer's routed experts decoded to the compute dtype, stacked like transformers'."""

    gate_up: torch.Tensor  # [E, 2I, H]: gate rows then up rows
    down: torch.Tensor  # [E, H, I]
    names: list[dict[str, str]]  # expert -> proj -> checkpoint module


class MoEBlock(nn.Module):
    """DeepseekV3MoE with our routed experts (grouped matrix products over each expert's
    tokens), which accumulate the REAP and activation statistics. `gate` and `shared_experts` are
    transformers' own modules (same names, so the checkpoint's tensors load into them)."""

    def __init__(self, cfg, ctx: ForwardContext, experts: Experts, device: torch.device):
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
        # With `capture_rows` (the layer's real tokens, when known) they are written into one
        # buffer as they come, so joining them never holds two copies (GPU memory plan).
        self.capture = False
        self.capture_rows = 0
        self._filled = 0
        # Without `collect`, the block only computes its output (no REAP/activation sums).
        self.collect = True
        self._inputs: list[torch.Tensor] = []
        self._indices: list[torch.Tensor] = []
        # Set by `kconvert eval` on a W4A4 checkpoint: (linear 0 gate/up or 1 down, input rows,
        # each row's expert) -> the rows as the serving kernel quantizes them
        # (evaluate/activations.py).
        self.quantize_input: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None \
            = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, topk_weights, topk_indices = self.gate(x)
        if self.capture:
            real = self.ctx.valid.reshape(-1) if self.ctx.valid is not None else slice(None)
            self._keep(x[real], topk_indices[real])
        routed = self._routed(x, topk_indices, topk_weights)
        return routed.to(x.dtype).reshape(shape) + self.shared_experts(hidden_states)

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """Every routed expert on its tokens as two grouped matrix products: the (token,
        slot) pairs sorted by expert once, each expert's rows one group. No host sync."""
        t, k = indices.shape
        slot = torch.arange(t * k, device=x.device)  # token * k + j: the j-th choice of a token
        exp, w = indices.reshape(-1), weights.reshape(-1).float()
        if self.ctx.valid is not None:  # padding is never routed, so never counted
            keep = self.ctx.valid.reshape(-1).repeat_interleave(k)
            slot, exp, w = slot[keep], exp[keep], w[keep]
        order = torch.argsort(exp, stable=True)
        slot, exp, w = slot[order], exp[order], w[order]
        counts = torch.bincount(exp, minlength=self.n_experts)
        ends = counts.cumsum(0).to(torch.int32)
        xs = x[slot // k]
        q = self.quantize_input
        gate, up = grouped_linear(xs if q is None else q(0, xs, exp), self.experts.gate_up,
                                  ends).chunk(2, dim=-1)
        a = self.act_fn(gate) * up
        # f_j(x): before gating
        f = grouped_linear(a if q is None else q(1, a, exp), self.experts.down, ends)
        # Each (token, slot) written once, then a token's k slots summed in slot order: the
        # same sum whatever the expert order, and no atomic adds (deterministic on a GPU).
        slots = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
        slots[slot] = f.float() * w[:, None]
        out = slots.view(t, k, -1).sum(1)
        if not self.collect:
            return out
        norms = torch.linalg.vector_norm(f, dim=-1, dtype=torch.float32)
        self.count += counts
        for acc, values in ((self.gate_sum, w), (self.reap_sum, w * norms),
                            (self.ean_sum, norms), (self.ean_sq_sum, norms.square())):
            acc += torch.segment_reduce(values.double(), "sum", lengths=counts)
        _accumulate_groups(xs, counts, self.amax_in, self.sq_in)
        _accumulate_groups(a, counts, self.amax_down, self.sq_down)
        return out

    def _keep(self, x: torch.Tensor, indices: torch.Tensor) -> None:
        if not self.capture_rows:
            self._inputs.append(x)
            self._indices.append(indices)
            return
        if not self._inputs:
            self._inputs = [x.new_empty(self.capture_rows, x.shape[1])]
            self._indices = [indices.new_empty(self.capture_rows, indices.shape[1])]
        end = self._filled + x.shape[0]
        if end > self.capture_rows:
            raise KconvertError(f"the MoE layer saw more than the {self.capture_rows} real "
                                "tokens it was given")
        self._inputs[0][self._filled:end] = x
        self._indices[0][self._filled:end] = indices
        self._filled = end

    def captured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [tokens, hidden], top-k expert ids [tokens, k]) of every real token."""
        if self.capture_rows:
            return self._inputs[0][:self._filled], self._indices[0][:self._filled]
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
class Layer:
    module: nn.Module  # transformers' DeepseekV3DecoderLayer, weights loaded
    moe: MoEBlock | None
    linear_stats: dict[str, LinearStats]  # checkpoint module -> accumulator (non-expert)
    hooks: list = field(default_factory=list)
    # fused set (kconvert.model.names: linears that see one input) -> its input Gram, for the
    # linears whose Hessians were asked for (build_layer's `grams`)
    grams: dict[str, InputGram] = field(default_factory=dict)

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


def embed(ckpt: Checkpoint, ids: torch.Tensor, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """Embedding rows of `ids` (PAD_ID -> zeros) on `device`, reading only the rows that are
    used: only those rows and the ids travel there, and the gather runs there."""
    # (only names that can be the embedding are parsed: a full-size checkpoint has 208,215)
    names = [n for n in ckpt.weight_map
             if "embed_tokens" in n and parse_name(n).role is Role.EMBEDDING]
    if len(names) != 1:
        raise KconvertError(f"expected one embed_tokens tensor, found {names}")
    info = ckpt.tensor(names[0])
    if info.dtype not in ("BF16", "F16", "F32") or len(info.shape) != 2:
        raise KconvertError(f"embedding is {info.dtype}{list(info.shape)}; a float matrix is "
                            "needed", file=info.file.name, tensor=info.name)
    vocab, hidden = info.shape
    pad = ids == PAD_ID
    real = ids[~pad]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        bad = int(real.max()) if int(real.max()) >= vocab else int(real.min())
        raise KconvertError(f"token id {bad} is outside the embedding's vocabulary (ids 0.."
                            f"{vocab - 1})", file=info.file.name, tensor=info.name)
    used = torch.unique(real)
    row_bytes = info.nbytes // vocab
    if used.numel() > vocab // 4:
        table = ckpt.reader_for(info).read(info)[used]
    else:
        raw = torch.empty(used.numel(), row_bytes, dtype=torch.uint8)
        reader = ckpt.reader_for(info)
        for i, t in enumerate(used.tolist()):
            reader.read_into(info, raw[i], t * row_bytes)
        table = raw.view(info.torch_dtype).reshape(-1, hidden)
    # one more row of zeros, where padding points
    table = torch.cat([table.to(dtype), torch.zeros(1, hidden, dtype=dtype)]).to(device)
    rows = torch.where(pad, used.numel(), torch.searchsorted(used, ids.clamp(min=0)))
    return table[rows.to(device)]


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


def layer_forward(layer: Layer, ctx: ForwardContext, x: torch.Tensor, valid: torch.Tensor,
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
        if "norm" not in name and "lm_head" not in name:  # neither role: not parsed
            continue
        tn = parse_name(name)
        if tn.layer is None and tn.role in found:
            found[tn.role].append(name)
    loaded = {}
    for role, shape in ((Role.NORM, (cfg.hidden_size,)),
                        (Role.LM_HEAD, (cfg.vocab_size, cfg.hidden_size))):
        if len(found[role]) != 1:
            raise KconvertError(f"expected one {role} tensor of the language model, found "
                                f"{found[role]}")
        info = ckpt.tensor(found[role][0])
        if info.dtype not in ("BF16", "F16", "F32") or tuple(info.shape) != shape:
            raise KconvertError(f"{role} is {info.dtype}{list(info.shape)}; a float tensor of "
                                f"shape {list(shape)} is needed", file=info.file.name,
                                tensor=info.name)
        loaded[role] = ckpt.reader_for(info).read(info).to(device, dtype)
    with torch.device("meta"):
        norm = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    norm.load_state_dict({"weight": loaded[Role.NORM]}, assign=True)
    return Head(norm, loaded[Role.LM_HEAD])
