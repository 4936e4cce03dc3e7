"""The exact forward of one decoder layer, loaded from the checkpoint's tensors alone.

transformers' own `DeepseekV3DecoderLayer` (MLA attention with its YaRN rope, RMSNorms,
residuals, dense MLP) built from the checkpoint's text config read as "deepseek_v3", with our
MoE block (kconvert.calibrate.moe): transformers' router and shared expert, and the routed
experts as grouped matrix products in which each expert sees only its routed tokens while the
calibration statistics accumulate.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from kconvert.calibrate import block_amax
from kconvert.calibrate.data import PAD_ID
from kconvert.calibrate.held_out import split_rows
from kconvert.calibrate.moe import ForwardContext, MoEBlock
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import Checkpoint
from kconvert.model.arch import arch_of
from kconvert.model.names import Role, parse_name

PROJS = ("gate_proj", "up_proj", "down_proj")


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
    """Input amax, per-column sum of squares and per-block amax histogram
    (kconvert.calibrate.block_amax) of one linear, accumulated on the device."""

    def __init__(self, n_in: int, device: torch.device):
        self.amax = torch.zeros((), dtype=torch.float32, device=device)
        self.sq = torch.zeros(n_in, dtype=torch.float64, device=device)
        self.block_amax = block_amax.new_histogram(device=device)

    def add(self, x: torch.Tensor) -> None:
        if x.shape[0]:
            _accumulate(x, self.amax, self.sq)
            block_amax.add_rows(x, self.block_amax)


# Rows per step of an input Gram's accumulation (InputGram): its fp32 copy of those rows and
# the copy of the rows that go to one of its two sums.
GRAM_ROWS = 1 << 12


def gram_bytes(widths: list[int], held_out: bool) -> int:
    """Device bytes of the input Grams of linears of input `widths` (one per fused set): an
    fp32 [in, in] sum each, two with `held_out`, and one accumulation step's rows (the GPU
    memory plan's term, kconvert.gpu.parts.Forward.gram_bytes)."""
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
            kept, held = split_rows(n, self.held_every, chunk.device, first)
            for acc, at in ((self.fit, kept), (self.held, held)):
                rows = chunk.index_select(0, at)
                acc.addmm_(rows.T, rows)


def _accumulate(x: torch.Tensor, amax: torch.Tensor, sq: torch.Tensor) -> None:
    """amax <- max(amax, max|x|); sq += sum over rows of x^2 (fp32 reductions, no x-sized temp)."""
    torch.maximum(amax, torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32), out=amax)
    sq += torch.linalg.vector_norm(x, ord=2, dim=0, dtype=torch.float32).double().square()


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
        sums = [t for acc in self.linear_stats.values() for t in (acc.sq, acc.block_amax)]
        maxima = [acc.amax for acc in self.linear_stats.values()]
        if self.moe is not None:
            m = self.moe
            sums += [m.count, m.gate_sum, m.reap_sum, m.ean_sum, m.ean_sq_sum, m.sq_in,
                     m.sq_down, m.block_amax_in, m.block_amax_down]
            maxima += [m.amax_in, m.amax_down]
        return sums, maxima


def embed(ckpt: Checkpoint, ids: torch.Tensor, dtype: torch.dtype,
          device: torch.device | str = "cpu", tensor: str | None = None) -> torch.Tensor:
    """Embedding rows of `ids` (PAD_ID -> zeros) on `device`, reading only the rows that are
    used: only those rows and the ids travel there, and the gather runs there. `tensor`: the
    embedding to read (an MTP layer's own copy), by default the model's."""
    # (only names that can be the embedding are parsed: a full-size checkpoint has 208,215)
    names = [tensor] if tensor is not None else [
        n for n in ckpt.weight_map if "embed_tokens" in n and parse_name(n).role is Role.EMBEDDING]
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


def final_tensor(ckpt: Checkpoint, role: Role, shape: tuple[int, ...]) -> torch.Tensor:
    """The language model's final norm (role NORM) or lm_head (LM_HEAD), of `shape`, in host
    memory (any prefix, K2.5/K2.6 wrappers included)."""
    found = []
    for name in ckpt.weight_map:
        if "norm" not in name and "lm_head" not in name:  # neither role: not parsed
            continue
        tn = parse_name(name)
        if tn.layer is None and tn.role is role:
            found.append(name)
    if len(found) != 1:
        raise KconvertError(f"expected one {role} tensor of the language model, found {found}")
    info = ckpt.tensor(found[0])
    if info.dtype not in ("BF16", "F16", "F32") or tuple(info.shape) != shape:
        raise KconvertError(f"{role} is {info.dtype}{list(info.shape)}; a float tensor of "
                            f"shape {list(shape)} is needed", file=info.file.name,
                            tensor=info.name)
    return ckpt.reader_for(info).read(info)


def rms_norm(weight: torch.Tensor, eps: float) -> nn.Module:
    """transformers' DeepseekV3RMSNorm holding `weight` (on its device, in its dtype)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    with torch.device("meta"):
        norm = DeepseekV3RMSNorm(weight.shape[0], eps=eps)
    norm.load_state_dict({"weight": weight}, assign=True)
    return norm


def load_head(ckpt: Checkpoint, cfg, device: torch.device, dtype: torch.dtype) -> Head:
    """The checkpoint's final norm and lm_head (any prefix, K2.5/K2.6 wrappers included)."""
    norm = final_tensor(ckpt, Role.NORM, (cfg.hidden_size,)).to(device, dtype)
    weight = final_tensor(ckpt, Role.LM_HEAD, (cfg.vocab_size, cfg.hidden_size))
    return Head(rms_norm(norm, cfg.rms_norm_eps), weight.to(device, dtype))
