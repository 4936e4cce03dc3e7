"""ModelOpt's HF export of NVFP4 (docs/formats.md §3b): the compressed-tensors bytes with a
reciprocal scalar global scale, and its hf_quant_config.json."""

from __future__ import annotations

import torch

from kconvert.errors import KconvertError
from kconvert.formats import nvfp4
from kconvert.formats.nvfp4_ct import Nvfp4Codec


class ModeloptNvfp4Codec(Nvfp4Codec):
    """ModelOpt's HF export of NVFP4 (formats.md §3b): same bytes, reciprocal scalar scale."""

    name = "nvfp4-modelopt"
    params = ("weight", "weight_scale", "weight_scale_2")
    packed_param = "weight"

    @classmethod
    def decode(cls, t, shape):
        step = t["weight_scale"].float() * t["weight_scale_2"].float().reshape(-1, 1, 1)
        return nvfp4.decode_steps(t["weight"], step)

    @classmethod
    def unpack(cls, t):
        raise NotImplementedError("ModelOpt's reciprocal scale does not re-layout losslessly")

    @classmethod
    def specs(cls, shape, input_scale=False, group_size=nvfp4.BLOCK):
        if group_size != nvfp4.BLOCK:
            raise KconvertError(f"ModelOpt NVFP4 has block size {nvfp4.BLOCK}, not {group_size}")
        out, inp = shape
        specs = [
            ("weight", "U8", (out, inp // 2)),
            ("weight_scale", "F8_E4M3", (out, inp // nvfp4.BLOCK)),
            ("weight_scale_2", "F32", ()),
        ]
        if input_scale:
            specs.append(("input_scale", "F32", ()))
        return specs

    @classmethod
    def encode(cls, q, i, input_amax=None):
        out = {
            "weight": q.packed[i],
            "weight_scale": q.block_scales[i],
            "weight_scale_2": (1.0 / q.global_scale[i].double()).float().reshape(()),
        }
        if input_amax is not None:
            amax = torch.tensor(input_amax, dtype=torch.float32)
            out["input_scale"] = amax / nvfp4.GLOBAL_NUMERATOR  # fp32, as ModelOpt computes it
        return out
