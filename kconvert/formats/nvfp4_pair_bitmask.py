"""Paired-4:8 NVFP4 stored sparse: MoESQ's "pair-bitmask" layout (docs/p48.md, Sparse storage).

weight_sparse_packed uint8 [M, K/4]: the 2 kept bytes of every 4-byte chunk (one chunk = 8
elements = 4 pairs; one pair is one byte of packed NVFP4), in K order;
weight_sparse_mask uint8 [M, K/16]: 4 bits per chunk (bit i = byte i kept, exactly 2 set),
two chunks per byte, the lower chunk in the low nibble.
"""

from __future__ import annotations

import torch

from kconvert.formats import nvfp4
from kconvert.formats.base import ParamRules
from kconvert.formats.nvfp4_ct import Nvfp4Codec

P48_PAIRS = 4  # bytes (pairs of elements) per 8-element chunk
P48_KEEP = 2  # bytes kept per chunk
SPARSE_FLAG = "paired48_sparse"  # quantization_config key of the pair-bitmask layout


class Nvfp4PairBitmaskCodec(Nvfp4Codec):
    """Paired-4:8 NVFP4 stored sparse (p48.md, MoESQ's "pair-bitmask"): only the 2 kept bytes
    of every 4-byte chunk plus a 4-bit mask per chunk; ~0.65x the dense bytes, lossless."""

    name = "nvfp4-pair-bitmask"
    params = ("weight_sparse_packed", "weight_sparse_mask", "weight_scale",
              "weight_global_scale")
    packed_param = "weight_sparse_packed"
    elements_per_byte = 4  # 2 kept bytes of every 4: half the nibbles are stored
    description = "NVFP4 p48 pair-bitmask (compressed-tensors)"
    ct_layout_key = SPARSE_FLAG
    ct_layout = "pair-bitmask"
    cli_name = None  # chosen by `--storage pair-bitmask`, written in the compressed-tensors form

    @classmethod
    def param_rules(cls, shape, group_size) -> ParamRules:
        out, inp = shape
        return {"weight_sparse_packed": (frozenset({"U8"}), (out, inp // 4)),
                "weight_sparse_mask": (frozenset({"U8"}), (out, inp // 16)),
                **cls._scale_rules(shape, group_size)}

    @classmethod
    def edit_config(cls, qconfig):
        qconfig[SPARSE_FLAG] = {"layout": cls.ct_layout, "version": 1}

    @classmethod
    def unpack(cls, t):
        packed = from_pair_bitmask(t["weight_sparse_packed"], t["weight_sparse_mask"])
        return packed, t["weight_scale"], t["weight_global_scale"].reshape(-1)

    @classmethod
    def specs(cls, shape, input_scale=False, group_size=nvfp4.BLOCK):
        out, inp = shape
        dense = super().specs(shape, input_scale, group_size)
        return [("weight_sparse_packed", "U8", (out, inp // 4)),
                ("weight_sparse_mask", "U8", (out, inp // 16)), *dense[1:]]

    @classmethod
    def stored(cls, q, amax):
        dense = super().stored(q, amax)
        sparse, mask = to_pair_bitmask(dense.params.pop("weight_packed"))
        dense.params = {"weight_sparse_packed": sparse, "weight_sparse_mask": mask,
                        **dense.params}
        return dense


def kept_bytes(chunks: torch.Tensor) -> torch.Tensor:
    """Which 2 bytes of every 4-byte chunk [..., 4] (uint8) the bitmask keeps (bool).

    Every byte that is not 0x00 is kept (a p48 chunk has at most 2); a chunk with fewer keeps
    its lowest-index 0x00 bytes too, so exactly 2 are always kept and the round trip is exact.
    """
    stored = chunks != 0
    if bool((stored.sum(-1) > P48_KEEP).any()):
        raise ValueError("a chunk has more than 2 bytes that are not 0x00: not paired-4:8")
    # Rank bytes: stored ones first, then by index; keep the first 2.
    key = (~stored).to(torch.int16) * P48_PAIRS + torch.arange(P48_PAIRS, device=chunks.device,
                                                          dtype=torch.int16)
    rank = (key.unsqueeze(-1) > key.unsqueeze(-2)).sum(-1)
    return rank < P48_KEEP


def to_pair_bitmask(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense packed NVFP4 [..., M, K/2] -> (sparse_packed [..., M, K/4], mask [..., M, K/16])."""
    *lead, half = packed.shape
    if half % (2 * P48_PAIRS):
        raise ValueError(f"packed rows of {half} bytes are not whole pairs of chunks")
    chunks = packed.reshape(*lead, half // P48_PAIRS, P48_PAIRS)
    keep = kept_bytes(chunks)
    sparse = chunks[keep].reshape(*lead, half // 2)
    bits = (keep.to(torch.uint8) << torch.arange(P48_PAIRS, dtype=torch.uint8,
                                                 device=packed.device)).sum(-1, dtype=torch.uint8)
    mask = bits[..., 0::2] | (bits[..., 1::2] << 4)
    return sparse, mask


def from_pair_bitmask(sparse: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_pair_bitmask`: dense packed NVFP4 [..., M, K/2], dropped bytes 0x00."""
    *lead, quarter = sparse.shape
    bits = torch.stack((mask & 0xF, mask >> 4), dim=-1).flatten(-2)  # [..., K/8] per chunk
    keep = ((bits.unsqueeze(-1) >> torch.arange(P48_PAIRS, dtype=torch.uint8,
                                                device=mask.device)) & 1).bool()
    if bool((keep.sum(-1) != P48_KEEP).any()):
        raise ValueError("weight_sparse_mask has a chunk without exactly 2 bits set")
    dense = torch.zeros(*lead, quarter // 2, P48_PAIRS, dtype=torch.uint8, device=sparse.device)
    dense[keep] = sparse.reshape(-1)
    return dense.reshape(*lead, quarter * 2)
