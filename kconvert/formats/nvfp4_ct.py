"""compressed-tensors' "nvfp4-pack-quantized" NVFP4 (docs/formats.md §3a)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kconvert.formats import nvfp4
from kconvert.formats.base import Codec, ParamRules, ParamSpec
from kconvert.formats.ct_config import QUANT_METHOD, weight_problems


class Nvfp4Codec(Codec):
    """compressed-tensors "nvfp4-pack-quantized" (formats.md §3a)."""

    name = "nvfp4-compressed-tensors"
    params = ("weight_packed", "weight_scale", "weight_global_scale")
    packed_param = "weight_packed"
    elements_per_byte = 2  # of packed_param: two E2M1 nibbles
    description = "NVFP4 (compressed-tensors)"
    default_group_size = nvfp4.BLOCK
    global_scale_param = "weight_global_scale"
    input_scale_param = "input_global_scale"
    ct_format = "nvfp4-pack-quantized"
    config_family = QUANT_METHOD
    cli_name = "compressed-tensors"
    arithmetic = "compressed-tensors"
    p48_forms = True

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
    def encode(cls, q: nvfp4.Quantized, i: int, input_amax: float | None = None
               ) -> dict[str, torch.Tensor]:
        out = {
            "weight_packed": q.packed[i],
            "weight_scale": q.block_scales[i],
            "weight_global_scale": q.global_scale[i].reshape(1),
        }
        if input_amax is not None:
            out["input_global_scale"] = nvfp4.global_scale(torch.tensor([input_amax]))
        return out
