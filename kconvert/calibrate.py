"""Layer-streamed calibration: REAP saliency, expert frequencies and activation statistics.

The calibration tokens are embedded once (only the embedding rows they use are read), then the
decoder layers are streamed: for L = 0..num_hidden_layers-1 only layer L's tensors are read and
decoded (INT4, NVFP4, FP8-block or BF16, through `kconvert.codecs`) to the compute dtype, the
layer runs over the hidden states of every calibration token, statistics are accumulated, and
the outputs become layer L+1's inputs. The weights are freed before the next layer is read.

Exact forward. The layer is transformers' own `DeepseekV3DecoderLayer` (MLA attention with its
YaRN rope, RMSNorms, residuals, dense MLP below `first_k_dense_replace`), built from the
checkpoint's text config read as "deepseek_v3" and loaded with layer L's tensors. Only the MoE
block is ours, and only its routed-expert loop: the router is transformers'
`DeepseekV3TopkRouter` (selection on sigmoid(logits) + e_score_correction_bias with the group
limits, weights = sigmoid at the chosen experts, renormalised when norm_topk_prob, times
routed_scaling_factor) and the shared expert is `DeepseekV3MLP`. Each routed expert sees only
the tokens routed to it (tokens are gathered per expert, never every expert on every token).

Statistics, per MoE layer L and routed expert j, over real (non-padding) routed tokens X_j:
  count      |X_j|                                           (`layers.L.count`, int64)
  gate_sum   sum g_j(x)                                      (`layers.L.gate_sum`)
  reap_sum   sum g_j(x) * ||f_j(x)||_2                       (`layers.L.reap_sum`)
  ean_sum    sum ||f_j(x)||_2                                (`layers.L.ean_sum`)
  saliency   reap_sum / count, 0 for a never-routed expert   (`layers.L.saliency`, REAP)
where f_j(x) = down(act(gate x) * up x) is the expert's raw output before gating and g_j(x) is
the weight the model really multiplies it by: the sigmoid score renormalised over the top-k
and times routed_scaling_factor (GATE_WEIGHT). Per linear of every decoder layer (attention,
dense MLP, shared and routed experts), over the inputs that linear actually sees (for a routed
expert: its routed tokens; for down_proj: act(gate x) * up x):
  input_amax     max |x|                                     (`<key>.input_amax`, 0-dim)
  input_sq_sum   per input column sum x^2 (Wanda's ||X_j||^2) (`<key>.input_sq_sum`)
with <key> = `layers.L.experts.E.{proj}`, `layers.L.shared_experts.{proj}`, `layers.L.mlp.{proj}`
(dense) or `layers.L.self_attn.{proj}`; `stats.json` maps every key to its checkpoint module.

Padding: an input id of PAD_ID (-1), or a 0 in `attention_mask`, marks a padding position.
Padding is never counted in any statistic, is never routed to an expert, and real tokens never
attend to it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kconvert import __version__
from kconvert.errors import KconvertError
from kconvert.layout import Role, parse_name
from kconvert.safetensors_io import TensorInfo
from kconvert.source import Checkpoint
from kconvert.stages import ModulePlan, group_modules

PAD_ID = -1
ROUTING_CONVENTION = "sigmoid+bias selection, renormalised sigmoid weights x routed_scaling_factor"
GATE_WEIGHT = ("g_j(x) = sigmoid(logit_j) / sum of sigmoid over the chosen top-k (norm_topk_prob) "
               "x routed_scaling_factor: the weight the model applies to expert j's output")
STATS_FILE, META_FILE, ACT_FILE = "stats.safetensors", "stats.json", "act_stats.json"
PROJS = ("gate_proj", "up_proj", "down_proj")
# KV-cache quantization scales some exports carry: no effect on an unquantized forward.
KV_SCALES = {"k_scale", "v_scale"}
# Decoded fp32 elements per batch of routed experts while a layer's weights are loaded.
DECODE_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 24}


# ----------------------------------------------------------------------------- results

@dataclass
class CalibrationStats:
    """Everything one calibration pass measured.

    `tensors` holds exactly what `stats.safetensors` holds (names in the module docstring);
    `modules` maps each linear's statistics key (`layers.3.experts.7.gate_proj`) to its module
    name in the checkpoint (`model.layers.3.mlp.experts.7.gate_proj`); `meta` is `stats.json`'s
    description of the run.
    """

    meta: dict
    tensors: dict[str, torch.Tensor]
    modules: dict[str, str]

    @property
    def moe_layers(self) -> list[int]:
        return sorted(int(k.split(".")[1]) for k in self.tensors
                      if k.startswith("layers.") and k.endswith(".saliency"))

    def layer(self, layer: int, stat: str) -> torch.Tensor:
        """A per-expert statistic of an MoE layer: saliency, count, gate_sum, reap_sum, ean_sum."""
        return self.tensors[f"layers.{layer}.{stat}"]

    def input_amax(self) -> dict[str, float]:
        """{checkpoint module name: input amax}, routed experts that saw no token included (0)."""
        return {module: float(self.tensors[f"{key}.input_amax"])
                for key, module in self.modules.items()}

    def act_stats(self) -> dict[str, dict[str, float]]:
        """The `act_stats.json` that `kconvert quantize --act-stats` reads.

        A routed expert that no calibration token reached has no measured amax; it gets the
        largest amax of the same projection over the layer's other experts (a zero amax would
        give ModelOpt a zero input scale). Such experts are listed in `meta["unrouted"]`.
        """
        amax = self.input_amax()
        fill: dict[tuple[int, str], float] = {}
        for key, module in self.modules.items():
            parts = key.split(".")
            if parts[2] == "experts":
                slot = (int(parts[1]), parts[4])
                fill[slot] = max(fill.get(slot, 0.0), amax[module])
        for key, module in self.modules.items():
            parts = key.split(".")
            if parts[2] == "experts" and amax[module] == 0.0:
                amax[module] = fill[(int(parts[1]), parts[4])]
        return {"input_amax": dict(sorted(amax.items()))}


def stats_key(module: str) -> str:
    """Statistics key of a linear's checkpoint module name (see the module docstring)."""
    tn = parse_name(module + ".weight")
    if tn.role is Role.ROUTED_EXPERT:
        return f"layers.{tn.layer}.experts.{tn.expert}.{tn.proj}"
    if tn.role is Role.SHARED_EXPERT:
        return f"layers.{tn.layer}.shared_experts.{tn.proj}"
    if tn.role is Role.DENSE_MLP:
        return f"layers.{tn.layer}.mlp.{tn.proj}"
    if tn.role is Role.ATTENTION:
        return f"layers.{tn.layer}.self_attn.{tn.proj}"
    raise KconvertError("not a decoder-layer linear", tensor=module)


def save_stats(stats: CalibrationStats, out: str | Path) -> None:
    """Write `stats.safetensors`, `act_stats.json`, then `stats.json` (written last: complete)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(stats.tensors.items())}
    tmp = out / (STATS_FILE + ".tmp")
    # save_file writes through a private (0600) file of its own; give the result the mode a
    # new file gets under the process umask, as the JSON files have.
    tmp.write_bytes(b"")
    mode = tmp.stat().st_mode & 0o777
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt",
                                               "producer": f"kconvert {__version__}"})
    except SafetensorError as exc:
        tmp.unlink(missing_ok=True)
        # An I/O failure (a full disk) arrives as text: "... (os error 28)". Raised as the
        # OSError it is, the command line names the file and what to do.
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(tmp)) from exc
    os.chmod(tmp, mode)
    os.replace(tmp, out / STATS_FILE)
    _write_json(out / ACT_FILE, stats.act_stats())
    _write_json(out / META_FILE, {**stats.meta, "modules": dict(sorted(stats.modules.items()))})


def load_stats(path: str | Path) -> CalibrationStats:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads((path / META_FILE).read_text())
        tensors = load_file(str(path / STATS_FILE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise KconvertError(f"unreadable calibration statistics: {exc}", file=str(path)) from exc
    modules = meta.pop("modules", {})
    return CalibrationStats(meta, tensors, modules)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- data

def load_calibration_data(path: str | Path, tokenizer_dir: str | Path | None, samples: int,
                          seq_len: int, seed: int) -> torch.LongTensor:
    """Calibration sequences [n, seq_len] (n <= samples) from a JSONL file.

    Each line is an object with one of:
      "input_ids": a list of token ids, used exactly as given (no special tokens added);
      "text":      tokenized by AutoTokenizer.from_pretrained(tokenizer_dir,
                   trust_remote_code=True) with the tokenizer's own special tokens;
      "messages":  a chat, tokenized with the tokenizer's chat template.
    Lines are taken in an order shuffled by `seed`. A line of exactly `seq_len` input_ids is
    one sequence by itself; every other line is appended to a packing stream that is cut into
    `seq_len` pieces (a long document continues in the next sequence). Once `samples`
    sequences exist the rest is not tokenized. If the data runs out first, the stream's
    remainder becomes a last sequence right-padded with PAD_ID, which calibration never counts.
    """
    path = Path(path)
    if samples < 1 or seq_len < 1:
        raise KconvertError(f"--samples {samples} and --seq-len {seq_len} must be positive")
    try:
        lines = [(n, ln) for n, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise KconvertError(f"cannot read calibration data: {exc}", file=str(path)) from exc
    if not lines:
        raise KconvertError("calibration data is empty", file=str(path))
    random.Random(seed).shuffle(lines)

    tokenizer = None
    seqs: list[list[int]] = []
    stream: list[int] = []
    for lineno, line in lines:
        if len(seqs) >= samples:
            break
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise KconvertError(f"line {lineno} is not JSON: {exc}", file=str(path)) from exc
        if not isinstance(obj, dict):
            raise KconvertError(f"line {lineno} is not a JSON object", file=str(path))
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise KconvertError(f"line {lineno}: input_ids must be a list of non-negative "
                                    "integers", file=str(path))
            if len(ids) == seq_len:
                seqs.append(list(ids))
                continue
        elif "text" in obj or "messages" in obj:
            if tokenizer is None:
                tokenizer = _load_tokenizer(tokenizer_dir)
            ids = _tokenize(tokenizer, obj, where)
        else:
            raise KconvertError(f"line {lineno} has none of input_ids, text, messages",
                                file=str(path))
        stream.extend(ids)
        start = 0
        while len(stream) - start >= seq_len and len(seqs) < samples:
            seqs.append(stream[start:start + seq_len])
            start += seq_len
        del stream[:start]
    if len(seqs) < samples and stream:
        seqs.append(stream + [PAD_ID] * (seq_len - len(stream)))
    if not seqs:
        raise KconvertError("calibration data holds no tokens", file=str(path))
    return torch.tensor(seqs, dtype=torch.long)


def _load_tokenizer(tokenizer_dir):
    if tokenizer_dir is None:
        raise KconvertError("calibration data has text or messages but no tokenizer was given")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=True)
    except Exception as exc:  # any loading failure is the user's to fix
        raise KconvertError(f"cannot load the tokenizer: {exc}", file=str(tokenizer_dir)) from exc


def _tokenize(tokenizer, obj: dict, where: str) -> list[int]:
    try:
        if "text" in obj:
            if not isinstance(obj["text"], str):
                raise TypeError("text must be a string")
            ids = tokenizer(obj["text"])["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(obj["messages"], tokenize=True,
                                                add_generation_prompt=False)
            if not isinstance(ids, list):  # a BatchEncoding in transformers 5
                ids = ids["input_ids"]
    except KconvertError:
        raise
    except Exception as exc:
        raise KconvertError(f"cannot tokenize: {exc}", file=where) from exc
    return [int(i) for i in ids]


# ----------------------------------------------------------------------------- model pieces

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


class _Context:
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


class _MoE(nn.Module):
    """DeepseekV3MoE with our routed-expert loop, which gathers each expert's tokens and
    accumulates the REAP and activation statistics. `gate` and `shared_experts` are
    transformers' own modules (same names, so the checkpoint's tensors load into them)."""

    def __init__(self, cfg, ctx: _Context, experts: _Experts, device: torch.device):
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
        self.amax_in = torch.zeros(n, dtype=torch.float32, device=device)
        self.amax_down = torch.zeros(n, dtype=torch.float32, device=device)
        self.sq_in = torch.zeros(n, hidden, **f64)
        self.sq_down = torch.zeros(n, inter, **f64)
        # With `capture`, the real rows of every batch's input and their top-k expert ids are
        # kept (SparseGPT builds each expert's Hessian from them); `captured()` joins them.
        self.capture = False
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
            norms[rows] = torch.linalg.vector_norm(f, dim=-1, dtype=torch.float32)
            # A token reaches an expert at most once: no repeated index, a plain += is exact
            # (and far cheaper than index_add_ on a busy multi-threaded CPU).
            out[tok[rows]] += f.float() * w[rows, None]
            _accumulate(xe, self.amax_in[e], self.sq_in[e])
            _accumulate(a, self.amax_down[e], self.sq_down[e])
            start += c
        n = self.n_experts
        self.count += counts
        self.gate_sum += torch.bincount(exp, weights=w.double(), minlength=n)
        self.reap_sum += torch.bincount(exp, weights=(w * norms).double(), minlength=n)
        self.ean_sum += torch.bincount(exp, weights=norms.double(), minlength=n)
        return out

    def captured(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [tokens, hidden], top-k expert ids [tokens, k]) of every real token."""
        if len(self._inputs) > 1:  # joined once; later calls reuse the joined tensors
            self._inputs, self._indices = [torch.cat(self._inputs)], [torch.cat(self._indices)]
        return self._inputs[0], self._indices[0]

    def expert_inputs(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs of gate/up, inputs of down) over the tokens routed to `expert`."""
        x, idx = self.captured()
        xe = x[(idx == expert).any(-1)]
        gate, up = nn.functional.linear(xe, self.experts.gate_up[expert]).chunk(2, dim=-1)
        return xe, self.act_fn(gate) * up

    def results(self, layer: int) -> dict[str, torch.Tensor]:
        count = self.count.cpu()
        reap_sum = self.reap_sum.cpu()
        saliency = torch.where(count > 0, reap_sum / count.clamp(min=1), 0.0)
        base = f"layers.{layer}"
        out = {f"{base}.count": count, f"{base}.saliency": saliency,
               f"{base}.reap_sum": reap_sum, f"{base}.gate_sum": self.gate_sum.cpu(),
               f"{base}.ean_sum": self.ean_sum.cpu()}
        amax_in, amax_down = self.amax_in.cpu(), self.amax_down.cpu()
        sq_in, sq_down = self.sq_in.float().cpu(), self.sq_down.float().cpu()
        for e in range(self.n_experts):
            for proj, amax, sq in (("gate_proj", amax_in, sq_in), ("up_proj", amax_in, sq_in),
                                   ("down_proj", amax_down, sq_down)):
                key = f"layers.{layer}.experts.{e}.{proj}"
                out[f"{key}.input_amax"] = amax[e].clone()
                out[f"{key}.input_sq_sum"] = sq[e].clone()
        return out


# ----------------------------------------------------------------------------- layer loading

@dataclass
class _Layer:
    module: nn.Module  # transformers' DeepseekV3DecoderLayer, weights loaded
    moe: _MoE | None
    linear_stats: dict[str, _LinearStats]  # checkpoint module -> accumulator (non-expert)
    hooks: list = field(default_factory=list)


def _read(ckpt: Checkpoint, info: TensorInfo) -> torch.Tensor:
    return ckpt.reader_for(info).read(info)


def _decode_one(ckpt: Checkpoint, m: ModulePlan, device: torch.device, dtype: torch.dtype
                ) -> torch.Tensor:
    t = {p: _read(ckpt, m.params[p]).to(device).unsqueeze(0) for p in m.codec.params}
    return m.codec.decode(t, m.shape)[0].to(dtype)


def _load_experts(ckpt: Checkpoint, cfg, modules: list[ModulePlan], layer: int,
                  device: torch.device, dtype: torch.dtype) -> _Experts:
    n, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    by_id: dict[int, dict[str, ModulePlan]] = {}
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
    groups: dict[tuple, list[tuple[int, str, ModulePlan]]] = {}
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


def _load_layer(ckpt: Checkpoint, cfg, layer: int, tensors: dict[str, TensorInfo],
                ctx: _Context, device: torch.device, dtype: torch.dtype) -> _Layer:
    """transformers' decoder layer L holding exactly the checkpoint's layer-L tensors."""
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
        moe = _MoE(cfg, ctx, _load_experts(ckpt, cfg, experts, layer, device, dtype), device)
        module.mlp = moe
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise KconvertError(f"layer {layer} does not match the config: {exc}",
                            tensor=prefix.rstrip(".")) from exc
    module.eval()

    linear_stats: dict[str, _LinearStats] = {}
    hooks = []
    for rel, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            acc = linear_stats[prefix + rel] = _LinearStats(sub.in_features, device)
            hooks.append(sub.register_forward_pre_hook(
                lambda _mod, args, acc=acc: acc.add(ctx.real_rows(args[0]))))
    return _Layer(module, moe, linear_stats, hooks)


def _layer_tensors(ckpt: Checkpoint, n_layers: int) -> dict[int, dict[str, TensorInfo]]:
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


def _embed(ckpt: Checkpoint, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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


# ----------------------------------------------------------------------------- calibrate

def calibrate(
    ckpt: Checkpoint,
    input_ids: torch.Tensor,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    *,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    hidden_on_device: bool | None = None,
    meta: dict | None = None,
    on_layer: Callable[[int, torch.Tensor], None] | None = None,
    on_moe: Callable[[int, _MoE], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> CalibrationStats:
    """One layer-streamed pass over `input_ids` [num_seqs, seq_len]; see the module docstring.

    `attention_mask` (1 real, 0 padding) is optional: PAD_ID entries of `input_ids` are
    padding too. Positions are 0..seq_len-1 in every sequence. `batch_size` sequences run
    through a layer at a time; the hidden states of all tokens are kept in `dtype` on the
    device (`hidden_on_device` None: when they take at most a third of its free memory) or
    else in CPU memory. `on_layer(L, hidden)` sees layer L's output hidden states [num_seqs,
    seq_len, hidden] (for tests and debugging); `on_moe(L, moe)` sees MoE layer L after its
    forward, weights still loaded and inputs captured (`moe.expert_inputs(e)`: SparseGPT's
    Hessians); `meta` is merged into the recorded meta.
    """
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    device = torch.device(device)
    if input_ids.dim() != 2 or input_ids.dtype != torch.long or not input_ids.numel():
        raise KconvertError("input_ids must be a non-empty LongTensor [num_seqs, seq_len]")
    if batch_size < 1:
        raise KconvertError(f"batch size {batch_size} must be positive")
    valid = input_ids != PAD_ID
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise KconvertError("attention_mask must have the shape of input_ids")
        valid &= attention_mask.bool()
    n_seq, seq_len = input_ids.shape
    all_valid = bool(valid.all())
    cfg = model_config(ckpt)
    n_layers = cfg.num_hidden_layers
    layer_tensors = _layer_tensors(ckpt, n_layers)
    say = progress or (lambda _msg: None)

    t0 = time.perf_counter()
    hidden = _embed(ckpt, torch.where(valid, input_ids, PAD_ID), dtype)
    if device.type == "cuda":
        if hidden_on_device is None:
            free = torch.cuda.mem_get_info(device)[0]
            hidden_on_device = hidden.numel() * hidden.element_size() * 3 <= free
        hidden = hidden.to(device) if hidden_on_device else hidden.pin_memory()
    rotary = DeepseekV3RotaryEmbedding(cfg).to(device)
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    pos_emb = rotary(torch.empty(0, device=device, dtype=dtype), positions)
    valid_dev = valid.to(device)
    ctx = _Context()

    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, str] = {}
    timing = []
    for layer in range(n_layers):
        t_layer = time.perf_counter()
        loaded = _load_layer(ckpt, cfg, layer, layer_tensors[layer], ctx, device, dtype)
        if loaded.moe is not None:
            loaded.moe.capture = on_moe is not None
        t_loaded = time.perf_counter()
        with torch.no_grad():
            for start in range(0, n_seq, batch_size):
                rows = slice(start, min(start + batch_size, n_seq))
                x = hidden[rows].to(device, non_blocking=True)
                v = valid_dev[rows]
                batch_all = all_valid or bool(v.all())
                ctx.valid = None if batch_all else v
                out = loaded.module(x, attention_mask=_attention_mask(v, batch_all),
                                    position_ids=positions, position_embeddings=pos_emb)
                if not bool(torch.isfinite(out[v]).all()):
                    raise KconvertError(f"non-finite hidden states after decoder layer {layer}")
                hidden[rows].copy_(out)
        for module, acc in loaded.linear_stats.items():
            key = stats_key(module)
            modules[key] = module
            tensors[f"{key}.input_amax"] = acc.amax.cpu()
            tensors[f"{key}.input_sq_sum"] = acc.sq.float().cpu()
        if loaded.moe is not None:
            if on_moe is not None:
                on_moe(layer, loaded.moe)
            tensors.update(loaded.moe.results(layer))
            for e, names in enumerate(loaded.moe.experts.names):
                for proj, module in names.items():
                    modules[f"layers.{layer}.experts.{e}.{proj}"] = module
        tensors[f"layers.{layer}.tokens"] = torch.tensor(int(valid.sum()))
        for h in loaded.hooks:
            h.remove()
        del loaded, x, out  # free layer L's weights before layer L+1 is read
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        if on_layer is not None:
            on_layer(layer, hidden)
        done = time.perf_counter()
        timing.append({"layer": layer, "load_s": round(t_loaded - t_layer, 3),
                       "compute_s": round(done - t_loaded, 3)})
        say(f"layer {layer + 1}/{n_layers}: {done - t_layer:.1f} s "
            f"({int(valid.sum()) / max(done - t_loaded, 1e-9):,.0f} tokens/s)")

    meta_out = {
        "producer": f"kconvert {__version__}",
        "source": ckpt.identity,
        "samples": n_seq,
        "seq_len": seq_len,
        "tokens": int(valid.sum()),
        "padding_tokens": int((~valid).sum()),
        "seed": None,
        "num_hidden_layers": n_layers,
        "moe_layers": list(range(cfg.first_k_dense_replace, n_layers)),
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "routing": ROUTING_CONVENTION,
        "gate_weight": GATE_WEIGHT,
        "saliency": "REAP: mean over routed real tokens of g_j(x) * ||f_j(x)||_2, f_j = expert "
                    "output before gating; 0 for a never-routed expert",
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "seconds": round(time.perf_counter() - t0, 3),
        "timing": timing,
        **(meta or {}),
    }
    if n_layers < len(layer_tensors):
        meta_out["skipped_layers"] = sorted(set(layer_tensors) - set(range(n_layers)))
    stats = CalibrationStats(meta_out, tensors, modules)
    unrouted = [m for m, a in stats.input_amax().items()
                if a == 0.0 and parse_name(m + ".weight").role is Role.ROUTED_EXPERT]
    stats.meta["unrouted"] = sorted({m.rsplit(".", 1)[0] for m in unrouted})
    return stats


def _attention_mask(valid: torch.Tensor, all_valid: bool) -> torch.Tensor | None:
    """None (SDPA's causal kernel) when nothing is padding; else causal AND real keys, as a
    boolean [b, 1, s, s] mask. A padding query with no real key left attends to itself
    (its output is never used: real tokens never attend to it)."""
    if all_valid:
        return None
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    mask = causal & valid[:, None, None, :]
    return mask | torch.eye(s, dtype=torch.bool, device=valid.device)


# ----------------------------------------------------------------------------- command

def run_calibration(src: str, data: str, out: str, samples: int, seq_len: int, batch_size: int,
                    seed: int, device: str, dtype: str, tokenizer: str | None,
                    revision: str | None, overwrite: bool,
                    progress: Callable[[str], None]) -> CalibrationStats:
    """`kconvert calibrate`: calibrate SRC on the JSONL `data` and write the statistics to
    `out`; `progress` gets the notes, per-layer lines and the closing summary."""
    from kconvert.convert import pick_device
    from kconvert.source import open_checkpoint

    out_dir = Path(out)
    if (out_dir / META_FILE).exists() and not overwrite:
        raise KconvertError("the directory already holds statistics; pass --overwrite",
                            file=str(out_dir))
    ckpt = open_checkpoint(src, revision)
    try:
        ids = load_calibration_data(data, tokenizer or ckpt.root, samples, seq_len, seed)
        if ids.shape[0] < samples:
            progress(f"note: the data gives {_plural(ids.shape[0], 'sequence')} of {seq_len} "
                     f"tokens, fewer than --samples {samples}")
        stats = calibrate(
            ckpt, ids, pick_device(device), batch_size, dtype=getattr(torch, dtype),
            meta={"seed": seed, "data": str(Path(data).resolve())}, progress=progress)
    finally:
        ckpt.close()
    save_stats(stats, out_dir)
    progress(f"wrote {out_dir}: {_plural(stats.meta['tokens'], 'token')}, "
             f"{_plural(len(stats.moe_layers), 'MoE layer')}, {stats.meta['seconds']:.1f} s")
    return stats


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


__all__ = [
    "PAD_ID",
    "ROUTING_CONVENTION",
    "CalibrationStats",
    "calibrate",
    "load_calibration_data",
    "load_stats",
    "run_calibration",
    "save_stats",
    "stats_key",
]
