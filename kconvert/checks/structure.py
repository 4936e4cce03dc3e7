"""Is a checkpoint what its config says? Checks shared by `kconvert audit` and every conversion.

The audit reports every finding; a conversion runs the same checks (and those of
kconvert.checks.quant_config) on its SOURCE after planning and before it writes anything:
`validate_source` refuses a source that fails them, with the audit's message, and returns the
quantization_config disagreements the conversion resolves by following the tensors, as
warnings.

Structure: top level and text_config agree; routing parameters in range; every layer index
within num_hidden_layers (+ MTP); dense layers hold a full MLP and no experts; per MoE layer
router rows == bias entries == expert count == the configured experts, expert ids exactly
0..N-1, every expert complete and alike; logical shapes as configured; in Kimi-K3 each layer's
attention tensors are those of the kind (KDA or MLA) its linear_attn_config gives it. Config
keys are read by the model family's names (kconvert.model.arch).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kconvert.checks.findings import (
    Checks,
    Finding,
    short,
    text_config,
)
from kconvert.checks.quant_config import FOLLOWS_TENSORS, check_quant_config
from kconvert.errors import KconvertError
from kconvert.formats import router_format
from kconvert.formats.base import Linear
from kconvert.formats.dense import FLOAT_DTYPES
from kconvert.io.checkpoint import CONFIG
from kconvert.io.shards import TensorInfo
from kconvert.model.arch import Arch, arch_of
from kconvert.model.config_check import CHECKED_KEYS, text_config_problem
from kconvert.model.names import Role, TensorName, parse_name

PARTS = {"gate", "up", "down"}
# Attention projections only one kind of Kimi-K3 layer has (both have q/o/g projections).
ONLY_IN = {"mla": {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"},
           "kda": {"q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias", "f_a_proj",
                   "f_b_proj", "b_proj"}}
SHOWN = 3  # failures a refused conversion quotes (`kconvert audit` lists every one)
# Keys that must agree between a K2.5/K2.6 config's top level and its text_config.
SEMANTIC_KEYS = {"quantization_config", "hidden_size", "num_hidden_layers", "n_routed_experts",
                 "num_experts_per_tok", "num_experts", "num_experts_per_token",
                 "vocab_size", "tie_word_embeddings",
                 "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
                 "n_group", "topk_group", "n_shared_experts", "num_attention_heads"}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_source(config: dict, tensors: dict[str, TensorInfo], modules: Iterable[Linear],
                    root: Path) -> list[str]:
    """The structure and quant-config checks on a conversion's source.

    Raises KconvertError when one fails: the audit's messages of the first few failures, how
    many there are, and the file and tensor of the first. Returns one warning line per
    disagreement the conversion resolves by following the tensors (and per audit warning),
    saying how often it was found.
    """
    modules = list(modules)
    checks = Checks()
    check_config(checks, config)
    check_layers(checks, config, tensors, modules)
    check_quant_config(checks, config, modules, root)
    refused = [f for f in checks.findings if f.severity == "fail"
               and not (f.group == "quant-config" and f.check in FOLLOWS_TENSORS)]
    if refused:
        f = refused[0]
        file = root / f.file if f.file else (tensors[f.tensor].file if f.tensor in tensors
                                             else root)
        shown = "; ".join(f"[{x.group}/{x.check}] {x.where()}: {x.message}"
                          for x in refused[:SHOWN])
        more = f"; and {len(refused) - SHOWN} more" if len(refused) > SHOWN else ""
        raise KconvertError(f"the source is not what its config says: {len(refused)} check(s) "
                            f"of `kconvert audit` fail: {shown}{more}", file=str(file),
                            tensor=f.tensor)
    followed: dict[str, list[Finding]] = defaultdict(list)
    for f in checks.findings:
        followed[f.message].append(f)
    lines = []
    for message, found in followed.items():
        what = found[0].where() if len(found) == 1 else (f"{len(found)} times, first "
                                                        f"{found[0].where()}")
        fix = "; following the tensors" if found[0].severity == "fail" else ""
        lines.append(f"{message} ({what}){fix}")
    return lines


def check_config(checks: Checks, config: dict) -> None:
    """Top level and text_config agree; routing parameters in range."""
    S = "structure"
    tc = text_config(config)
    if "text_config" in config and not isinstance(config["text_config"], dict):
        checks.add(S, "config", "text_config is not an object", file=CONFIG)
    if tc is not config:
        for key in sorted(set(config) & set(tc)):
            if key in ("model_type", "architectures", "auto_map", "quantization_config"):
                continue  # quantization_config: compared under quant-config
            same = config[key] == tc[key]
            if key in SEMANTIC_KEYS:
                checks.check(S, same, "config", f"top level {key} = {short(config[key])} but "
                             f"text_config.{key} = {short(tc[key])}", file=CONFIG)
            elif not same:
                checks.warn(S, "config", f"top level {key} = {short(config[key])} differs from "
                            f"text_config.{key} = {short(tc[key])}", file=CONFIG)
    problem = text_config_problem(tc) if isinstance(tc, dict) else None
    checks.check(S, problem is None, "config", problem or "", file=CONFIG)


@dataclass
class Layers:
    """What the layer checks saw: the MoE layers, and per layer the audit table's
    `experts` and `ids` columns."""

    moe: list[int] = field(default_factory=list)
    rows: dict[int, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))


def _int_key(checks: Checks, tc: dict, key: str, default: int | None,
             required: bool = False) -> int | None:
    """tc[key] when it is an integer; else a finding (if present, or required) and default."""
    v = tc.get(key)
    if _is_int(v):
        return v
    if (v is not None or required) and key not in CHECKED_KEYS:  # else check_config's finding
        checks.add("structure", "config", f"config has no integer {key}"
                   + (f" ({key} = {short(v)})" if v is not None else ""), file=CONFIG)
    return default


def check_layers(checks: Checks, config: dict, tensors: dict[str, TensorInfo],
                 modules: Iterable[Linear]) -> Layers:
    """Layer indices, dense and MoE layers, and the logical shapes the config gives."""
    S = "structure"
    tc = text_config(config)
    by_layer: dict[int, list[TensorName]] = defaultdict(list)
    for name in tensors:
        tn = parse_name(name)
        if tn.layer is not None:
            by_layer[tn.layer].append(tn)
    has_experts = any(tn.role is Role.ROUTED_EXPERT for tns in by_layer.values() for tn in tns)
    arch = arch_of(tc)
    n_cfg = _int_key(checks, tc, arch.experts_key, None, required=has_experts)
    n_layers = _int_key(checks, tc, "num_hidden_layers", None, required=True)
    if n_layers is None:
        n_layers = max(by_layer, default=-1) + 1
    first_k = _int_key(checks, tc, "first_k_dense_replace", 0)
    freq = _int_key(checks, tc, "moe_layer_freq", 1) or 1
    nextn = _int_key(checks, tc, "num_nextn_predict_layers", 0)
    hidden = _int_key(checks, tc, "hidden_size", None)
    moe_inter = _int_key(checks, tc, "moe_intermediate_size", None)
    inter = _int_key(checks, tc, "intermediate_size", None)
    n_shared = _int_key(checks, tc, arch.shared_key, 1) or 1
    expert_in = arch.expert_input if _is_int(arch.expert_input) else None

    total = n_layers + nextn
    for layer in sorted(by_layer):
        checks.check(S, layer < total, "layers", f"tensors of layer {layer} but "
                     f"num_hidden_layers is {n_layers} (+{nextn} MTP)", layer=layer,
                     tensor=by_layer[layer][0].name)
    for layer in range(n_layers):
        checks.check(S, layer in by_layer, "layers", "layer has no tensors at all", layer=layer)
    for layer in range(n_layers, total):
        if layer not in by_layer:
            checks.warn(S, "layers", "MTP (nextn) layer declared in config but absent",
                        layer=layer)

    out = Layers()
    # A config without a usable expert count was reported above; its MoE layers are still
    # checked (against their own expert count) rather than called dense.
    moe_model = n_cfg is not None or has_experts
    out.moe = [L for L in sorted(by_layer)
               if moe_model and first_k <= L < total and L % freq == 0]
    needs_bias = tc.get("topk_method") == "noaux_tc"
    for layer, tns in sorted(by_layer.items()):
        if layer in out.moe:
            _check_moe_layer(checks, out.rows[layer], layer, tns, tensors, n_cfg, hidden,
                             needs_bias, arch.experts_key)
            _check_attention_kind(checks, arch, layer, tns)
            continue
        roles = {tn.role for tn in tns}
        checks.check(S, Role.ROUTED_EXPERT not in roles and Role.ROUTER_WEIGHT not in roles,
                     "layers", "dense layer (first_k_dense_replace / moe_layer_freq) holds "
                     "routed experts or a router", layer=layer)
        if layer < n_layers:
            have = {tn.part for tn in tns if tn.role is Role.DENSE_MLP}
            checks.check(S, have == PARTS, "layers", f"dense MLP has projections "
                         f"{sorted(p for p in have if p)}, needs gate, up and down",
                         layer=layer)
            out.rows[layer]["experts"] = "dense"
        _check_attention_kind(checks, arch, layer, tns)
    _check_mtp_tensors(checks, by_layer, tensors, range(n_layers, total), hidden,
                       _int_key(checks, tc, "vocab_size", None))
    for m in modules:
        want = None
        if m.tn.role is Role.ROUTED_EXPERT:
            want = (moe_inter, expert_in)
        elif m.tn.role is Role.SHARED_EXPERT and moe_inter is not None:
            want = (moe_inter * n_shared, hidden)
        elif m.tn.role is Role.DENSE_MLP:
            want = (inter, hidden)
        if want is None or None in want:
            continue
        if m.tn.part == "down":
            want = (want[1], want[0])
        checks.check(S, tuple(m.shape) == want, "shape", f"logical shape {list(m.shape)}, "
                     f"config says {list(want)}", tensor=m.primary.name)
    return out


def _check_moe_layer(checks: Checks, row: dict[str, str], layer: int, tns: list[TensorName],
                     tensors: dict[str, TensorInfo], n_cfg: int | None, hidden: int | None,
                     needs_bias: bool, experts_key: str) -> None:
    S = "structure"
    router_params = {tn.param: tensors[tn.name] for tn in tns if tn.role is Role.ROUTER_WEIGHT}
    router = next((tn for tn in tns if tn.role is Role.ROUTER_WEIGHT and tn.param == "weight"),
                  None)
    bias = next((tn for tn in tns if tn.role is Role.ROUTER_BIAS), None)
    experts: dict[int, dict[str, dict[str, TensorInfo]]] = defaultdict(lambda: defaultdict(
        dict))
    for tn in tns:
        if tn.role is Role.ROUTED_EXPERT:
            experts[tn.expert][tn.proj][tn.param] = tensors[tn.name]
    ids = sorted(experts)
    row["experts"] = str(len(ids))
    counts = {experts_key: n_cfg, "expert ids": len(ids)}
    if checks.check(S, router is not None, "router", "MoE layer has no router (gate.weight)",
                    layer=layer):
        info = tensors[router.name]
        counts["router rows"] = info.shape[0] if info.shape else None
        found = router_format(router_params) if len(info.shape) == 2 else None
        if checks.check(S, found is not None or set(router_params) == {"weight"}, "router",
                        f"router parameters {sorted(router_params)} "
                        f"({', '.join(i.dtype for i in router_params.values())}) are neither "
                        "a float weight nor MXFP4", tensor=router.name) and found is None:
            checks.check(S, info.dtype in FLOAT_DTYPES, "router", f"router dtype {info.dtype} "
                         "is not floating point", tensor=router.name)
        shape = found[1] if found is not None else tuple(info.shape)
        checks.check(S, len(shape) == 2 and (hidden is None or shape[1] == hidden),
                     "router", f"router shape {list(shape)}, expected [N, {hidden}]",
                     tensor=router.name)
    if bias is not None:
        info = tensors[bias.name]
        counts["e_score_correction_bias entries"] = info.shape[0] if info.shape else None
        checks.check(S, info.dtype == "F32", "bias", f"e_score_correction_bias is {info.dtype}; "
                     "it must stay F32", tensor=bias.name)
        checks.check(S, len(info.shape) == 1, "bias", f"bias shape {list(info.shape)} is not "
                     "[N]", tensor=bias.name)
    elif needs_bias:
        checks.add(S, "bias", "topk_method noaux_tc but no gate.e_score_correction_bias",
                   layer=layer)
    values = {k: v for k, v in counts.items() if v is not None}
    if not checks.check(S, len(set(values.values())) == 1, "counts",
                        "disagree: " + ", ".join(f"{k} = {v}" for k, v in values.items()),
                        layer=layer, tensor=router.name if router else None):
        row["experts"] = " vs ".join(str(v) for v in dict.fromkeys(values.values()))
    n = n_cfg if n_cfg is not None else len(ids)
    missing = sorted(set(range(n)) - set(ids))
    extra = sorted(set(ids) - set(range(n)))
    if checks.check(S, not missing and not extra, "expert-ids",
                    f"expert ids must be exactly 0..{n - 1}: "
                    + "; ".join(s for s in (f"missing {_ranges(missing)}" if missing else "",
                                            f"unexpected {_ranges(extra)}" if extra else "") if s),
                    layer=layer):
        row["ids"] = f"0..{n - 1}" if n else "none"
    else:
        row["ids"] = f"gap: {_ranges(missing)}" if missing else f"extra: {_ranges(extra)}"
    if ids:
        _check_experts_alike(checks, layer, experts, ids)


def _mtp_shapes(hidden: int | None, vocab: int | None) -> dict[str, tuple]:
    """What each tensor only an MTP layer holds is, DeepSeek-V3's layout (docs/mtp.md): its
    own embedding copy (vLLM's MTP model loads it as its embedding), the norms of the next
    token's embedding and of the previous hidden state, the projection of the two
    concatenated, the layer's own output norm and head."""
    return {"embed_tokens.weight": (vocab, hidden), "enorm.weight": (hidden,),
            "hnorm.weight": (hidden,),
            "eh_proj.weight": (hidden, None if hidden is None else 2 * hidden),
            "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (vocab, hidden)}


def _check_mtp_tensors(checks: Checks, by_layer: dict[int, list[TensorName]],
                       tensors: dict[str, TensorInfo], mtp: range, hidden: int | None,
                       vocab: int | None) -> None:
    """Each MTP layer holds its own tensors (enorm, hnorm, eh_proj, shared_head), unquantized
    and of the config's shapes; no other layer holds any."""
    S = "structure"
    want = _mtp_shapes(hidden, vocab)
    for layer, tns in sorted(by_layer.items()):
        held = {tn.name.split(f"layers.{layer}.", 1)[1]: tn for tn in tns if tn.role is Role.MTP}
        if layer not in mtp:
            checks.check(S, not held, "layers", f"holds multi-token-prediction tensors "
                         f"{sorted(held)} but is not an MTP layer (num_nextn_predict_layers)",
                         layer=layer)
            continue
        for key, shape in want.items():
            if not checks.check(S, key in held, "layers", f"MTP layer has no {key}",
                                layer=layer):
                continue
            info = tensors[held[key].name]
            fits = len(info.shape) == len(shape) and all(
                w is None or w == got for w, got in zip(shape, info.shape, strict=True))
            checks.check(S, fits and info.dtype in FLOAT_DTYPES, "shape",
                         f"{info.dtype}{list(info.shape)}, an MTP layer's {key} is unquantized "
                         f"{[w or '?' for w in shape]}", tensor=info.name)


def _check_experts_alike(checks: Checks, layer: int,
                         experts: dict[int, dict[str, dict[str, TensorInfo]]],
                         ids: list[int]) -> None:
    """Every expert complete and alike: the layer's most common parameter set and layout."""
    S = "structure"
    projs = sorted({proj for e in ids for proj in experts[e]})  # gate/up/down_proj or w1/w2/w3
    ref_params = {proj: Counter(frozenset(p) for p in (experts[e].get(proj, {})
                                                       for e in ids)).most_common(1)[0][0]
                  for proj in projs}
    layouts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for e in ids:
        for proj, params in experts[e].items():
            for p, info in params.items():
                layouts[(proj, p)][(info.dtype, info.shape)] += 1
    commons = {key: layout.most_common(1)[0][0] for key, layout in layouts.items()}
    # Run once per expert tensor of a full-size checkpoint: a passing check builds no message
    # (docs/performance.md, planning a full-size Kimi).
    for e in ids:
        for proj in projs:
            have = set(experts[e].get(proj, {}))
            want = set(ref_params[proj])
            if not have or have != want:
                anyinfo = next(iter(next(iter(experts[e].values())).values()))
                tname = anyinfo.name.split(f".experts.{e}.")[0] + f".experts.{e}.{proj}"
                if not have:
                    checks.add(S, "experts", f"expert {e} has no {proj}", layer=layer,
                               tensor=tname)
                    continue
                checks.add(S, "experts", f"expert {e} {proj} has parameters {sorted(have)}, "
                           f"the layer's experts have {sorted(want)}"
                           + (f" (missing {sorted(want - have)})" if want - have else ""),
                           layer=layer, tensor=tname)
            checks.ran(S)
            for p, info in experts[e][proj].items():
                common = commons[(proj, p)]
                checks.check(S, (info.dtype, info.shape) == common, "experts",
                             lambda info=info, common=common: f"{info.dtype}{list(info.shape)} "
                             f"but the layer's other experts have {common[0]}{list(common[1])}",
                             layer=layer, tensor=info.name)


def _check_attention_kind(checks: Checks, arch: Arch, layer: int, tns: list[TensorName]) -> None:
    """In a model with KDA layers: the layer's attention holds no projection of the other kind
    than the one linear_attn_config gives it (0-based here, 1-based there)."""
    if not arch.kda_layers:
        return
    kind = arch.attention(layer)
    other = "mla" if kind == "kda" else "kda"
    wrong = sorted({tn.proj for tn in tns if tn.role is Role.ATTENTION} & ONLY_IN[other])
    checks.check("structure", not wrong, "attention", f"linear_attn_config makes layer {layer} "
                 f"{kind.upper()} (1-based {layer + 1}) but it holds {other.upper()} tensors "
                 f"{wrong}", layer=layer)


def _ranges(ids: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0..2,5,7..8'."""
    out, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}..{v}")
            start = None
    return ",".join(out) or "none"
