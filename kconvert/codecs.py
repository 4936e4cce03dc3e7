"""On-disk formats of one linear's parameters, as codecs with batched decode/encode.

A codec turns the parameter tensors of B same-shaped linears (each stacked on a leading batch
dim) into fp32 weights [B, out, in] and back. Which codec a source module uses is read off
the parameters it has (`detect_codec`), so mixed checkpoints need no configuration.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kconvert import nvfp4, p48
from kconvert.errors import KconvertError
from kconvert.safetensors_io import TensorInfo

ParamSpec = tuple[str, str, tuple[int, ...]]  # (param suffix, safetensors dtype, shape)


class Codec:
    """Base: `params` names the parameter suffixes a module in this format has."""

    name: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    quantized: ClassVar[bool] = True

    @classmethod
    def logical_shape(cls, infos: dict[str, TensorInfo], shape_value: tuple[int, int] | None
                      ) -> tuple[int, int]:
        raise NotImplementedError

    @classmethod
    def decode(cls, t: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        raise NotImplementedError


class DenseCodec(Codec):
    """Plain floating-point `weight` (BF16 in Kimi)."""

    name = "bf16"
    params = ("weight",)
    quantized = False

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight"].shape)

    @classmethod
    def decode(cls, t, shape):
        return t["weight"].float()

    DTYPES: ClassVar[dict[str, torch.dtype]] = {"BF16": torch.bfloat16, "F32": torch.float32}

    @staticmethod
    def specs(shape: tuple[int, int], dtype: str = "BF16") -> list[ParamSpec]:
        return [("weight", dtype, shape)]

    @classmethod
    def encode(cls, w: torch.Tensor, dtype: str = "BF16") -> dict[str, torch.Tensor]:
        return {"weight": w.to(cls.DTYPES[dtype])}


class Int4Codec(Codec):
    """compressed-tensors pack-quantized INT4 (formats.md §1): what Kimi-K2-Thinking ships."""

    name = "int4-pack-quantized"
    params = ("weight_packed", "weight_scale", "weight_shape")

    @classmethod
    def logical_shape(cls, infos, shape_value):
        packed, scale = infos["weight_packed"].shape, infos["weight_scale"].shape
        if shape_value is None or len(shape_value) != 2:
            info = infos["weight_shape"]
            raise KconvertError("weight_shape is not [out, in]", file=info.file.name,
                                tensor=info.name)
        out, inp = shape_value
        ok = (
            packed == (out, inp // 8) and inp % 8 == 0 and len(scale) == 2 and scale[0] == out
            and scale[1] > 0 and inp % scale[1] == 0
        )
        if not ok:
            raise KconvertError(
                f"weight_shape {list(shape_value)} disagrees with weight_packed {list(packed)} "
                f"and weight_scale {list(scale)}",
                file=infos["weight_packed"].file.name, tensor=infos["weight_packed"].name,
            )
        return out, inp

    @classmethod
    def decode(cls, t, shape):
        """Exact q * scale in fp32 (compressed-tensors rounds this product to bf16)."""
        packed, scale = t["weight_packed"], t["weight_scale"]
        b, out, words = packed.shape
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
        # In place where possible: 2 live temporaries of the item's size instead of 3.
        codes = (packed.unsqueeze(-1) >> shifts).bitwise_and_(0xF).sub_(8)  # low nibble first
        groups = scale.shape[-1]
        q = codes.reshape(b, out, groups, -1).float()
        del codes
        return q.mul_(scale.float().unsqueeze(-1)).reshape(b, out, words * 8)


class Nvfp4Codec(Codec):
    """compressed-tensors "nvfp4-pack-quantized" (formats.md §3a)."""

    name = "nvfp4-compressed-tensors"
    params = ("weight_packed", "weight_scale", "weight_global_scale")
    packed_param = "weight_packed"
    elements_per_byte = 2  # of packed_param: two E2M1 nibbles

    @classmethod
    def logical_shape(cls, infos, shape_value):
        out, packed = infos[cls.packed_param].shape
        return out, packed * cls.elements_per_byte

    @classmethod
    def decode(cls, t, shape):
        return nvfp4.dequantize(*cls.unpack(t))

    @classmethod
    def unpack(cls, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(packed [B, M, K/2], block scales [B, M, K/block], global scales [B]): the NVFP4
        bytes themselves, for lossless re-layouts (densify) and for decode."""
        return t["weight_packed"], t["weight_scale"], t["weight_global_scale"].reshape(-1)

    @classmethod
    def specs(cls, shape: tuple[int, int], input_scale: bool = False, block: int = nvfp4.BLOCK
              ) -> list[ParamSpec]:
        out, inp = shape
        specs = [
            ("weight_packed", "U8", (out, inp // 2)),
            ("weight_scale", "F8_E4M3", (out, inp // block)),
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
            "weight_scale": q.block_scale[i],
            "weight_global_scale": q.global_scale[i].reshape(1),
        }
        if input_amax is not None:
            out["input_global_scale"] = nvfp4.global_scale(torch.tensor([input_amax]))
        return out


class Nvfp4PairBitmaskCodec(Nvfp4Codec):
    """Paired-4:8 NVFP4 stored sparse (p48.md, MoESQ's "pair-bitmask"): only the 2 kept bytes
    of every 4-byte chunk plus a 4-bit mask per chunk; ~0.65x the dense bytes, lossless."""

    name = "nvfp4-pair-bitmask"
    params = ("weight_sparse_packed", "weight_sparse_mask", "weight_scale",
              "weight_global_scale")
    packed_param = "weight_sparse_packed"
    elements_per_byte = 4  # 2 kept bytes of every 4: half the nibbles are stored

    @classmethod
    def unpack(cls, t):
        packed = p48.from_pair_bitmask(t["weight_sparse_packed"], t["weight_sparse_mask"])
        return packed, t["weight_scale"], t["weight_global_scale"].reshape(-1)

    @classmethod
    def specs(cls, shape, input_scale=False, block=nvfp4.BLOCK):
        out, inp = shape
        dense = super().specs(shape, input_scale, block)
        return [("weight_sparse_packed", "U8", (out, inp // 4)),
                ("weight_sparse_mask", "U8", (out, inp // 16)), *dense[1:]]

    @classmethod
    def encode(cls, q, i, input_amax=None):
        out = super().encode(q, i, input_amax)
        sparse, mask = p48.to_pair_bitmask(out.pop("weight_packed"))
        return {"weight_sparse_packed": sparse, "weight_sparse_mask": mask, **out}


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
    def specs(cls, shape, input_scale=False, block=nvfp4.BLOCK):
        if block != nvfp4.BLOCK:
            raise KconvertError(f"ModelOpt NVFP4 has block size {nvfp4.BLOCK}, not {block}")
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
            "weight_scale": q.block_scale[i],
            "weight_scale_2": (1.0 / q.global_scale[i].double()).float().reshape(()),
        }
        if input_amax is not None:
            amax = torch.tensor(input_amax, dtype=torch.float32)
            out["input_scale"] = amax / nvfp4.GLOBAL_NUMERATOR  # fp32, as ModelOpt computes it
        return out


class Fp8BlockCodec(Codec):
    """DeepSeek-V3 / Kimi-K2-Instruct FP8 with 128x128 block scales (formats.md §4)."""

    name = "fp8-block"
    params = ("weight", "weight_scale_inv")

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight"].shape)

    @classmethod
    def decode(cls, t, shape):
        w, s = t["weight"].float(), t["weight_scale_inv"].float()
        _, out, inp = w.shape
        s = s.repeat_interleave(128, dim=1)[:, :out].repeat_interleave(128, dim=2)[:, :, :inp]
        return w * s  # despite the name, the scale multiplies


SOURCE_CODECS: tuple[type[Codec], ...] = (
    Int4Codec, Nvfp4Codec, Nvfp4PairBitmaskCodec, ModeloptNvfp4Codec, Fp8BlockCodec, DenseCodec,
)
OUTPUT_CODECS = {"compressed-tensors": Nvfp4Codec, "modelopt": ModeloptNvfp4Codec}
# Parameters that belong to a format but that a decode does not need (W4A4 input scales).
OPTIONAL_PARAMS = {"input_scale", "input_global_scale"}


def detect_codec(infos: dict[str, TensorInfo]) -> type[Codec] | None:
    """The codec whose parameters exactly match a module's, or None (not a linear we know)."""
    names = set(infos) - OPTIONAL_PARAMS
    weight = infos.get("weight")
    for codec in SOURCE_CODECS:
        if names != set(codec.params):
            continue
        if codec is DenseCodec and weight.dtype not in ("BF16", "F16", "F32"):
            continue
        if codec is Fp8BlockCodec and weight.dtype != "F8_E4M3":
            continue
        if codec is ModeloptNvfp4Codec and weight.dtype != "U8":
            continue
        return codec
    return None
