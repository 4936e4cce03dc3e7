"""The ecosystem's own code as oracles: compressed-tensors' compressors and decompressors and
kconvert's outputs read back independently (shared by the format, equivalence and sparsity
tests)."""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from pathlib import Path

import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import (
    unpack_fp4_from_uint8,
)
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
    CompressedTensorsDequantizer,
)
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import (
    ModelOptNvfp4Converter,
)
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils.match import match_name
from safetensors.torch import save_file

from helpers import checkpoint_tensors, shard_files
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.formats import nvfp4
from kconvert.formats.nvfp4_ct import Nvfp4Codec

PROJS = ("gate_proj", "up_proj", "down_proj")


EXPERT_RE = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                       r"(?P<proj>gate_proj|up_proj|down_proj)$")


# formats.md §1 check vector.
INT4_CHECK_CODES = [-8, -7, -1, 0, 1, 2, 3, 7, 5, -3]


INT4_CHECK_WORDS = [0xFBA98710, 0x0000005D]


# formats.md §2 check vector.
NVFP4_CHECK_VALUES = [0.5, -1.0, 6.0, 0.0, -0.0, 3.0, -6.0, 1.5]


NVFP4_CHECK_BYTES = bytes([0xA1, 0x07, 0x58, 0x3F])


# formats.md §2 step 3: E2M1 cut points and where a value exactly on one goes (ties to even).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


TIE_POINTS = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


# Tensor names a routed expert may carry in each output flavour (formats.md §3a / §3b).
CT_PARAMS = {"weight_packed", "weight_scale", "weight_global_scale"}


MODELOPT_PARAMS = {"weight", "weight_scale", "weight_scale_2"}


def make_converter(fixture_dir, tmp_path_factory):
    """run(variant, command, **options) -> (src, dst); each distinct run is done once."""
    cache: dict = {}

    def run(variant: str, command: str = "int4-to-nvfp4", **options) -> tuple[Path, Path]:
        key = (variant, command, tuple(sorted(options.items())))
        if key not in cache:
            src = fixture_dir(variant)
            dst = tmp_path_factory.mktemp(f"{variant}-{command}") / "out"
            overrides = {} if command == "dequant" else {
                "format": options.get("format"), "block_scale": options.get("block_scale"),
                "targets": options.get("targets")}
            try:
                convert(str(src), str(dst), load_recipe(command), overrides,
                        RunControl(device="cpu", quiet=True))
                cache[key] = (src, dst)
            except Exception as exc:  # re-raised for every test that needs this output
                cache[key] = exc
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]

    return run


def raw_tensors(d: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, raw bytes), parsed straight from the safetensors files."""
    out = {}
    for path in shard_files(d):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        for name, h in header.items():
            start, end = h["data_offsets"]
            out[name] = (h["dtype"], h["shape"], data[8 + n + start:8 + n + end])
    return out


def ct_dense_tensors(d: Path) -> dict[str, torch.Tensor]:
    """fp32 dense weights of a checkpoint, decoded by compressed-tensors (not by kconvert):
    its dequantizer for its own formats, its ModelOpt converter then NVFP4 decompressor for a
    ModelOpt export."""
    tensors = checkpoint_tensors(d)
    qc = json.loads((d / "config.json").read_text()).get("quantization_config")
    if qc is None:
        return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    if qc["quant_method"] == "modelopt":
        tensors = ModelOptNvfp4Converter(targets=[r"re:.*mlp\.experts\.\d+\.\w+_proj$"]).process(
            tensors)
        scheme = nvfp4a16_scheme()
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            m = name[: -len(".weight_packed")]
            sd = {p: tensors.pop(f"{m}.{p}")
                  for p in ("weight_packed", "weight_scale", "weight_global_scale")}
            tensors[f"{m}.weight"] = NVFP4PackedCompressor.decompress(sd, scheme)["weight"]
        return {k: v.float() for k, v in tensors.items()}
    deq = CompressedTensorsDequantizer(str(d), dtype=torch.float32)
    return {k: v.float() for k, v in deq.process(tensors).items()}


def dense_copy(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A dense fp32 checkpoint at dst (a new directory) of src's tensors as compressed-tensors
    decodes them (ct_dense_tensors), its config without a quantization_config; the tensors."""
    dense = {k: v.contiguous() for k, v in ct_dense_tensors(src).items()}
    dst.mkdir()
    save_file(dense, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    return dense


def by_module(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    mods: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        mods[module][param] = t
    return dict(mods)


def expert_modules(mods: dict) -> dict[tuple[str, int, int, str], str]:
    """(prefix, layer, expert, proj) -> module name, for every routed expert linear."""
    out = {}
    for module in mods:
        m = EXPERT_RE.match(module)
        if m:
            out[(m["prefix"], int(m["layer"]), int(m["expert"]), m["proj"])] = module
    return out


def int4_scheme(src: Path) -> QuantizationScheme:
    """The INT4 scheme as compressed-tensors parses it from the source's own config.json."""
    cfg = json.loads((src / "config.json").read_text())
    block = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    return QuantizationConfig.model_validate(block).config_groups["group_0"]


def ct_int4_fp32(sd: dict[str, torch.Tensor], scheme: QuantizationScheme) -> torch.Tensor:
    """compressed-tensors' INT4 decompression with the scale in fp32: exact q * scale."""
    state = {"weight_packed": sd["weight_packed"], "weight_scale": sd["weight_scale"].float(),
             "weight_shape": sd["weight_shape"]}
    w = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert w.dtype == torch.float32
    return w


def ct_nvfp4_fp32(sd: dict[str, torch.Tensor], scheme: QuantizationScheme) -> torch.Tensor:
    """compressed-tensors' NVFP4 unpack + dequantize, kept in fp32 (its decompress ends in bf16)."""
    packed = sd["weight_packed"]
    m, n = packed.shape
    q = unpack_fp4_from_uint8(packed, m, 2 * n, dtype=torch.float32)
    return dequantize(q, scale=sd["weight_scale"].float(), args=scheme.weights,
                      global_scale=sd["weight_global_scale"], dtype=torch.float32)


def nvfp4a16_scheme() -> QuantizationScheme:
    return preset_name_to_scheme("NVFP4A16", ["Linear"])


def ct_scheme_for(module: str, qc: QuantizationConfig) -> QuantizationScheme | None:
    """The config group whose targets match `module` (None if ignored / untargeted)."""
    if any(match_name(module, ign) for ign in qc.ignore or []):
        return None
    # "Linear" is a class target; model-free, compressed-tensors takes it as every linear
    # (utils.match.match_quantizable_tensors), which is how Kimi's INT4 block targets experts.
    hits = [s for s in qc.config_groups.values()
            if any(t == "Linear" or match_name(module, t) for t in s.targets)]
    assert len(hits) <= 1, f"{module} matches {len(hits)} config groups"
    return hits[0] if hits else None


def kconvert_nvfp4(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """kconvert's decode of one compressed-tensors NVFP4 module (fp32)."""
    batch = {p: sd[p].unsqueeze(0) for p in Nvfp4Codec.params}
    return Nvfp4Codec.decode(batch, None)[0]


def dicts(obj):
    """Every dict nested anywhere in a JSON value."""
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from dicts(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from dicts(v)


def ct_reference_compress(w: torch.Tensor, gs: torch.Tensor, scale: torch.Tensor | None = None
                          ) -> dict[str, torch.Tensor]:
    """compressed-tensors' NVFP4 bytes for fp32 w with global scale gs.

    Block scales come from calculate_qparams on the per-16 min/max (what llm-compressor's
    observer hands it) unless `scale` is given.
    """
    scheme = nvfp4a16_scheme()
    if scale is None:
        blocks = w.reshape(w.shape[0], -1, nvfp4.BLOCK)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights,
                                     global_scale=gs)
    return NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


SPARSEGPT_PERCDAMP = 0.1


def inverse_by_solve(h: torch.Tensor, percdamp: float = SPARSEGPT_PERCDAMP) -> torch.Tensor:
    """obs.prepare_inverse as it was before its blocked triangular inverse: the same damping
    and flipped Cholesky, then one solve_triangular against the identity (every column a full
    right-hand side). The oracle the blocked inverse is held to."""
    h = h.float().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag += percdamp * diag.mean(-1, keepdim=True)
    lower = torch.linalg.cholesky(h.flip(-2, -1))
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype).expand_as(lower)
    return torch.linalg.solve_triangular(lower, eye, upper=False).flip(-2, -1)


def per_expert_routed(moe, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                      ) -> torch.Tensor:
    """The calibration MoE block's routed experts as computed before issue 30, as an oracle of
    "today's" statistics: a Python loop over the experts, each on its gathered tokens, the
    statistics accumulated expert by expert (bound as `MoEBlock._routed`)."""
    k = indices.shape[1]
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    exp, w = indices.reshape(-1), weights.reshape(-1).float()
    if moe.ctx.valid is not None:
        keep = moe.ctx.valid.reshape(-1)[tok]
        tok, exp, w = tok[keep], exp[keep], w[keep]
    order = torch.argsort(exp, stable=True)
    tok, exp, w = tok[order], exp[order], w[order]
    counts = torch.bincount(exp, minlength=moe.n_experts)
    xs = x[tok]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    norms = torch.empty(tok.shape[0], dtype=torch.float32, device=x.device)

    def accumulate(rows: torch.Tensor, amax: torch.Tensor, sq: torch.Tensor) -> None:
        torch.maximum(amax, torch.linalg.vector_norm(rows, ord=float("inf"),
                                                     dtype=torch.float32), out=amax)
        sq += torch.linalg.vector_norm(rows, ord=2, dim=0, dtype=torch.float32).double().square()

    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        rows = slice(start, start + c)
        xe = xs[rows]
        gate, up = torch.nn.functional.linear(xe, moe.experts.gate_up[e]).chunk(2, dim=-1)
        a = moe.act_fn(gate) * up
        f = torch.nn.functional.linear(a, moe.experts.down[e])
        out[tok[rows]] += f.float() * w[rows, None]
        start += c
        if moe.collect:
            norms[rows] = torch.linalg.vector_norm(f, dim=-1, dtype=torch.float32)
            accumulate(xe, moe.amax_in[e], moe.sq_in[e])
            accumulate(a, moe.amax_down[e], moe.sq_down[e])
    if not moe.collect:
        return out
    n = moe.n_experts
    moe.count += counts
    moe.gate_sum += torch.bincount(exp, weights=w.double(), minlength=n)
    moe.reap_sum += torch.bincount(exp, weights=(w * norms).double(), minlength=n)
    moe.ean_sum += torch.bincount(exp, weights=norms.double(), minlength=n)
    moe.ean_sq_sum += torch.bincount(exp, weights=norms.double().square(), minlength=n)
    return out
