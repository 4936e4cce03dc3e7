"""The checks behind `kconvert audit --serve`: what a serving engine's loader depends on, read
off the stored tensors and the config (kconvert.audit.serve says which engine runs which, and
from which of its sources each rule comes). Each check returns its problems; none: it passed.

They read only what they need: a few rows of each NVFP4 matrix (its per-tensor scale decoded
both ways), the per-tensor input scales, the routers' biases; the rest is names and shapes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kconvert.audit.context import Side
from kconvert.checks.findings import text_config
from kconvert.checks.quant_config import expected_format, governed_name, quant_blocks
from kconvert.formats import nvfp4_modelopt
from kconvert.formats.base import Linear, is_linear
from kconvert.formats.ct_config import tensor_group
from kconvert.formats.nvfp4_modelopt import modelopt_view
from kconvert.io.checkpoint import CONFIG
from kconvert.io.shards import TensorInfo
from kconvert.model.arch import arch_of
from kconvert.model.expert_parallel import COMMON_EP_SIZES, ep_divisors, splits_on_common_ep
from kconvert.model.names import Role

# Rows of each NVFP4 matrix decoded under both readings of its per-tensor scale.
DECODED_ROWS = 4
# The largest |w| a reading of a per-tensor scale may give: 2688 = 448 x 6 is what an FP8 block
# scale times an E2M1 value reaches with a per-tensor scale of 1, and no trained linear's
# weights need a per-tensor scale below 1 (formats.md §2: gs = 2688 / amax).
PLAUSIBLE_MAX = 2688.0
# The NVFP4 block size every engine's NVFP4 kernels read (p48's 32 needs MoESQ's patched vLLM).
NVFP4_BLOCK = 16


class Problem(NamedTuple):
    message: str
    file: str | None = None
    tensor: str | None = None
    fails: bool = True  # False: what a passed check reports (the EP sizes that work)


@dataclass
class Served:
    """A checkpoint as the serve checks read it."""

    side: Side

    @property
    def config(self) -> dict:
        return self.side.ckpt.config

    @property
    def text(self) -> dict:
        return text_config(self.config)

    @property
    def linears(self) -> list[Linear]:
        return [m for m in self.side.modules.values() if is_linear(m)]

    def file_of(self, info: TensorInfo) -> str:
        return info.file.name

    def read_rows(self, info: TensorInfo, rows: int) -> torch.Tensor:
        """The first `rows` rows of a tensor (all of a tensor of fewer than 2 dims)."""
        if len(info.shape) < 2:
            return self.side.read(info)
        n = min(rows, info.shape[0])
        raw = torch.empty(info.nbytes // info.shape[0] * n, dtype=torch.uint8)
        self.side.read_into(info, raw)
        return raw.view(info.torch_dtype).reshape(n, *info.shape[1:])

    def experts_per_layer(self) -> dict[int, set[int]]:
        """MoE layer -> the routed expert ids its tensors hold (MTP layers included)."""
        out: dict[int, set[int]] = defaultdict(set)
        for m in self.side.modules.values():
            if m.tn.role is Role.ROUTED_EXPERT and m.tn.expert is not None:
                out[m.tn.layer].add(m.tn.expert)
        return dict(out)

    def n_routed(self) -> int | None:
        n = self.text.get("n_routed_experts", self.text.get("num_experts"))
        return n if isinstance(n, int) and not isinstance(n, bool) else None


Check = Callable[[Served], list[Problem]]


def block_problems(served: Served) -> list[Problem]:
    """NVFP4 matrices in blocks other than 16 (p48 --group-size 32): no engine's NVFP4 kernel
    reads them; one problem per block size, naming its first matrix."""
    first: dict[int, Linear] = {}
    count: dict[int, int] = defaultdict(int)
    for m in served.linears:
        group = tensor_group(m) if m.codec.grid == "nvfp4" else None
        if group not in (None, NVFP4_BLOCK):
            first.setdefault(group, m)
            count[group] += 1
    return [Problem(f"{count[g]} NVFP4 matrices in blocks of {g}, first this one; the engines' "
                    f"NVFP4 kernels read blocks of {NVFP4_BLOCK}", served.file_of(m.primary),
                    m.primary.name) for g, m in sorted(first.items())]


def quantized_names(served: Served) -> list[Problem]:
    """Every stored-quantized linear is quantized by the config (its targets), every
    unquantized one is ignored / excluded, and a fused set is all one or all the other."""
    out = []
    for where, qconfig in quant_blocks(served.config):
        for m in served.linears:
            name = governed_name(where, m.tn.module)
            if name is None:
                continue
            _, codec, _ = expected_format(qconfig, m, name)
            if codec is None or codec.quantized == m.codec.quantized:
                continue
            if m.codec.quantized:
                said = (f"stored {m.codec.description}, but {where} leaves {name!r} unquantized "
                        "(its ignore/exclude list or no target covers it): the engine builds a "
                        "plain layer and finds no plain weight")
            else:
                said = (f"stored unquantized, but {where} quantizes {name!r} (no ignore/exclude "
                        f"entry covers it): the engine builds a {codec.description} layer for "
                        "plain weights (SGLang PR #18370: attention quantized by mistake)")
            out.append(Problem(said, CONFIG, m.primary.name))
    fused: dict[str, set[bool]] = defaultdict(set)
    first: dict[str, Linear] = {}
    for m in served.linears:
        fused[m.tn.fused_set].add(m.codec.quantized)
        first.setdefault(m.tn.fused_set, m)
    for key, kinds in sorted(fused.items()):
        if len(kinds) > 1:
            m = first[key]
            out.append(Problem("a fused set's members are stored part quantized, part not: the "
                               "engine loads them as one layer of one scheme",
                               served.file_of(m.primary), m.primary.name))
    return out


def _exclusions(qconfig: dict) -> list[str]:
    if qconfig.get("quant_method") == nvfp4_modelopt.QUANT_METHOD:
        return list(modelopt_view(qconfig)["exclude_modules"])
    return list(qconfig.get("ignore") or qconfig.get("exclude") or [])  # Quark: "exclude"


# The literal first component of an ignore entry: "re:" and a leading "^" dropped, up to the
# first dot (escaped or not); none where the entry starts with a wildcard or a class.
_LEADING = re.compile(r"^(?:re:)?\^?(?P<word>[A-Za-z_][A-Za-z0-9_]*)(?:\\\.|\.)")


def name_prefixes(served: Served) -> list[Problem]:
    """No ignore / exclude entry begins with a prefix the stored names lack (`language_model.`
    over plain `model.` names) or lacks the one they have (`model.` under a wrapper's
    `language_model.`), and every plain entry names a module. A wrapper's text_config block may
    use either its stored or its language-model names (writers and loaders differ)."""
    out = []
    stored = {name.rsplit(".", 1)[0] for name in served.side.tensors}
    for where, qconfig in quant_blocks(served.config):
        known = stored | {n for name in stored if (n := governed_name(where, name)) is not None}
        firsts = {n.split(".", 1)[0] for n in known}
        seconds = {parts[1] for n in known if len(parts := n.split(".", 2)) > 1}
        for entry in _exclusions(qconfig):
            if not isinstance(entry, str):
                continue
            lead = _LEADING.match(entry)
            rest = entry[lead.end():] if lead else ""
            if lead and lead["word"] not in firsts and (
                    lead["word"] in seconds or rest.split(".", 1)[0] in firsts):
                out.append(Problem(
                    f"{where}'s ignore/exclude entry {entry!r} begins with {lead['word']!r}, "
                    f"which no module name does (they begin with {', '.join(sorted(firsts))}): "
                    "the engine matches it against nothing (SGLang PR #18370)", CONFIG))
            elif (not entry.startswith("re:") and "*" not in entry
                  and not any(n == entry or n.startswith(entry + ".") for n in known)):
                out.append(Problem(f"{where}'s ignore/exclude entry {entry!r} names no stored "
                                   "module", CONFIG))
    return out


def _max_abs(w: torch.Tensor) -> float:
    return float(w.abs().max()) if w.numel() else 0.0


def global_scales(served: Served) -> list[Problem]:
    """Each NVFP4 matrix's per-tensor scale finite and positive, and its convention the one its
    format's loader reads: a few rows decoded with the stored value and with its reciprocal; a
    FAIL where only the reciprocal gives weights a trained model has (|w| <= 2688)."""
    out = []
    for m in served.linears:
        param = m.codec.global_scale_param
        if param is None or param not in m.params:
            continue
        info = m.params[param]
        stored = served.read_rows(info, DECODED_ROWS).float()
        value = float(stored.reshape(-1)[0])
        if not math.isfinite(value) or value <= 0:
            out.append(Problem(f"{param} = {value!r}: a loader divides or multiplies by it",
                               served.file_of(info), info.name))
            continue
        params = {p: served.read_rows(i, DECODED_ROWS)[None] for p, i in m.params.items()
                  if p in m.codec.params}
        rows = params[m.codec.params[0]].shape[1]
        shape = (rows, m.shape[1])
        as_stored = _max_abs(m.codec.decode(params, shape))
        params[param] = 1.0 / params[param].float()
        reciprocal = _max_abs(m.codec.decode(params, shape))
        if as_stored == 0.0:
            continue  # zero rows: neither reading can be told apart
        if not (math.isfinite(as_stored) and as_stored <= PLAUSIBLE_MAX):
            why = (f"its reciprocal gives weights up to {reciprocal:.3g}: the scale is stored in "
                   "the other flavour's convention"
                   if math.isfinite(reciprocal) and reciprocal <= PLAUSIBLE_MAX
                   else "neither it nor its reciprocal gives plausible weights")
            out.append(Problem(
                f"{param} = {value:.6g} decodes the first {rows} rows to |w| up to "
                f"{as_stored:.3g} as {m.codec.description} reads it (above {PLAUSIBLE_MAX:g}); "
                f"{why} (formats.md §2: compressed-tensors stores 2688 / amax, ModelOpt amax / "
                "2688)", served.file_of(info), info.name))
    return out


def input_scales(served: Served) -> list[Problem]:
    """W4A4: in an MoE layer where one routed expert stores an input scale every one does, and
    every stored input scale is finite and positive (vLLM #45212: a missing per-expert scale
    loads as 0, then inf, then NaN)."""
    out = []
    by_layer: dict[int, list[Linear]] = defaultdict(list)
    for m in served.linears:
        param = m.codec.input_scale_param
        if param is None:
            continue
        if m.tn.role is Role.ROUTED_EXPERT:
            by_layer[m.tn.layer].append(m)
        info = m.params.get(param)
        if info is None:
            continue
        value = float(served.side.read(info).float().reshape(-1)[0])
        if not math.isfinite(value) or value <= 0:
            out.append(Problem(f"{param} = {value!r}: the engine's activation quantizer divides "
                               "by it (inf, then NaN output)", served.file_of(info), info.name))
    for experts in by_layer.values():
        if not any(m.codec.input_scale_param in m.params for m in experts):
            continue
        for m in experts:
            if m.codec.input_scale_param not in m.params:
                out.append(Problem(f"no {m.codec.input_scale_param} while the layer's other "
                                   "experts have one (W4A4): the engine loads it as 0",
                                   served.file_of(m.primary), m.primary.name))
    return out


def router_biases(served: Served) -> list[Problem]:
    """Per MoE layer (MTP layers included) an e_score_correction_bias, F32, finite, of length
    n_routed_experts."""
    out = []
    n = served.n_routed()
    routers = served.side.routers()
    for layer in sorted(served.experts_per_layer()):
        weight, bias = routers.get(layer, (None, None))
        if bias is None:
            where = weight.name if weight is not None else None
            out.append(Problem(f"layer {layer} has routed experts but no "
                               "e_score_correction_bias", None, where))
            continue
        file = served.file_of(bias)
        if bias.dtype != "F32":
            out.append(Problem(f"stored {bias.dtype}; the engine builds it as F32 (a Kimi "
                               "release keeps it F32; AMD Quark pins the Hub revision for it)",
                               file, bias.name))
        if tuple(bias.shape) != (n,):
            out.append(Problem(f"shape {list(bias.shape)}, n_routed_experts is {n}", file,
                               bias.name))
        if not bool(torch.isfinite(served.side.read(bias).float()).all()):
            out.append(Problem("holds NaN or Inf: every token's expert choice is undefined",
                               file, bias.name))
    return out


def expert_counts(served: Served) -> list[Problem]:
    """Every MoE layer (MTP layers, num_nextn_predict_layers, included) holds the same count of
    routed experts, ids 0..N-1, N = n_routed_experts, and num_experts_per_tok <= N. A layer
    that does not is named by its shard and the tensor the engine has no place for: its first
    expert beyond N, else its router (whose rows are the experts)."""
    out = []
    n = served.n_routed()
    layers = served.experts_per_layer()
    mtp = arch_of(served.text).mtp_layers
    routers = served.side.routers()
    for layer, ids in sorted(layers.items()):
        if isinstance(n, int) and ids == set(range(n)):
            continue
        kind = "MTP layer" if layer in mtp else "layer"
        beyond = sorted(ids - set(range(n))) if isinstance(n, int) else []
        witness = next((m.primary for m in served.side.modules.values()
                        if m.tn.role is Role.ROUTED_EXPERT and m.tn.layer == layer
                        and beyond and m.tn.expert == beyond[0]), routers.get(layer, (None,))[0])
        out.append(Problem(f"{kind} {layer} holds {len(ids)} routed experts (ids "
                           f"{min(ids)}..{max(ids)}), n_routed_experts is {n}: the engine "
                           "builds every MoE layer with n_routed_experts",
                           served.file_of(witness) if witness is not None else CONFIG,
                           witness.name if witness is not None else None))
    k = served.text.get("num_experts_per_tok", served.text.get("num_experts_per_token"))
    if layers and not (isinstance(k, int) and isinstance(n, int) and 1 <= k <= n):
        out.append(Problem(f"num_experts_per_tok {k!r} is not within 1..n_routed_experts "
                           f"({n})", CONFIG))
    return out


def ep_sizes(served: Served) -> list[Problem]:
    """The expert-parallel sizes 1-16 that divide each layer's expert count; failing where no
    common size (2, 4, 8, 16) does (vLLM #52435: n_physical_experts must be divisible by
    ep_size)."""
    out = []
    for count in sorted({len(ids) for ids in served.experts_per_layer().values()}):
        sizes = ", ".join(map(str, ep_divisors(count)))
        if splits_on_common_ep(count):
            out.append(Problem(f"{count} routed experts: expert-parallel sizes {sizes} divide "
                               "it", CONFIG, fails=False))
        else:
            out.append(Problem(f"{count} routed experts: no common expert-parallel size "
                               f"({', '.join(map(str, COMMON_EP_SIZES))}) divides it, only "
                               f"{sizes} (vLLM #52435: n_physical_experts must be divisible by "
                               "ep_size)", CONFIG))
    return out


__all__ = ["Check", "Problem", "Served", "block_problems", "ep_sizes", "expert_counts",
           "global_scales", "input_scales", "name_prefixes", "quantized_names", "router_biases"]
