"""Does every quantization_config agree with the tensors? Checks shared by `kconvert audit` and
every conversion (kconvert.checks.structure.validate_source).

Every `quantization_config` (top level, text_config) and hf_quant_config.json is compared with
the tensors: each quantized linear is in the format the config gives it, with the scheme's bits,
type and group size and scale tensors of the right dtypes and shapes; excluded / ignored linears
carry no scales. A format or method kconvert does not know, over quantized tensors, fails:
nothing could be checked against it. A conversion follows the tensors where the config is
known but disagrees with them (FOLLOWS_TENSORS) and refuses an unknown one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from kconvert.checks.findings import Checks, short
from kconvert.formats import (
    DenseCodec,
    ct_codec,
    ct_config,
    method_codec,
    modelopt_codec,
    mxfp4_quark,
    nvfp4_modelopt,
)
from kconvert.formats.base import Codec, Linear, is_linear
from kconvert.formats.ct_config import scheme_for
from kconvert.formats.nvfp4_modelopt import HF_QUANT_CONFIG, excluded, modelopt_view
from kconvert.io.checkpoint import CONFIG
from kconvert.model.names import language_model_name

# Disagreements a conversion resolves by following the tensors: it reads every module's format
# off its parameters (and a run that re-encodes writes a new quantization_config).
FOLLOWS_TENSORS = {"format", "scheme", "scale-layout", "hf_quant_config"}


def quant_blocks(config: dict) -> list[tuple[str, dict]]:
    """(where, qconfig) for each quantization_config: top level, then text_config (which
    governs only the language model of a K2.5/K2.6 wrapper: `governed_name`)."""
    out = []
    if isinstance(config.get("quantization_config"), dict):
        out.append(("quantization_config", config["quantization_config"]))
    tc = config.get("text_config")
    if isinstance(tc, dict) and isinstance(tc.get("quantization_config"), dict):
        out.append(("text_config.quantization_config", tc["quantization_config"]))
    return out


def governed_name(where: str, module: str) -> str | None:
    """The name the quantization_config at `where` knows `module` by, or None when that config
    does not govern it: `text_config`'s applies to the language model only, under its own
    module names (kconvert.model.names.language_model_name); the top level's to everything."""
    if where.startswith("text_config."):
        return language_model_name(module)
    return module


def _ct_expected(qconfig: dict, name: str, linear: bool) -> tuple[str, type[Codec] | None, dict]:
    group, fmt = scheme_for(qconfig, name, linear)
    if group is None:
        return "ct", DenseCodec, {}
    codec = ct_codec(fmt, qconfig)
    return ("ct", codec, group) if codec else (f"format {fmt!r}", None, group)


def _modelopt_expected(qconfig: dict, name: str, linear: bool
                       ) -> tuple[str, type[Codec] | None, dict]:
    if excluded(qconfig, name) or not linear:
        return "modelopt", DenseCodec, {}
    algo = qconfig.get("quant_algo")
    codec = modelopt_codec(algo)
    return ("modelopt", codec, qconfig) if codec else (f"quant_algo {algo!r}", None, qconfig)


# How a config family (by its quant_method) gives a module's format: (qconfig, the name the
# config knows the module by, is it a Linear) -> (kind, codec, scheme), as expected_format.
FAMILY_READERS = {ct_config.QUANT_METHOD: _ct_expected,
                  nvfp4_modelopt.QUANT_METHOD: _modelopt_expected,
                  mxfp4_quark.QUANT_METHOD: mxfp4_quark.quark_expected}


def expected_format(qconfig: dict, m: Linear, name: str | None = None
                    ) -> tuple[str, type[Codec] | None, dict]:
    """(kind, codec the qconfig gives m, the scheme dict). The codec is DenseCodec for an
    unquantized module, None where the qconfig names a format kconvert does not know (kind then
    names the key and value, e.g. "quant_method 'gptq'"). `name`: what the config calls m
    (`governed_name`), by default its checkpoint name."""
    name, linear = name or m.tn.module, is_linear(m)
    method = qconfig.get("quant_method")
    if method in FAMILY_READERS:
        return FAMILY_READERS[method](qconfig, name, linear)
    codec = method_codec(method)
    if codec is not None:  # every linear in that format, or left unquantized
        return method, m.codec if m.codec is codec or not m.codec.quantized else codec, qconfig
    return f"quant_method {method!r}", None, qconfig


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
            name = governed_name(where, m.tn.module)
            if name is None:
                continue
            kind, codec, scheme = expected_format(qconfig, m, name)
            if codec is None:
                unknown[kind].append(m)
                continue
            if not checks.check(Q, m.codec is codec, "format",
                                lambda w=where, c=codec, m=m: f"{w} gives this module "
                                f"{c.description} but its tensors are {m.codec.description}",
                                tensor=m.primary.name):
                continue
            if not m.codec.quantized:
                continue
            for problem in m.codec.scheme_problems(where, scheme, m):
                checks.add(Q, "scheme", problem, tensor=m.primary.name)
            checks.ran(Q)
            if (m.codec.modelopt_algos.get(scheme.get("quant_algo")) == "w4a4"
                    and m.codec.input_scale_param not in m.params):
                no_input[where].append(m.tn.module)
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
        group = m.codec.default_group_size
        for where, qconfig in qconfigs:
            name = governed_name(where, m.tn.module)
            if name is not None:
                group = _group_size(qconfig, m, name) or group
                break
        for p, (dtypes, shape) in m.codec.param_rules(m.shape, group).items():
            info = m.params.get(p)
            if info is None:
                continue
            ok = info.dtype in dtypes and (shape is None or tuple(info.shape) == shape)
            if shape is None and p in ("weight_scale_2", "input_scale"):
                ok = ok and tuple(info.shape) in ((), (1,))
            checks.check(Q, ok, "scale-layout", lambda p=p, info=info, m=m, dtypes=dtypes,
                         shape=shape: f"{p} is {info.dtype}{list(info.shape)}, "
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
    _check_hf_quant_config(checks, root / HF_QUANT_CONFIG, qconfigs)


def _check_hf_quant_config(checks: Checks, hf: Path, qconfigs: list[tuple[str, dict]]) -> None:
    Q = "quant-config"
    if not hf.is_file():
        return
    try:
        quant = json.loads(hf.read_text()).get("quantization", {})
    except (json.JSONDecodeError, AttributeError) as exc:
        checks.add(Q, "hf_quant_config", f"unreadable: {exc}", file=hf.name)
        return
    mo = [b for _, b in qconfigs if b.get("quant_method") == nvfp4_modelopt.QUANT_METHOD]
    if not checks.check(Q, bool(mo), "hf_quant_config", "hf_quant_config.json present but "
                        "config.json's quantization_config is not ModelOpt (stale file)",
                        file=hf.name):
        return
    said, configured = modelopt_view(quant), modelopt_view(mo[0])
    for key, value in said.items():
        checks.check(Q, value == configured[key], "hf_quant_config",
                     f"{key} = {short(value)} but config.json has {short(configured[key])}",
                     file=hf.name)


def _group_size(qconfig: dict, m: Linear, name: str) -> int | None:
    if qconfig.get("quant_method") == nvfp4_modelopt.QUANT_METHOD:
        return modelopt_view(qconfig)["group_size"]
    _, _, scheme = expected_format(qconfig, m, name)
    weights = scheme.get("weights") if isinstance(scheme, dict) else None
    return (weights or {}).get("group_size")
