"""W4A4 as it runs: the NVFP4 quantization a serving kernel applies to the activations entering
a module that carries a static input scale (docs/formats.md §2, "W4A4 activations").

A W4A4 module stores one per-tensor input scale: compressed-tensors' `input_global_scale`
(2688 / calibrated amax, the form of `weight_global_scale`) or ModelOpt's `input_scale`
(amax / 2688). At run time the kernel quantizes each token's activations in blocks of 16
along the input dimension, with g the stored global scale (compressed-tensors) or its
reciprocal (ModelOpt):
  block scale  s = fp8(clamp(g x (block amax x fp32(1/6)), 448))
  elements     E2M1(clamp(x x 1 / (fp32(s) x (1 / g)), +-6)), ties to even
  GEMM input   E2M1 value x fp32(s) / g
This is vLLM's reference emulation of its NVFP4 kernels (`ref_nvfp4_quant`), which its CUDA
kernel matches up to that kernel's approximate reciprocals.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kconvert.calibrate.forward import MoEBlock
from kconvert.formats.nvfp4_grid import BLOCK, E2M1, FP4_MAX, FP8_MAX, cut_points
from kconvert.io.checkpoint import Checkpoint
from kconvert.io.shards import TensorInfo
from kconvert.model.names import Role, parse_name

# The stored input scales of W4A4 NVFP4: compressed-tensors', ModelOpt's.
INPUT_SCALE_PARAMS = ("input_global_scale", "input_scale")


def global_input_scale(stored: torch.Tensor, param: str) -> torch.Tensor:
    """The quantization scale g (fp32 scalar) of a stored input scale: compressed-tensors'
    `input_global_scale` as it is, ModelOpt's `input_scale` inverted."""
    g = stored.float().reshape(-1).max()
    return 1.0 / g if param == "input_scale" else g


def fake_quantize(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 16) NVFP4-quantized and dequantized with the global scale
    g (a scalar, or one per row: [...]), as the W4A4 kernels quantize activations (module
    docstring); returns x's dtype."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"activations of {k} features are not whole 16-element blocks")
    g = g.to(device=x.device, dtype=torch.float32)
    if g.dim():
        g = g.reshape(*x.shape[:-1], 1, 1)
    blocks = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    inv6 = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32, device=x.device)
    scale = (g * (amax * inv6)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # vLLM's order of operations: quantize with 1 / (scale x (1 / g)), dequantize with
    # scale / g (a zero scale, from a block of zeros or one below FP8's range, gives zeros).
    step = scale * (1.0 / g)
    y = (blocks.float() * torch.where(step == 0, 0.0, 1.0 / step)).clamp(-FP4_MAX, FP4_MAX)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    mag = lut[torch.bucketize(y.abs(), cut_points(x.device))]
    return (torch.where(y < 0, -mag, mag) * (scale / g)).reshape(x.shape).to(x.dtype)


def input_scales(ckpt: Checkpoint, tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """Module name -> quantization scale g of every module of a decoder layer's tensors that
    stores an input scale (empty for weight-only checkpoints)."""
    out = {}
    for name, info in tensors.items():
        module, param = name.rsplit(".", 1)
        if param in INPUT_SCALE_PARAMS:
            out[module] = global_input_scale(ckpt.reader_for(info).read(info), param)
    return out


def emulate(layer: nn.Module, moe: MoEBlock | None, prefix: str,
            scales: dict[str, torch.Tensor]) -> None:
    """Make a loaded decoder layer (`prefix`: its tensors' name prefix) quantize the inputs of
    every module in `scales` as a W4A4 kernel does: a pre-hook on each linear, and the MoE
    block's routed experts through `MoEBlock.quantize_input` (gate/up share one scale, as the
    fused kernel reads one: the larger g, as vLLM takes it)."""
    experts: dict[tuple[int, int], torch.Tensor] = {}
    for module, g in scales.items():
        tn = parse_name(module + ".weight")
        if tn.role is Role.ROUTED_EXPERT:
            key = (1 if tn.proj == "down_proj" else 0, tn.expert)
            experts[key] = torch.maximum(experts[key], g) if key in experts else g
            continue
        linear = layer.get_submodule(module[len(prefix):])
        linear.register_forward_pre_hook(
            lambda _mod, args, g=g: (fake_quantize(args[0], g), *args[1:]))
    if experts and moe is not None:
        # Per linear (0 gate/up, 1 down), each expert's g; NaN: an expert without one.
        table = torch.full((2, moe.n_experts), math.nan)
        for (which, expert), g in experts.items():
            table[which, expert] = g

        def quantize_input(which: int, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
            g = table[which].to(x.device)[expert]
            has = ~torch.isnan(g)
            return torch.where(has[:, None], fake_quantize(x, torch.where(has, g, 1.0)), x)

        moe.quantize_input = quantize_input
