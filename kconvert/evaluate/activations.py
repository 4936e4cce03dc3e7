"""W4A4 as it runs: the 4-bit quantization a serving kernel applies to the activations entering
a module, in the two forms a W4A4 checkpoint can declare (docs/formats.md §2 "W4A4
activations", §6 "W4A4: dynamic activations").

NVFP4: a module stores one per-tensor input scale: compressed-tensors' `input_global_scale`
(2688 / calibrated amax, the form of `weight_global_scale`) or ModelOpt's `input_scale`
(amax / 2688). At run time the kernel quantizes each token's activations in blocks of 16
along the input dimension, with g the stored global scale (compressed-tensors) or its
reciprocal (ModelOpt):
  block scale  s = fp8(clamp(g x (block amax x fp32(1/6)), 448))
  elements     E2M1(clamp(x x 1 / (fp32(s) x (1 / g)), +-6)), ties to even
  GEMM input   E2M1 value x fp32(s) / g
This is vLLM's reference emulation of its NVFP4 kernels (`ref_nvfp4_quant`), which its CUDA
kernel matches up to that kernel's approximate reciprocals.

MXFP4: nothing is stored; the config declares the inputs quantized at run time (Quark's
`input_tensors`, compressed-tensors' `input_activations`, both dynamic per 32 with E8M0
scales), and each block of 32 is quantized on its own amax rule's step
(kconvert.formats.mxfp4.fake_quantize, what Quark's and compressed-tensors' dynamic
quantizers compute).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kconvert.calibrate.forward import Layer
from kconvert.calibrate.input_scales import served_policy
from kconvert.calibrate.load import LayerBytes, build_layer
from kconvert.calibrate.moe import ForwardContext, MoEBlock
from kconvert.checks.quant_config import governed_name, quant_blocks
from kconvert.formats import detect_codec, mxfp4
from kconvert.formats.base import INPUT_SCALE_POLICY
from kconvert.formats.linear import module_params
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


class BlockClamps:
    """How many NVFP4 activation blocks a model's W4A4 modules quantized, and how many of
    them clamp: a block whose amax is above what the global scale can represent, FP8's 448 x
    E2M1's 6 / g, gets the block scale 448 and its largest values are cut to +-6 steps of it.
    Counted on the device (no host sync) while `counting`."""

    def __init__(self) -> None:
        self.blocks: torch.Tensor | int = 0
        self.clamped: torch.Tensor | int = 0
        self.counting = True

    def add(self, over: torch.Tensor, rows: torch.Tensor | None) -> None:
        """over [..., blocks] (bool): whether each block clamps; rows [...] (bool, None: all):
        the rows that count (real positions, rows that were quantized)."""
        if not self.counting:
            return
        if rows is None:
            self.blocks, self.clamped = self.blocks + over.numel(), self.clamped + over.sum()
            return
        rows = rows.reshape(over.shape[:-1])
        self.blocks = self.blocks + rows.sum() * over.shape[-1]
        self.clamped = self.clamped + (over & rows[..., None]).sum()

    def totals(self) -> tuple[int, int]:
        """(blocks, clamped) so far."""
        return int(self.blocks), int(self.clamped)


def fake_quantize(x: torch.Tensor, g: torch.Tensor, clamps: BlockClamps | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (K a multiple of 16) NVFP4-quantized and dequantized with the global scale
    g (a scalar, or one per row: [...]), as the W4A4 kernels quantize activations (module
    docstring); returns x's dtype. `clamps` counts its blocks (of `rows` [...], bool, where
    given) and those whose block scale clamps."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"activations of {k} features are not whole 16-element blocks")
    g = g.to(device=x.device, dtype=torch.float32)
    if g.dim():
        g = g.reshape(*x.shape[:-1], 1, 1)
    blocks = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    inv6 = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32, device=x.device)
    wanted = g * (amax * inv6)
    if clamps is not None:
        clamps.add((wanted > FP8_MAX)[..., 0], rows)
    scale = wanted.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # vLLM's order of operations: quantize with 1 / (scale x (1 / g)), dequantize with
    # scale / g (a zero scale, from a block of zeros or one below FP8's range, gives zeros).
    step = scale * (1.0 / g)
    y = (blocks.float() * torch.where(step == 0, 0.0, 1.0 / step)).clamp(-FP4_MAX, FP4_MAX)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    mag = lut[torch.bucketize(y.abs(), cut_points(x.device))]
    return (torch.where(y < 0, -mag, mag) * (scale / g)).reshape(x.shape).to(x.dtype)


def input_scales(ckpt: Checkpoint, tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """Module name -> quantization scale g of every module of a decoder layer's tensors that
    stores an input scale (empty for weight-only checkpoints), as an engine serving the
    input-scale policy the config declares runs it."""
    out = {}
    for name, info in tensors.items():
        module, param = name.rsplit(".", 1)
        if param in INPUT_SCALE_PARAMS:
            out[module] = global_input_scale(ckpt.reader_for(info).read(info), param)
    # as an engine serving the declared policy runs them (kconvert.calibrate.input_scales)
    return served_policy(declared_policy(ckpt)).served(out)


def declared_policy(ckpt: Checkpoint) -> str | None:
    """The input-scale policy a checkpoint's quantization_config declares, if any."""
    return next((q[INPUT_SCALE_POLICY] for _, q in quant_blocks(ckpt.config)
                 if INPUT_SCALE_POLICY in q), None)


def dynamic_inputs(ckpt: Checkpoint, tensors: dict[str, TensorInfo]) -> set[str]:
    """The modules of a decoder layer's tensors whose inputs the checkpoint's config declares
    quantized at run time (MXFP4 W4A4): each module in a format with such a form, asked of
    the first quantization_config that governs it, when that config is its format's family.
    Empty for weight-only checkpoints."""
    blocks = quant_blocks(ckpt.config)
    out = set()
    # A router's weight parameters without its bias (a module of the same name).
    for module, params in module_params(tensors, lambda tn: tn.role is not Role.ROUTER_BIAS
                                        ).items():
        codec = detect_codec(params)
        if codec is None or codec.dynamic_activations is None:
            continue
        for where, qconfig in blocks:
            name = governed_name(where, module)
            if name is None:
                continue
            if (qconfig.get("quant_method") == codec.config_family
                    and codec.declares_dynamic_input(qconfig, name)):
                out.add(module)
            break
    return out


def emulate(layer: nn.Module, moe: MoEBlock | None, prefix: str,
            scales: dict[str, torch.Tensor], dynamic: set[str] | frozenset = frozenset(),
            clamps: BlockClamps | None = None, ctx: ForwardContext | None = None) -> None:
    """Make a loaded decoder layer (`prefix`: its tensors' name prefix) quantize the inputs of
    every module in `scales` (NVFP4, with its g) and in `dynamic` (MXFP4) as a W4A4 kernel
    does: a pre-hook on each linear (or router), and the MoE block's routed experts through
    `MoEBlock.quantize_input`. An expert's gate/up share one quantized input, as the fused
    kernel reads one: NVFP4's with the larger g, as vLLM takes it; MXFP4's when either is
    declared (both are, in every config kconvert writes or reads). `clamps` counts the NVFP4
    blocks that clamp, over the real positions `ctx` marks (the routed experts' rows are)."""
    experts: dict[tuple[int, int], torch.Tensor] = {}
    mx_experts: set[tuple[int, int]] = set()
    for module in [*scales, *dynamic]:
        tn = parse_name(module + ".weight")
        if tn.role is Role.ROUTED_EXPERT:
            key = (1 if tn.part == "down" else 0, tn.expert)
            if module in dynamic:
                mx_experts.add(key)
            else:
                g = scales[module]
                experts[key] = torch.maximum(experts[key], g) if key in experts else g
            continue
        quantize = (mxfp4.fake_quantize if module in dynamic else
                    lambda x, g=scales[module]: fake_quantize(
                        x, g, clamps, None if ctx is None else ctx.valid))
        layer.get_submodule(module[len(prefix):]).register_forward_pre_hook(
            lambda _mod, args, q=quantize: (q(args[0]), *args[1:]))
    if (experts or mx_experts) and moe is not None:
        # Per linear (0 gate/up, 1 down), each expert's NVFP4 g (NaN: none) and MXFP4 flag.
        table = torch.full((2, moe.n_experts), math.nan)
        for (which, expert), g in experts.items():
            table[which, expert] = g
        mx = torch.zeros((2, moe.n_experts), dtype=torch.bool)
        for which, expert in mx_experts:
            mx[which, expert] = True

        def quantize_input(which: int, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
            if experts:
                g = table[which].to(x.device)[expert]
                has = ~torch.isnan(g)
                x = torch.where(has[:, None],
                                fake_quantize(x, torch.where(has, g, 1.0), clamps, has), x)
            if mx_experts:
                x = torch.where(mx[which].to(x.device)[expert][:, None],
                                mxfp4.fake_quantize(x), x)
            return x

        moe.quantize_input = quantize_input


def build_served(ckpt: Checkpoint, cfg, tensors: dict[str, TensorInfo], raw: LayerBytes,
                 ctx: ForwardContext, device: torch.device, dtype: torch.dtype,
                 clamps: BlockClamps | None = None) -> Layer:
    """A decoder layer built from its bytes (`tensors`: the layer's) for eval's forward (no
    calibration statistics), run as served: a W4A4 checkpoint's activations quantized where it
    stores input scales (NVFP4) or its config declares them quantized at run time (MXFP4);
    `clamps` counts its NVFP4 activation blocks that clamp."""
    loaded = build_layer(raw, cfg, ctx, device, dtype, stats=False)
    scales = input_scales(ckpt, tensors)
    dynamic = dynamic_inputs(ckpt, tensors)
    if scales or dynamic:
        emulate(loaded.module, loaded.moe, raw.prefix, scales, dynamic, clamps, ctx)
    return loaded
