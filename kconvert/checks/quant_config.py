"""Does every quantization_config agree with the tensors? Checks shared by `kconvert audit` and
every conversion (kconvert.structure.validate_source).

Every `quantization_config` (top level, text_config) and hf_quant_config.json is compared with
the tensors: each quantized linear is in the format the config gives it, with the scheme's bits,
type and group size and scale tensors of the right dtypes and shapes; excluded / ignored linears
carry no scales. A format or method kconvert does not know, over quantized tensors, fails:
nothing could be checked against it. A conversion follows the tensors where the config is
known but disagrees with them (FOLLOWS_TENSORS) and refuses an unknown one.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from kconvert.checks.findings import CONFIG, FLOAT_DTYPES, NVFP4, Checks, Linear, is_linear, short
from kconvert.formats.base import Codec
from kconvert.formats.dense import DenseCodec
from kconvert.formats.fp8_block import Fp8BlockCodec
from kconvert.formats.int4 import Int4Codec
from kconvert.formats.nvfp4_ct import Nvfp4Codec
from kconvert.formats.nvfp4_modelopt import ModeloptNvfp4Codec
from kconvert.formats.nvfp4_pair_bitmask import SPARSE_FLAG, Nvfp4PairBitmaskCodec

CT_FORMATS = {"pack-quantized": Int4Codec, "nvfp4-pack-quantized": Nvfp4Codec}
# ModelOpt quant_algo values whose weights are NVFP4: plain NVFP4 is W4A4 (static input_scale
# expected); the weight-only export is spelled W4A16_NVFP4 (vLLM #41769; older ModelOpt code
# NVFP4_W4A16).
MODELOPT_NVFP4 = {"NVFP4": "w4a4", "W4A16_NVFP4": "w4a16", "NVFP4_W4A16": "w4a16"}
# Disagreements a conversion resolves by following the tensors: it reads every module's format
# off its parameters (and a run that re-encodes writes a new quantization_config).
FOLLOWS_TENSORS = {"format", "scheme", "scale-layout", "hf_quant_config"}


def quant_blocks(config: dict) -> list[tuple[str, dict]]:
    """(where, qconfig) for each quantization_config: top level, then text_config."""
    out = []
    if isinstance(config.get("quantization_config"), dict):
        out.append(("quantization_config", config["quantization_config"]))
    tc = config.get("text_config")
    if isinstance(tc, dict) and isinstance(tc.get("quantization_config"), dict):
        out.append(("text_config.quantization_config", tc["quantization_config"]))
    return out


def _wildcard(pattern: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(p) for p in pattern.split("*")))


def _ct_match(name: str, target: str, linear: bool) -> bool:
    """compressed-tensors' matching: 're:' regex (re.match), exact name, or class 'Linear'."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or (target == "Linear" and linear)


def expected_format(qconfig: dict, m: Linear) -> tuple[str, type[Codec] | None, dict]:
    """(kind, codec the qconfig gives m, the scheme dict). The codec is DenseCodec for an
    unquantized module, None where the qconfig names a format kconvert does not know (kind then
    names the key and value, e.g. "quant_method 'gptq'")."""
    name, linear = m.tn.module, is_linear(m)
    method = qconfig.get("quant_method")
    if method == "compressed-tensors":
        ignore = qconfig.get("ignore") or []
        for group in (qconfig.get("config_groups") or {}).values():
            targets = group.get("targets") or []
            if any(_ct_match(name, t, linear) for t in targets):
                if any(_ct_match(name, t, linear) for t in ignore):
                    return "ct", DenseCodec, {}
                fmt = group.get("format") or qconfig.get("format")
                codec = CT_FORMATS.get(fmt)
                sparse = (qconfig.get(SPARSE_FLAG) or {}).get("layout")
                if codec is Nvfp4Codec and sparse == "pair-bitmask":
                    codec = Nvfp4PairBitmaskCodec
                return ("ct", codec, group) if codec else (f"format {fmt!r}", None, group)
        return "ct", DenseCodec, {}
    if method == "modelopt":
        algo = qconfig.get("quant_algo")
        excluded = any(_wildcard(p).fullmatch(name) or name.startswith(p + ".")
                       for p in qconfig.get("exclude_modules") or [])
        if excluded or not linear:
            return "modelopt", DenseCodec, {}
        if algo in MODELOPT_NVFP4:
            return "modelopt", ModeloptNvfp4Codec, qconfig
        return f"quant_algo {algo!r}", None, qconfig
    if method == "fp8":
        if m.codec in (Fp8BlockCodec, DenseCodec):
            return "fp8", m.codec, qconfig
        return "fp8", Fp8BlockCodec, qconfig
    return f"quant_method {method!r}", None, qconfig


def fmt_name(codec: type[Codec]) -> str:
    return {DenseCodec: "unquantized (no scale tensors)", Int4Codec: "INT4 pack-quantized",
            Nvfp4Codec: "NVFP4 (compressed-tensors)", ModeloptNvfp4Codec: "NVFP4 (ModelOpt)",
            Nvfp4PairBitmaskCodec: "NVFP4 p48 pair-bitmask (compressed-tensors)",
            Fp8BlockCodec: "FP8 block"}.get(codec, codec.name)


def check_quant_config(checks: Checks, config: dict, modules: Iterable[Linear],
                       root: Path) -> None:
    """Every quantization_config and hf_quant_config.json against the tensors."""
    Q = "quant-config"
    qconfigs = quant_blocks(config)
    linears = [m for m in modules if is_linear(m)]
    quantized = [m for m in linears if m.codec.quantized]
    if not qconfigs:
        for m in linears:
            checks.check(Q, not m.codec.quantized, "format", f"tensors are {m.codec.name} but "
                         "config.json has no quantization_config", tensor=m.primary.name)
    no_input: dict[str, list[str]] = defaultdict(list)  # ModelOpt W4A4 without input scales
    for where, qconfig in qconfigs:
        unknown: dict[str, list[Linear]] = defaultdict(list)
        for m in linears:
            kind, codec, scheme = expected_format(qconfig, m)
            if codec is None:
                unknown[kind].append(m)
                continue
            if not checks.check(Q, m.codec is codec, "format",
                                f"{where} gives this module {fmt_name(codec)} but its tensors "
                                f"are {fmt_name(m.codec)}", tensor=m.primary.name):
                continue
            if m.codec.quantized:
                _check_scheme(checks, where, kind, m, scheme, no_input)
        for kind, covered in sorted(unknown.items()):
            message = (f"{where} has {kind}, a quantization kconvert does not know; it covers "
                       f"{len(covered)} module(s), first {covered[0].tn.module}")
            if quantized:  # the tensors are quantized in some format nothing here checked
                checks.add(Q, "unknown-format", f"{message}, and the checkpoint's tensors are "
                           f"quantized ({quantized[0].codec.name}): nothing can be checked "
                           "against it", file=CONFIG)
            else:
                checks.warn(Q, "unknown-format", f"{message}; no tensor is quantized",
                            file=CONFIG)
    for m in quantized:
        group = 16 if m.codec in NVFP4 else 32
        if qconfigs:
            group = _group_size(qconfigs[0][1], m) or group
        for p, (dtypes, shape) in _param_specs(m, group).items():
            info = m.params.get(p)
            if info is None:
                continue
            ok = info.dtype in dtypes and (shape is None or tuple(info.shape) == shape)
            if shape is None and p in ("weight_scale_2", "input_scale"):
                ok = ok and tuple(info.shape) in ((), (1,))
            checks.check(Q, ok, "scale-layout", f"{p} is {info.dtype}{list(info.shape)}, "
                         f"{m.codec.name} needs {'/'.join(sorted(dtypes))}"
                         f"{list(shape) if shape else '[] or [1]'}", tensor=info.name)
    for where, names in no_input.items():
        checks.warn(Q, "scheme", f"{where} says quant_algo NVFP4, which is W4A4 (a static "
                    f"input_scale per module), but {len(names)} NVFP4 module(s) have no "
                    f"input_scale, first {names[0]}: a loader may use an uninitialised "
                    "activation scale (vLLM #49715); weight-only ModelOpt checkpoints say "
                    "quant_algo W4A16_NVFP4 (vLLM #41769)", file=CONFIG)
    if len(qconfigs) == 2:
        checks.check(Q, qconfigs[0][1] == qconfigs[1][1], "format", "top-level quantization_config "
                     "and text_config.quantization_config differ (a stale block?)", file=CONFIG)
    _check_hf_quant_config(checks, root / "hf_quant_config.json", qconfigs)


def _check_hf_quant_config(checks: Checks, hf: Path, qconfigs: list[tuple[str, dict]]) -> None:
    Q = "quant-config"
    if not hf.is_file():
        return
    try:
        quant = json.loads(hf.read_text()).get("quantization", {})
    except (json.JSONDecodeError, AttributeError) as exc:
        checks.add(Q, "hf_quant_config", f"unreadable: {exc}", file=hf.name)
        return
    mo = [b for _, b in qconfigs if b.get("quant_method") == "modelopt"]
    if not checks.check(Q, bool(mo), "hf_quant_config", "hf_quant_config.json present but "
                        "config.json's quantization_config is not ModelOpt (stale file)",
                        file=hf.name):
        return
    for key in ("quant_algo", "group_size", "exclude_modules", "kv_cache_quant_algo"):
        checks.check(Q, quant.get(key) == mo[0].get(key), "hf_quant_config",
                     f"{key} = {short(quant.get(key))} but config.json has "
                     f"{short(mo[0].get(key))}", file=hf.name)


def _group_size(qconfig: dict, m: Linear) -> int | None:
    if qconfig.get("quant_method") == "modelopt":
        return qconfig.get("group_size")
    _, _, scheme = expected_format(qconfig, m)
    weights = scheme.get("weights") if isinstance(scheme, dict) else None
    return (weights or {}).get("group_size")


def _tensor_group(m: Linear) -> int | None:
    """Elements per scale of an INT4 / NVFP4 module, read off its weight_scale's shape."""
    scale = m.params.get("weight_scale")
    if scale is None or len(scale.shape) != 2 or len(m.shape) != 2 or not scale.shape[1]:
        return None
    group, rest = divmod(m.shape[1], scale.shape[1])
    return group if not rest else None


def _check_scheme(checks: Checks, where: str, kind: str, m: Linear, scheme: dict,
                  no_input: dict[str, list[str]]) -> None:
    Q = "quant-config"
    if kind == "fp8":
        blocks = scheme.get("weight_block_size", [128, 128])
        checks.check(Q, list(blocks) == [128, 128], "scheme", f"{where} weight_block_size "
                     f"{blocks}; the FP8-block decode kconvert knows is 128x128",
                     tensor=m.primary.name)
        return
    if m.codec is ModeloptNvfp4Codec:
        checks.check(Q, scheme.get("group_size", 16) == 16, "scheme", f"{where} group_size "
                     f"{scheme.get('group_size')}, ModelOpt NVFP4 uses 16",
                     tensor=m.primary.name)
        if MODELOPT_NVFP4.get(scheme.get("quant_algo")) == "w4a4" and (
                "input_scale" not in m.params):
            no_input[where].append(m.tn.module)
        return
    weights = scheme.get("weights") or {}
    want = {"num_bits": 4, "type": "int" if m.codec is Int4Codec else "float",
            "group_size": _tensor_group(m)}
    for k, v in want.items():
        if v is not None:
            checks.check(Q, weights.get(k) == v, "scheme", f"{where} says weights.{k} = "
                         f"{weights.get(k)!r}, the tensors are {v!r}", tensor=m.primary.name)
    if m.codec is Nvfp4Codec:
        acts = scheme.get("input_activations")
        has = "input_global_scale" in m.params
        checks.check(Q, bool(acts) == has, "scheme",
                     f"{where} {'quantizes' if acts else 'does not quantize'} input activations "
                     f"but the module {'has' if has else 'has no'} input_global_scale",
                     tensor=m.primary.name)


def _param_specs(m: Linear, group: int) -> dict[str, tuple[set[str], tuple | None]]:
    """Allowed dtypes and exact shape of each parameter of m's format (None: not checked)."""
    out, inp = m.shape if len(m.shape) == 2 else (None, None)
    if m.codec is Int4Codec:
        return {"weight_packed": ({"I32"}, (out, inp // 8)),
                "weight_scale": ({"BF16", "F16", "F32"}, (out, inp // group)),
                "weight_shape": ({"I32", "I64"}, (2,))}
    if m.codec is Nvfp4Codec:
        return {"weight_packed": ({"U8"}, (out, inp // 2)),
                "weight_scale": ({"F8_E4M3"}, (out, inp // group)),
                "weight_global_scale": ({"F32"}, (1,)),
                "input_global_scale": ({"F32"}, (1,))}
    if m.codec is Nvfp4PairBitmaskCodec:
        return {"weight_sparse_packed": ({"U8"}, (out, inp // 4)),
                "weight_sparse_mask": ({"U8"}, (out, inp // 16)),
                "weight_scale": ({"F8_E4M3"}, (out, inp // group)),
                "weight_global_scale": ({"F32"}, (1,)),
                "input_global_scale": ({"F32"}, (1,))}
    if m.codec is ModeloptNvfp4Codec:
        return {"weight": ({"U8"}, (out, inp // 2)),
                "weight_scale": ({"F8_E4M3"}, (out, inp // group)),
                "weight_scale_2": ({"F32"}, None), "input_scale": ({"F32"}, None)}
    if m.codec is Fp8BlockCodec:
        return {"weight": ({"F8_E4M3"}, (out, inp)),
                "weight_scale_inv": ({"F32"}, (-(-out // 128), -(-inp // 128)))}
    return {"weight": (FLOAT_DTYPES, None)}
