"""MXFP4 in compressed-tensors' "mxfp4-pack-quantized" layout (docs/formats.md §6b), and what
the MXFP4 layouts share: E2M1 nibbles packed two per byte, one E8M0 byte per 32 elements."""

from __future__ import annotations

from typing import ClassVar

from kconvert.formats import ct_config, mxfp4
from kconvert.formats.base import Codec, Encoded, EncodeSpec, ParamRules, ParamSpec
from kconvert.formats.ct_config import QUANT_METHOD, scheme_for, weight_problems

# The input activations of compressed-tensors' MXFP4 (W4A4) preset, as its config serialises
# them: dynamic 4-bit float per 32, E8M0 (uint8) scales.
DYNAMIC_INPUT = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": mxfp4.BLOCK,
                 "dynamic": True, "scale_dtype": "torch.uint8"}


class Mxfp4Codec(Codec):
    """compressed-tensors "mxfp4-pack-quantized" (formats.md §6b): weight_packed uint8
    [out, in/2] and weight_scale uint8 [out, in/32] (E8M0), no per-tensor scale."""

    name = "mxfp4-compressed-tensors"
    params = ("weight_packed", "weight_scale")
    description = "MXFP4 (compressed-tensors)"
    grid = "mxfp4"
    default_group_size = mxfp4.BLOCK
    ct_format = "mxfp4-pack-quantized"
    ct_presets = ("MXFP4A16", "MXFP4")
    config_family = QUANT_METHOD
    cli_name = "mxfp4-pack-quantized"
    router_form = True
    uses_scale_rule = True
    # The encoder's packed bytes and scales, and over one chunk of its rows the candidate
    # scales' rounded values and errors (kconvert.formats.mxfp4.quantize).
    encode_bytes_per_elem = 2
    encode_chunk_bytes_per_elem = 16
    dynamic_activations = False  # W4A16 unless asked: what vLLM's MXFP4 MoE (Marlin) loads
    flavour: ClassVar[mxfp4.Flavour] = mxfp4.COMPRESSED_TENSORS

    @classmethod
    def matches(cls, infos) -> bool:
        # Both parameters are bytes: INT4 has a weight_shape, NVFP4 a global scale, ModelOpt
        # NVFP4 a weight_scale_2, an FP8 per-channel `weight` an F8 weight and float scale.
        return set(infos) == set(cls.params) and all(i.dtype == "U8" for i in infos.values())

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        out, inp = shape
        packed, scale = cls.params
        return {packed: (frozenset({"U8"}), (out, inp // 2)),
                scale: (frozenset({"U8"}), (out, inp // mxfp4.BLOCK))}

    @classmethod
    def scheme_problems(cls, where, scheme, m):
        return weight_problems(where, scheme, m, "float")

    @classmethod
    def declares_dynamic_input(cls, qconfig, name):
        group, _ = scheme_for(qconfig, name, linear=True)
        return mxfp4.declared_dynamic(name, (group or {}).get("input_activations"),
                                      DYNAMIC_INPUT, "input activations")

    @classmethod
    def write_config(cls, modules, names):
        return ct_config.write_config(modules, names)

    @classmethod
    def logical_shape(cls, infos, shape_value):
        out, half = infos[cls.params[0]].shape
        return out, half * 2

    @classmethod
    def decode(cls, t, shape):
        packed, scale = cls.params
        return mxfp4.dequantize(t[packed], t[scale])

    @classmethod
    def specs(cls, shape: tuple[int, int], input_scale: bool = False,
              group_size: int = mxfp4.BLOCK) -> list[ParamSpec]:
        out, inp = shape
        packed, scale = cls.params
        return [(packed, "U8", (out, inp // 2)), (scale, "U8", (out, inp // mxfp4.BLOCK))]

    @classmethod
    def encode(cls, w, spec: EncodeSpec, *, amax=None, codes=None) -> Encoded:
        """MXFP4 in this layout's flavour (formats.md §6): E8M0 block scales by `spec.rule`
        or `codes` (uint8 [B, M, K/32]), E2M1 elements; no per-tensor scale."""
        q = mxfp4.quantize(w, spec.rule, cls.flavour, spec.chunk_elems, codes)
        packed, scale = cls.params
        return Encoded({packed: q.packed, scale: q.scales}, q.err_sq, q.ref_sq)
