"""compressed-tensors' "nvfp4-pack-quantized" NVFP4 (docs/formats.md §3a)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kconvert.formats import ct_config, nvfp4
from kconvert.formats.base import Codec, Encoded, EncodeSpec, ParamRules, ParamSpec
from kconvert.formats.ct_config import QUANT_METHOD, weight_problems
from kconvert.formats.int4 import Int4Codec


class Nvfp4Codec(Codec):
    """compressed-tensors "nvfp4-pack-quantized" (formats.md §3a)."""

    name = "nvfp4-compressed-tensors"
    params = ("weight_packed", "weight_scale", "weight_global_scale")
    packed_param = "weight_packed"
    elements_per_byte = 2  # of packed_param: two E2M1 nibbles
    description = "NVFP4 (compressed-tensors)"
    grid = "nvfp4"
    default_group_size = nvfp4.BLOCK
    global_scale_param = "weight_global_scale"
    input_scale_param = "input_global_scale"
    ct_format = "nvfp4-pack-quantized"
    ct_presets = ("NVFP4A16", "NVFP4")
    config_family = QUANT_METHOD
    cli_name = "compressed-tensors"
    arithmetic = "compressed-tensors"
    uses_scale_rule = True
    sparse_forms = frozenset({(16, "dense"), (32, "dense"), (16, "pair-bitmask"),
                              (32, "pair-bitmask")})
    # The encoder's packed bytes, scales and per-row errors, and over one chunk of its rows
    # the scale candidates, rounded values and errors (kconvert.formats.nvfp4.quantize).
    encode_bytes_per_elem = 2
    encode_chunk_bytes_per_elem = 16

    # The stored shape of the per-tensor scales: [1] here; None where any shape is read.
    scale_shape: ClassVar[tuple[int, ...] | None] = (1,)

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        out, inp = shape
        return {cls.packed_param: (frozenset({"U8"}), (out, inp // 2)),
                **cls._scale_rules(shape, group_size)}

    @classmethod
    def _scale_rules(cls, shape, group_size) -> ParamRules:
        out, inp = shape
        return {"weight_scale": (frozenset({"F8_E4M3"}), (out, inp // group_size)),
                cls.global_scale_param: (frozenset({"F32"}), cls.scale_shape),
                cls.input_scale_param: (frozenset({"F32"}), cls.scale_shape)}

    @classmethod
    def scheme_problems(cls, where, scheme, m):
        problems = weight_problems(where, scheme, m, "float")
        acts, has = scheme.get("input_activations"), cls.input_scale_param in m.params
        if bool(acts) != has:
            problems.append(f"{where} {'quantizes' if acts else 'does not quantize'} input "
                            f"activations but the module {'has' if has else 'has no'} "
                            f"{cls.input_scale_param}")
        return problems

    @classmethod
    def write_config(cls, modules, names):
        return ct_config.write_config(modules, names)

    @classmethod
    def logical_shape(cls, infos, shape_value):
        out, packed = infos[cls.packed_param].shape
        return out, packed * cls.elements_per_byte

    @classmethod
    def decode(cls, t, shape):
        return nvfp4.dequantize(*cls.unpack(t))

    @classmethod
    def unpack(cls, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(packed [B, M, K/2], block scales [B, M, K/group_size], global scales [B]): the NVFP4
        bytes themselves, for lossless re-layouts (densify) and for decode."""
        return t["weight_packed"], t["weight_scale"], t["weight_global_scale"].reshape(-1)

    @classmethod
    def specs(cls, shape: tuple[int, int], input_scale: bool = False, group_size: int = nvfp4.BLOCK
              ) -> list[ParamSpec]:
        out, inp = shape
        specs = [
            ("weight_packed", "U8", (out, inp // 2)),
            ("weight_scale", "F8_E4M3", (out, inp // group_size)),
            ("weight_global_scale", "F32", (1,)),
        ]
        if input_scale:
            specs.append(("input_global_scale", "F32", (1,)))
        return specs

    @classmethod
    def encode(cls, w, spec: EncodeSpec, *, amax=None, codes=None) -> Encoded:
        """NVFP4 in this flavour's scale arithmetic (formats.md §2): per-tensor scales from
        `amax` (each matrix's own when not given), FP8 block scales by `spec.rule` or `codes`
        (uint8 [B, M, K/group]), E2M1 elements."""
        if amax is None:
            amax = torch.maximum(w.amax(dim=(1, 2)), w.amin(dim=(1, 2)).neg())
        q = nvfp4.quantize(w, amax, spec.rule, spec.chunk_elems, local_dtype=spec.local_dtype,
                           group_size=spec.group(cls), block_codes=codes,
                           arithmetic=cls.arithmetic)
        return cls.stored(q, amax)

    @classmethod
    def reads_packed(cls, source, device):
        """INT4 on a CPU: the fused kernel decodes while it encodes (about 4x faster than an
        fp32 decode first; same bytes, tested)."""
        return source is Int4Codec and device.type == "cpu"

    @classmethod
    def packed_amax(cls, source, params):
        return nvfp4.int4_amax(params["weight_packed"], params["weight_scale"])

    @classmethod
    def encode_packed(cls, source, params, spec, amax):
        q = nvfp4.quantize_int4(params["weight_packed"], params["weight_scale"], amax,
                                spec.rule, spec.group(cls), spec.chunk_elems,
                                arithmetic=cls.arithmetic)
        return cls.stored(q, amax)

    @classmethod
    def stored(cls, q: nvfp4.Quantized, amax: torch.Tensor) -> Encoded:
        """The parameters of an NVFP4 encoding as this layout stores them."""
        return Encoded({"weight_packed": q.packed, "weight_scale": q.block_scales,
                        "weight_global_scale": q.global_scale.reshape(-1, 1)},
                       q.err_sq, q.ref_sq,
                       nvfp4.recorded_scale(q.global_scale, amax, cls.arithmetic))

    @classmethod
    def relayout(cls, source, params):
        """Another layout of NVFP4 (pair-bitmask) re-laid out: its packed bytes and scales as
        they are, so its error is 0 and its amax is the one its global scale was made for."""
        if source.arithmetic != cls.arithmetic:
            raise NotImplementedError(f"{source.description} does not re-lay out losslessly as "
                                      f"{cls.description}")
        packed, scales, gs = source.unpack(params)
        zero = torch.zeros(packed.shape[0], dtype=torch.float64, device=packed.device)
        amax = nvfp4.GLOBAL_NUMERATOR / gs
        return cls.stored(nvfp4.Quantized(packed, scales, gs, zero, zero), amax), amax

    @classmethod
    def stored_global_scale(cls, recorded, amax):
        scale = nvfp4.stored_scale(torch.tensor([recorded]), torch.tensor([amax]),
                                   cls.arithmetic)
        one_block = nvfp4.Quantized(
            packed=torch.zeros(1, 1, 8, dtype=torch.uint8),
            block_scales=torch.zeros(1, 1, 1, dtype=torch.float8_e4m3fn),
            global_scale=scale,
            err_sq=torch.zeros(1, dtype=torch.float64), ref_sq=torch.zeros(1, dtype=torch.float64))
        return cls.stored(one_block, torch.tensor([amax])).module(0)[cls.global_scale_param]

    @classmethod
    def input_scale(cls, input_amax):
        return {"input_global_scale": nvfp4.global_scale(torch.tensor([input_amax]))}
