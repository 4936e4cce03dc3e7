"""SparseGPT with paired-4:8 masks and NVFP4 quantization in ONE loop (p48.md, "Mask selection" 3):
the OBS engine (kconvert.methods.obs) with a mask chosen per scale block.

At the start of every NVFP4 scale block the p48 mask of its chunks is chosen on the
error-updated weights by the OBS score w^2 / [U]_jj^2 (U = chol(H^-1), upper); the engine then
chooses the block's FP8 scale after that mask and quantizes each column with it, pruned
entries +0, propagating the error to the columns not yet visited. Pruning and quantization are
one loop: chaining SparseGPT then GPTQ does not preserve zeros (llm-compressor PR #2860).

Calibration inputs come from kconvert.methods.hessians (one MoE layer at a time).
"""

from __future__ import annotations

import torch

from kconvert.formats import nvfp4, p48
from kconvert.formats.linear import Transformed
from kconvert.methods import obs
from kconvert.methods.obs_method import PRECISION, ObsMethod
from kconvert.plugins.methods import SPARSEGPT


def p48_mask(wg: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The p48 mask of one scale block wg [B, M, G] by the OBS score w^2 / U_jj^2 (d [B, G]):
    in every chunk of 8, the 2 pairs whose scores sum highest."""
    score = wg.square() / d[:, None].square()
    return p48.top2_pairs(score[..., 0::2] + score[..., 1::2]).repeat_interleave(2, -1)


p48_mask.fused = "p48"  # type: ignore[attr-defined]  # the OBS kernel's own copy (obs.MaskRule)


def prune_quantize(w: torch.Tensor, u: torch.Tensor, gs: torch.Tensor, group_size: int, rule: str,
                   local_dtype: torch.dtype = torch.float32,
                   arithmetic: str = "compressed-tensors",
                   precision: str = "fp32", kernel: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint p48 prune + NVFP4 quantize of w [B, M, K] with U [B, K, K]
    (`obs.prepare_inverse`): obs.obs_quantize with `p48_mask`. Returns (W-hat [B, M, K] on the
    NVFP4 grid with pruned pairs +0, FP8 block-scale codes uint8 [B, M, K/group_size])."""
    return obs.obs_quantize(w, u, gs, group_size, rule, local_dtype, arithmetic, precision,
                            mask=p48_mask, kernel=kernel)


class SparseGpt(ObsMethod):
    """Joint p48 prune + NVFP4 quantize per scale block on calibration Hessians, each layer's
    from the already-compressed model (`hessian` "sequential") or from the unpruned source
    ("source", the default: measured on the trained tiny MoE,
    benchmarks/results/sparsegpt_hessian_tiny_moe.md)."""

    declaration = SPARSEGPT
    across_ranks = True

    def transforms(self, m) -> bool:
        return True

    def record(self) -> dict[str, object]:
        return {**super().record(), "hessian": self.hessian}

    def transform_batch(self, batch) -> Transformed:
        modules, w, codec, spec, amax = batch
        hessians = self.calibration.hessians
        out, codes, _ = obs.quantize_batches(
            w, nvfp4.tensor_scale(amax, codec.arithmetic), obs.members_of([m.tn for m in modules]),
            lambda mb: obs.HessianSplit(hessians.hessian(mb.layer, mb.expert, mb.proj), None),
            spec.group(codec), spec.rule, spec.local_dtype, codec.arithmetic, mask=p48_mask,
            budget=hessians.obs_budget(w.device), precision=PRECISION)
        return Transformed(out, codes)
