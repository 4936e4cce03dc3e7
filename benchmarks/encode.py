"""INT4 -> NVFP4 as kconvert's engine encodes routed experts, for the benches that time the
encoder alone (convert's `_kc_compute`, cpu_matrix, cpu_engine): the one place they call
kconvert's encoder."""

from __future__ import annotations

import torch

from kconvert.formats import nvfp4
from kconvert.formats.int4 import Int4Codec


def decoded(packed: torch.Tensor, scale: torch.Tensor, rule: str,
            chunk: int | None = None) -> nvfp4.Quantized:
    """INT4 experts [B, M, K/8] decoded to fp32, their amax taken, then nvfp4.quantize (the
    engine's path on a GPU)."""
    shape = (packed.shape[1], packed.shape[2] * 8)
    w = Int4Codec.decode({"weight_packed": packed, "weight_scale": scale}, shape)
    amax = w.abs().amax(dim=(1, 2))
    return nvfp4.quantize(w, amax, rule) if chunk is None else nvfp4.quantize(w, amax, rule,
                                                                              chunk)


def fused(packed: torch.Tensor, scale: torch.Tensor, rule: str,
          chunk: int | None = None) -> nvfp4.Quantized:
    """nvfp4.int4_amax + nvfp4.quantize_int4: the INT4 decoded inside the fused kernel (the
    engine's path on a CPU)."""
    amax = nvfp4.int4_amax(packed, scale)
    if chunk is None:
        return nvfp4.quantize_int4(packed, scale, amax, rule)
    return nvfp4.quantize_int4(packed, scale, amax, rule, chunk_elems=chunk)


def as_engine(packed: torch.Tensor, scale: torch.Tensor, rule: str, chunk: int) -> None:
    """The engine's path on the tensors' device, waited for (one byte copied to the host)."""
    q = (fused if packed.device.type == "cpu" else decoded)(packed, scale, rule, chunk)
    q.packed.view(-1)[:1].cpu()
