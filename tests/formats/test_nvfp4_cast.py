"""The exact MXFP4 -> NVFP4 cast (docs/formats.md §7) against ModelOpt's own numerics and
compressed-tensors' decompressors: per-tensor scale 2^(k_max - 8) shared by a fused pair, FP8
block scales 2^(k_j - k_max + 8), E2M1 codes kept (a -0 nibble too), exact blocks counted and
decoding to the source bit for bit, the rest by the block-scale rule."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme

# nvidia-modelopt is a test dependency: its cast numerics are the oracle, never skipped.
from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor
from modelopt.torch.quantization.utils.numeric_utils import (
    mxfp4_to_nvfp4_global_amax,
    mxfp4_to_nvfp4_per_block_amax,
)

from kconvert.formats import ModeloptNvfp4Codec, Mxfp4Codec, QuarkMxfp4Codec, mxfp4, nvfp4
from kconvert.formats.base import EncodeSpec
from kconvert.formats.nvfp4_cast import (
    CAST_CODECS,
    ModeloptNvfp4CastCodec,
    Nvfp4CastCodec,
    cast,
    nominal_amax,
)
from kconvert.formats.nvfp4_ct import Nvfp4Codec


def modelopt_cast(packed: torch.Tensor, e8m0: torch.Tensor, k_max: int):
    """ModelOpt's lossless cast of one MXFP4 matrix, composed of its installed numerics as its
    Kimi-K3 converter composes them (examples/_shard_cast_utils.py,
    quantize_mxfp4_to_nvfp4_lossless): the MXFP4 decode to bf16, per-block amax, FP8 block
    scales clamped to [2^-9, 448], NVFP4QTensor's quantize with weight_scale_2 = 2^(k_max-8).
    Returns (packed, FP8 block scale bytes, weight_scale_2, its lossless block count)."""
    m, half = packed.shape
    bf16 = MXFP4QTensor(torch.Size((m, 2 * half)), torch.bfloat16, packed).dequantize(
        dtype=torch.bfloat16, scale=e8m0, block_sizes=[32])
    per_block = mxfp4_to_nvfp4_per_block_amax(packed.view(m, -1, 16), e8m0)
    scale_2 = torch.tensor(2.0 ** (k_max - 8), dtype=torch.float32)
    scales = (per_block / (6.0 * scale_2)).clamp(min=2**-9, max=448).to(torch.float8_e4m3fn)
    q, block_scales, _ = NVFP4QTensor.quantize(bf16, 16, scales, scale_2, try_tensorrt=False)
    k = e8m0.to(torch.int32) - 127
    lossless = int(((k >= k_max - 17) | (e8m0 == 0)).sum())
    return q._quantized_data, block_scales.view(torch.uint8), scale_2, lossless


def canonical_zero(packed: torch.Tensor) -> torch.Tensor:
    """Packed nibbles with every -0 (0x8) written +0 (0x0), as ModelOpt writes them."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)


def mx_pair(seed: int, rows: int = 16, cols: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's gate and up in MXFP4: random bytes (every nibble, -0 among them) and E8M0
    exponents spread over 12 octaves below the pair's largest, which up holds; gate has one
    block 18 octaves down and one 30 down (outside the exact window), and an all-zero block
    with E8M0 byte 0."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (2, rows, cols // 2), dtype=torch.uint8, generator=g)
    e8m0 = (120 + torch.randint(-12, 1, (2, rows, cols // 32), generator=g)).to(torch.uint8)
    e8m0[1, 0, 0] = 122  # up's k_max (-5) is the pair's
    e8m0[0, 1, 1] = 122 - 18
    e8m0[0, 2, 3] = 122 - 30
    e8m0[0, 3, 2] = 0
    packed[0, 3, 32:48] = 0
    return packed, e8m0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_modelopt_arithmetic_gives_modelopt_cast_bytes(seed):
    packed, e8m0 = mx_pair(seed)
    amax = nominal_amax(e8m0)
    shared = amax.amax().expand(2)  # the engine gives a fused set its largest amax
    q, exact = cast(packed, e8m0, shared, "amax", "modelopt")
    k_max = max(mxfp4_to_nvfp4_global_amax(e8m0[i])[1]["k_max"] for i in range(2))
    assert k_max == -5
    for i in range(2):
        want_packed, want_scales, want_s2, lossless = modelopt_cast(packed[i], e8m0[i], k_max)
        assert torch.equal(q.global_scale[i], want_s2)
        assert torch.equal(q.block_scales[i].view(torch.uint8), want_scales)
        # ModelOpt re-quantizes the decode, which writes -0 as +0; kconvert keeps the code.
        assert torch.equal(canonical_zero(q.packed[i]), canonical_zero(want_packed))
        differ = q.packed[i] != want_packed
        assert torch.equal(canonical_zero(q.packed[i][differ]), want_packed[differ])
        assert int(exact[i]) == lossless
    assert exact.tolist() == [e8m0[0].numel() - 2, e8m0[1].numel()]


@pytest.mark.parametrize("arithmetic", ["compressed-tensors", "modelopt"])
def test_exact_blocks_decode_to_the_source_bit_for_bit(arithmetic):
    packed, e8m0 = mx_pair(3)
    q, exact = cast(packed, e8m0, nominal_amax(e8m0).amax().expand(2), "mse", arithmetic)
    src = mxfp4.dequantize(packed, e8m0)
    out = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale, arithmetic)
    same = (src.view(torch.int32) == out.view(torch.int32)).view(2, 16, -1, 32).all(-1)
    assert int(same.sum()) == int(exact.sum()) == e8m0.numel() - 2
    assert not same[0, 1, 1] and not same[0, 2, 3]  # the two blocks outside the window
    # Exact blocks are the source's bytes: codes kept, -0 included.
    kept = same.repeat_interleave(16, -1).reshape(packed.shape)
    assert torch.equal(q.packed[kept], packed[kept])
    assert bool((packed[kept] & 0xF == 8).any())
    # The manifest's numbers: the error of the fallback blocks, the source's squares.
    err = (out.double() - src.double()).square().sum((1, 2))
    torch.testing.assert_close(q.err_sq, err, rtol=1e-12, atol=0)
    torch.testing.assert_close(q.ref_sq, src.double().square().sum((1, 2)), rtol=1e-12, atol=0)
    assert float(q.err_sq[1]) == 0.0 and float(q.err_sq[0]) > 0.0


def test_compressed_tensors_reads_the_cast_as_the_source():
    """compressed-tensors' NVFP4 decompressor decodes the cast to what its MXFP4 decompressor
    decodes the source to (both in bf16, which holds every E2M1 * 2^k exactly)."""
    packed, e8m0 = mx_pair(4)
    q, exact = cast(packed, e8m0, nominal_amax(e8m0), "mse", "compressed-tensors")
    k_max = [mxfp4_to_nvfp4_global_amax(e8m0[i])[1]["k_max"] for i in range(2)]
    assert q.global_scale.tolist() == [2.0 ** (8 - k) for k in k_max]
    for i in range(2):
        src = MXFP4PackedCompressor.decompress(
            {"weight_packed": packed[i], "weight_scale": e8m0[i]},
            preset_name_to_scheme("MXFP4A16", ["Linear"]))["weight"]
        out = NVFP4PackedCompressor.decompress(
            {"weight_packed": q.packed[i], "weight_scale": q.block_scales[i],
             "weight_global_scale": q.global_scale[i].reshape(1)},
            preset_name_to_scheme("NVFP4A16", ["Linear"]))["weight"]
        same = (src.view(torch.int16) == out.view(torch.int16)).view(16, -1, 32).all(-1)
        assert int(same.sum()) == int(exact[i])


def test_a_block_2_to_the_minus_20_below_is_counted_inexact():
    """A tensor whose blocks sit at 2^0 but one at 2^-20: that block falls back to the rule
    (NVFP4 cannot hold both with one per-tensor scale), every other block is exact."""
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (1, 8, 64), dtype=torch.uint8, generator=g)
    e8m0 = torch.full((1, 8, 4), 127, dtype=torch.uint8)
    e8m0[0, 5, 2] = 127 - 20
    q, exact = cast(packed, e8m0, nominal_amax(e8m0), "mse", "compressed-tensors")
    assert int(exact[0]) == 31
    src = mxfp4.dequantize(packed, e8m0)
    out = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale)
    same = (src.view(torch.int32) == out.view(torch.int32)).view(8, 4, 32).all(-1)
    assert int(same.sum()) == 31 and not same[5, 2]


def test_zero_blocks_and_the_window_edges():
    """17 octaves below k_max is exact, 18 is not; an all-zero block is exact at any exponent
    (E8M0 byte 0 gets ModelOpt's 0x01); a byte-0 block with non-zero codes is not exact
    (ModelOpt counts it lossless but flushes it to zero)."""
    packed = torch.full((1, 1, 80), 0x11, dtype=torch.uint8)  # every element 0.5
    packed[0, 0, 48:64] = 0x80  # block 3: +0 and -0 only
    e8m0 = torch.tensor([[[127, 127 - 17, 127 - 18, 0, 0]]], dtype=torch.uint8)
    q, exact = cast(packed, e8m0, nominal_amax(e8m0), "amax", "modelopt")
    codes = q.block_scales.view(torch.uint8)[0, 0].tolist()
    assert codes[0:2] == [0x78, 0x78]  # 2^8
    assert codes[2:4] == [0x01, 0x01]  # 2^-9: 17 octaves down
    assert codes[6:8] == [0x01, 0x01]  # the zero block
    assert int(exact[0]) == 3  # blocks 0, 1, 3
    _, _, _, lossless = modelopt_cast(packed[0], e8m0[0], 0)
    assert lossless == 4  # ModelOpt also counts block 4, which its cast flushes
    out = nvfp4.dequantize(q.packed, q.block_scales, q.global_scale, "modelopt")
    assert bool((out[0, 0, 128:] == 0).all())  # 0.5 * 2^-127: below NVFP4's reach here
    assert torch.equal(out[0, 0, 96:128].view(torch.int32),
                       mxfp4.dequantize(packed, e8m0)[0, 0, 96:128].view(torch.int32))


@pytest.mark.parametrize("source", [Mxfp4Codec, QuarkMxfp4Codec])
@pytest.mark.parametrize("out", [Nvfp4Codec, ModeloptNvfp4Codec])
def test_codecs_read_both_mxfp4_layouts(source, out):
    codec = CAST_CODECS[out]
    assert codec.reads_packed(source, torch.device("cpu"))
    packed, e8m0 = mx_pair(6)
    params = dict(zip(source.params, (packed, e8m0), strict=True))
    amax = codec.packed_amax(source, params).amax().expand(2)  # the pair shares k_max
    enc = codec.encode_packed(source, params, EncodeSpec("mse"), amax)
    assert [r["cast"] for r in enc.records] == [
        {"exact_blocks": e8m0[0].numel() - 2, "blocks": e8m0[0].numel()},
        {"exact_blocks": e8m0[1].numel(), "blocks": e8m0[1].numel()}]
    decoded = codec.decode(enc.params, (16, 256))
    src = source.decode(params, (16, 256))
    assert torch.equal(decoded[1].view(torch.int32), src[1].view(torch.int32))
    assert not codec.reads_packed(Nvfp4Codec, torch.device("cpu"))
    assert issubclass(codec, out) and codec in (Nvfp4CastCodec, ModeloptNvfp4CastCodec)


def test_a_nan_exponent_is_a_nan_amax():
    e8m0 = torch.full((2, 4, 2), 127, dtype=torch.uint8)
    e8m0[1, 2, 1] = mxfp4.NAN_CODE
    amax = nominal_amax(e8m0)
    assert float(amax[0]) == 2688 * 2.0**-8 and bool(amax[1].isnan())
