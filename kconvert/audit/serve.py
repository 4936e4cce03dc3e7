"""`kconvert audit CKPT --serve ENGINE[,ENGINE]`: is CKPT ready for a serving engine's loader?

One table (ENGINES) says which checks (kconvert.audit.serve_checks) each engine's loader
depends on and which of that engine's sources each rule is read from; another (READERS) which
engines read each format, as the README's "Loading the output" table says. An engine is READY
when every check it runs passed. A conversion runs the same checks on its output and warns
(`serve_warnings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kconvert.audit import serve_checks as sc
from kconvert.audit.context import Side, open_side
from kconvert.checks.findings import Checks
from kconvert.formats import (
    DenseCodec,
    Fp8BlockCodec,
    Int4Codec,
    ModeloptNvfp4Codec,
    Mxfp4Codec,
    Nvfp4Codec,
    Nvfp4PairBitmaskCodec,
    QuarkMxfp4Codec,
)
from kconvert.formats.base import Codec
from kconvert.io.checkpoint import open_checkpoint

VLLM, SGLANG, TRTLLM, TRANSFORMERS = "vllm", "sglang", "trtllm", "transformers"
ALL_ENGINES = (VLLM, SGLANG, TRTLLM, TRANSFORMERS)
AUTO = "auto"

# Which engines read each format (README.md, "Loading the output"; docs/loading.md).
READERS: dict[type[Codec], tuple[str, ...]] = {
    DenseCodec: ALL_ENGINES,
    Int4Codec: (VLLM, SGLANG),
    Fp8BlockCodec: (VLLM, SGLANG, TRTLLM),
    Nvfp4Codec: (VLLM, SGLANG),
    ModeloptNvfp4Codec: (VLLM, SGLANG, TRTLLM),
    Mxfp4Codec: (VLLM, SGLANG),
    QuarkMxfp4Codec: (VLLM, SGLANG),
    Nvfp4PairBitmaskCodec: (),
}

# The sources each engine's rules are read from (paths in each project's repository).
_V = "vllm/model_executor/layers/quantization/"
_S = "python/sglang/srt/layers/quantization/"
_T = "tensorrt_llm/_torch/"
_HF = "transformers/models/deepseek_v3/modeling_deepseek_v3.py"
TABLE = "README.md 'Loading the output' (docs/loading.md)"
EP_RULE = ("vLLM #52435 (n_physical_experts must be divisible by ep_size; FusedMoE's expert "
           "map splits each layer's experts evenly over the EP ranks)")


def formats_read(engine: str) -> sc.Check:
    """The check that every linear's format (and NVFP4 block size) is one `engine` reads."""
    def check(served: sc.Served) -> list[sc.Problem]:
        out = [sc.Problem(f"{m.codec.description} is not read by {engine}", None, m.primary.name)
               for m in _first_per_codec(served) if engine not in READERS.get(m.codec, ())]
        return out + sc.block_problems(served)
    return check


def _first_per_codec(served: sc.Served) -> list:
    seen: dict[type[Codec], object] = {}
    for m in served.linears:
        seen.setdefault(m.codec, m)
    return list(seen.values())


# engine -> check name -> (the check, the engine's source its rule comes from). Order: report's.
ENGINES: dict[str, dict[str, tuple[sc.Check, str]]] = {
    VLLM: {
        "format": (formats_read(VLLM), f"{TABLE}; {_V}compressed_tensors/schemes/"
                   "compressed_tensors_w4a4_nvfp4.py (group_size 16)"),
        "quantized-names": (sc.quantized_names, f"{_V}compressed_tensors/utils.py "
                            "should_ignore_layer (ignore list; a fused layer's members must "
                            f"agree); {_V}modelopt.py ModelOptQuantConfigBase.is_layer_excluded "
                            "(exclude_modules wildcards, full match)"),
        "name-prefix": (sc.name_prefixes, f"{_V}compressed_tensors/utils.py should_ignore_layer; "
                        f"{_V}modelopt.py is_layer_excluded; SGLang PR #18370 (language_model.)"),
        "global-scale": (sc.global_scales, f"{_V}compressed_tensors/schemes/"
                         "compressed_tensors_w4a4_nvfp4.py process_weights_after_loading "
                         "(weight_global_scale is the divisor, inverted on load); "
                         f"{_V}modelopt.py ModelOptNvFp4LinearMethod (weight_scale_2 multiplies)"),
        "input-scales": (sc.input_scales, f"{_V}compressed_tensors/compressed_tensors_moe.py "
                         f"and {_V}modelopt.py ModelOptNvFp4FusedMoE (per-expert input scales); "
                         "vLLM #45212"),
        "router-bias": (sc.router_biases, "vllm/model_executor/models/deepseek_v2.py "
                        "DeepseekV2MoE (gate.e_score_correction_bias, float32, n_routed_experts)"),
        "expert-counts": (sc.expert_counts, "vllm/model_executor/models/deepseek_v2.py and "
                          "deepseek_mtp.py (one FusedMoE of n_routed_experts per layer, MTP "
                          "layers included)"),
        "ep-sizes": (sc.ep_sizes, EP_RULE),
    },
    SGLANG: {
        "format": (formats_read(SGLANG), TABLE),
        "quantized-names": (sc.quantized_names, f"{_S}compressed_tensors/utils.py "
                            f"should_ignore_layer; {_S}modelopt_quant.py is_layer_excluded"),
        "name-prefix": (sc.name_prefixes, f"{_S}modelopt_quant.py is_layer_excluded; SGLang PR "
                        "#18370 (Kimi-K2.5 NVFP4: language_model. prefix, attention quantized "
                        "by mistake)"),
        "global-scale": (sc.global_scales, f"{_S}compressed_tensors/schemes/"
                         f"compressed_tensors_w4a4_nvfp4.py; {_S}modelopt_quant.py "
                         "ModelOptFp4LinearMethod (weight_scale_2 multiplies)"),
        "input-scales": (sc.input_scales, f"{_S}modelopt_quant.py ModelOptNvFp4FusedMoEMethod "
                         "(per-expert input_scale); vLLM #45212"),
        "router-bias": (sc.router_biases, "python/sglang/srt/models/deepseek_v2.py MoEGate "
                        "(e_score_correction_bias, float32)"),
        "expert-counts": (sc.expert_counts, "python/sglang/srt/models/deepseek_v2.py and "
                          "deepseek_nextn.py (MTP)"),
        "ep-sizes": (sc.ep_sizes, EP_RULE),
    },
    TRTLLM: {
        "format": (formats_read(TRTLLM), TABLE),
        "quantized-names": (sc.quantized_names, "tensorrt_llm/models/modeling_utils.py "
                            "QuantConfig.is_module_excluded_from_quantization (exclude_modules)"),
        "name-prefix": (sc.name_prefixes, "tensorrt_llm/models/modeling_utils.py "
                        "QuantConfig.is_module_excluded_from_quantization"),
        "global-scale": (sc.global_scales, f"{_T}modules/linear.py NVFP4LinearMethod "
                         "(weight_scale_2 and input_scale as ModelOpt stores them); "
                         "TensorRT-LLM PR #16447"),
        "input-scales": (sc.input_scales, f"{_T}modules/fused_moe/quantization.py NVFP4 MoE "
                         "method (per-expert input_scale)"),
        "router-bias": (sc.router_biases, f"{_T}models/modeling_deepseekv3.py "
                        "DeepseekV3Gate.__init__ (e_score_correction_bias, float32)"),
        "expert-counts": (sc.expert_counts, f"{_T}models/modeling_deepseekv3.py (num_experts = "
                          "n_routed_experts, MTP layers included)"),
    },
    TRANSFORMERS: {
        "format": (formats_read(TRANSFORMERS), f"{TABLE}; transformers #48371 (NVFP4 MoE "
                   "experts scaled by weight_global_scale)"),
        "router-bias": (sc.router_biases, f"{_HF} DeepseekV3TopkRouter (register_buffer "
                        "e_score_correction_bias of n_routed_experts)"),
        "expert-counts": (sc.expert_counts, f"{_HF} DeepseekV3MoE (n_routed_experts experts)"),
    },
}


@dataclass
class ServeCheck:
    name: str
    source: str
    ok: bool
    message: str = "ok"
    file: str | None = None
    tensor: str | None = None


@dataclass
class EngineResult:
    checks: list[ServeCheck] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks)


def parse_engines(spec: str | None) -> list[str] | None:
    """--serve's value: the engines named (comma-separated), or None for `auto`/no value.
    Raises ValueError naming an engine that is not one of ALL_ENGINES."""
    if spec is None or spec.strip() in ("", AUTO):
        return None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise ValueError(f"unknown engine {bad[0]!r}: choose from {', '.join(ALL_ENGINES)} "
                         f"or {AUTO} (a bare --serve before CKPT takes CKPT as its value: "
                         "put it after CKPT)")
    return list(dict.fromkeys(names))


def default_engines(side: Side) -> list[str]:
    """Every engine the README's loader table says reads all of the checkpoint's formats (none
    where NVFP4 is stored in blocks no engine reads)."""
    served = sc.Served(side)
    if sc.block_problems(served):
        return []
    codecs = {m.codec for m in served.linears} or {DenseCodec}
    return [e for e in ALL_ENGINES if all(e in READERS.get(c, ()) for c in codecs)]


def check_engines(side: Side, engines: Iterable[str] | None) -> dict[str, EngineResult]:
    """Each engine's checks on an opened checkpoint (None: the default engines)."""
    served = sc.Served(side)
    ran: dict[Callable, list[sc.Problem]] = {}
    out = {}
    for engine in default_engines(side) if engines is None else engines:
        result = EngineResult()
        for name, (check, source) in ENGINES[engine].items():
            if check not in ran:  # a check several engines share runs once
                ran[check] = check(served)
            problems = ran[check]
            if not problems:
                result.checks.append(ServeCheck(name, source, True))
            result.checks += [ServeCheck(name, source, not p.fails, p.message, p.file, p.tensor)
                              for p in problems]
        out[engine] = result
    return out


def serve_warnings(root: Path) -> list[str]:
    """One line per default engine of a finished output that is NOT READY (what a conversion
    prints at its end; it does not fail)."""
    ckpt = open_checkpoint(str(root))
    try:
        side = open_side(ckpt, Checks(), "structure")
        results = check_engines(side, None)
    finally:
        ckpt.close()
    return [f"warning: {engine} NOT READY to serve {root}: {_first_failure(result)} "
            f"(kconvert audit --serve {engine})"
            for engine, result in results.items() if not result.ready]


def _first_failure(result: EngineResult) -> str:
    c = next(c for c in result.checks if not c.ok)
    where = c.tensor or c.file or "checkpoint"
    return f"[{c.name}] {where}: {c.message}"


def serve_json(results: dict[str, EngineResult]) -> dict:
    return {engine: {"ready": r.ready, "checks": [vars(c) for c in r.checks]}
            for engine, r in results.items()}


SHOWN_FAILURES = 10  # failures of one engine listed by the table (all are in --json)


def render_serve(results: dict[str, EngineResult]) -> list[str]:
    if not results:
        return ["", "serve: no engine in the README's loader table reads this checkpoint's "
                    "formats"]
    out = ["", "serve:"]
    for engine, r in results.items():
        names = list(dict.fromkeys(c.name for c in r.checks))
        out.append(f"  {engine:<13} {'READY' if r.ready else 'NOT READY'}  "
                   f"({len(names)} checks: {', '.join(names)})")
        out += [f"    ok [{c.name}] {c.message}" for c in r.checks if c.ok and c.message != "ok"]
        failed = [c for c in r.checks if not c.ok]
        for c in failed[:SHOWN_FAILURES]:
            where = ", ".join(x for x in (c.file, c.tensor) if x) or "checkpoint"
            out.append(f"    FAIL [{c.name}] {where}: {c.message}")
            out.append(f"      rule: {c.source}")
        if len(failed) > SHOWN_FAILURES:
            out.append(f"    ... and {len(failed) - SHOWN_FAILURES} more (see --json)")
    return out
