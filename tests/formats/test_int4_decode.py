"""INT4 decode checked against compressed-tensors (formats.md §1).

Every expectation here comes from compressed-tensors' compressors / quantization utilities,
from the check vectors and rules written in /work/shared/docs/formats.md, or from the source
checkpoint's bytes; kconvert's own functions only appear on the side being tested.

Acceptance criterion covered: A (INT4 decode).
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
)

from helpers import checkpoint_tensors
from kconvert.formats.int4 import Int4Codec
from oracles import (
    INT4_CHECK_CODES,
    INT4_CHECK_WORDS,
    by_module,
    ct_int4_fp32,
    expert_modules,
    int4_scheme,
)

# ------------------------------------------------------------------------------ A: INT4 decode


def test_int4_check_vector_words():
    """formats.md §1: the codes pack to 0xfba98710, 0x0000005d; CT and kconvert read them back."""
    words = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in INT4_CHECK_WORDS]],
                         dtype=torch.int32)
    codes = torch.tensor([INT4_CHECK_CODES], dtype=torch.int8)
    # compressed-tensors' own packer agrees with the documented words (it pads with nibble 0).
    assert torch.equal(pack_to_int32(codes, 4), words)
    # A 16-wide row: the 6 padding nibbles are 0, i.e. code -8.
    expected = torch.tensor([INT4_CHECK_CODES + [-8] * 6], dtype=torch.int8)
    for shape_dtype in (torch.int32, torch.int64):
        shape = torch.tensor([1, 16], dtype=shape_dtype)
        assert torch.equal(unpack_from_int32(words, 4, shape), expected)
    scale = torch.tensor([[1.0]], dtype=torch.bfloat16)  # one group of 16
    got = Int4Codec.decode({"weight_packed": words[None], "weight_scale": scale[None]}, (1, 16))
    assert got.dtype == torch.float32
    assert torch.equal(got[0], expected.float())


def int4_scheme_from_fixture_config() -> QuantizationScheme:
    """Kimi's literal INT4 block (formats.md §1) as compressed-tensors parses it."""
    from kconvert.testing.fixture_config import kimi_quantization_config

    return QuantizationConfig.model_validate(kimi_quantization_config()).config_groups["group_0"]


@pytest.mark.parametrize("shape_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_int4_decode_all_codes_before_bf16_rounding(shape_dtype):
    """Int4Codec.decode == compressed-tensors' fp32 q*scale for all 16 codes, bit for bit."""
    out_f, in_f, group = 12, 128, 32
    gen = torch.Generator().manual_seed(7)
    # Every row holds each code -8..7 exactly 8 times, in a random order.
    rows = [torch.arange(-8, 8).repeat(in_f // 16)[torch.randperm(in_f, generator=gen)]
            for _ in range(out_f)]
    codes = torch.stack(rows).to(torch.int8)
    # bf16 scales with full mantissas, so that q*scale is often not a bf16 value.
    scale = (torch.rand(out_f, in_f // group, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    packed = pack_to_int32(codes, 4)
    sd = {"weight_packed": packed, "weight_scale": scale,
          "weight_shape": torch.tensor([out_f, in_f], dtype=shape_dtype)}
    scheme = int4_scheme_from_fixture_config()

    assert torch.equal(unpack_from_int32(packed, 4, sd["weight_shape"]), codes)
    reference = ct_int4_fp32(sd, scheme)
    # The same reference written out: fp32 product of CT's unpacked codes and the scale.
    product = unpack_from_int32(packed, 4, sd["weight_shape"]).float() * \
        scale.float().repeat_interleave(group, dim=1)
    assert torch.equal(reference, product)

    got = Int4Codec.decode({"weight_packed": packed[None], "weight_scale": scale[None]},
                           (out_f, in_f))[0]
    assert got.dtype == torch.float32
    assert torch.equal(got, reference)
    # The comparison is made before bf16 rounding: CT's default (bf16) decompression differs.
    ct_bf16 = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    assert ct_bf16.dtype == torch.bfloat16
    assert not torch.equal(ct_bf16.float(), reference)
    assert torch.equal(ct_bf16, reference.to(torch.bfloat16))


@pytest.mark.parametrize("variant,shape_dtype", [("k2-int4-kimi", torch.int32),
                                                 ("k2-int4-ct", torch.int64)])
def test_int4_decode_of_fixture_checkpoint(fixture_dir, variant, shape_dtype):
    """kconvert's planner reads int32 and int64 weight_shape; its decode equals CT's in fp32."""
    from kconvert.engine.work import read_shape_values
    from kconvert.formats.linear import group_modules
    from kconvert.io.checkpoint import open_checkpoint

    src = fixture_dir(variant)
    scheme = int4_scheme(src)
    mods = by_module(checkpoint_tensors(src))
    ckpt = open_checkpoint(str(src))
    try:
        modules, _ = group_modules(ckpt.tensors, read_shape_values(ckpt))
    finally:
        ckpt.close()
    int4 = [m for m in modules if m.codec is Int4Codec]
    assert len(int4) == len(expert_modules(mods)) > 0
    for m in int4:
        sd = mods[m.module]
        assert sd["weight_shape"].dtype == shape_dtype
        assert m.shape == tuple(sd["weight_shape"].tolist())
        got = Int4Codec.decode({p: sd[p][None] for p in ("weight_packed", "weight_scale")},
                               m.shape)[0]
        assert torch.equal(got, ct_int4_fp32(sd, scheme)), m.module
