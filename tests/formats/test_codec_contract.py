"""The codec paths the engine and the audit call through Codec alone: a re-layout (densify's),
the stored global scale of a recorded fused set, the tensors an encode writes, and the one
EncodeSpec builder."""

from __future__ import annotations

import pytest
import torch

from kconvert.formats import (
    DEFAULT_SCALE_RULE,
    DenseCodec,
    Int4Codec,
    ModeloptNvfp4Codec,
    Nvfp4Codec,
    Nvfp4PairBitmaskCodec,
    dense_storage,
    encode_spec,
)
from kconvert.formats.base import EncodeSpec


def _p48_weights(seed: int) -> torch.Tensor:
    """[2, 8, 64] fp32 weights, paired-4:8: of each 8 elements only 2 of the 4 pairs nonzero."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(2, 8, 64, generator=gen)
    pairs = w.reshape(2, 8, 8, 4, 2)
    keep = torch.rand(2, 8, 8, 4, generator=gen).argsort(-1) < 2
    return (pairs * keep.unsqueeze(-1)).reshape(2, 8, 64)


def test_a_relayout_is_the_dense_encoding_byte_for_byte():
    """Pair-bitmask NVFP4 re-laid out as dense NVFP4 is what the dense encoder writes for the
    same weights and amax; no value changes (error 0), and the amax it reports is the one its
    global scale was made for."""
    w = _p48_weights(0)
    amax = torch.tensor([3.0, 5.0])
    spec = EncodeSpec("mse")
    sparse = Nvfp4PairBitmaskCodec.encode(w, spec, amax=amax)
    relaid, relaid_amax = Nvfp4Codec.relayout(Nvfp4PairBitmaskCodec, sparse.params)
    dense = Nvfp4Codec.encode(w, spec, amax=amax)
    assert relaid.params.keys() == dense.params.keys()
    for param, t in dense.params.items():
        assert torch.equal(relaid.params[param].view(torch.uint8), t.view(torch.uint8)), param
    assert relaid.err_sq.tolist() == [0.0, 0.0]
    assert torch.equal(relaid.recorded_scale, dense.recorded_scale)
    assert torch.allclose(relaid_amax, amax, rtol=1e-6)
    assert dense_storage(Nvfp4PairBitmaskCodec) is Nvfp4Codec
    assert dense_storage(Nvfp4Codec) is None


def test_a_relayout_into_another_arithmetic_is_refused():
    sparse = Nvfp4PairBitmaskCodec.encode(_p48_weights(1), EncodeSpec("amax"))
    with pytest.raises(NotImplementedError, match="losslessly"):
        ModeloptNvfp4Codec.relayout(Nvfp4PairBitmaskCodec, sparse.params)


@pytest.mark.parametrize("codec", [Nvfp4Codec, ModeloptNvfp4Codec])
def test_the_stored_global_scale_is_the_encoders(codec):
    """What the audit expects a fused set's member to store for the manifest's record is what
    the format's own encoder wrote for that amax."""
    amax = torch.tensor([2.5])
    enc = codec.encode(torch.full((1, 4, 16), 2.5), EncodeSpec("amax"), amax=amax)
    stored = codec.stored_global_scale(float(enc.recorded_scale[0]), 2.5)
    assert torch.equal(stored.reshape(-1), enc.params[codec.global_scale_param].reshape(-1))


def test_output_specs_follow_the_spec():
    """A dense output's dtype is the spec's; a quantized one's tensors are its `specs` with
    the spec's group size, and are what its encoder writes."""
    spec = encode_spec(Int4Codec, torch.int32, None, 32, {"weight": "F32"})
    assert DenseCodec.output_specs((4, 64), spec, False) == [("weight", "F32", (4, 64))]
    specs = Nvfp4Codec.output_specs((4, 64), spec, True)
    assert specs == Nvfp4Codec.specs((4, 64), True, 32)
    enc = Nvfp4Codec.encode(torch.randn(1, 4, 64), spec)
    written = {p: tuple(t.shape[1:]) for p, t in enc.params.items()}
    assert {p: shape for p, _, shape in specs if p in written} == written


def test_one_encode_spec_rule():
    """The builder's defaults: kconvert's rule where none is chosen; a quantized source's
    block amax taken in fp32, a dense one's in its own dtype (formats.md §2)."""
    quantized = encode_spec(Int4Codec, torch.int32, None, None, {})
    dense = encode_spec(DenseCodec, torch.bfloat16, "amax", 16, {})
    assert (quantized.rule, quantized.local_dtype) == (DEFAULT_SCALE_RULE, torch.float32)
    assert (dense.rule, dense.local_dtype, dense.group_size) == ("amax", torch.bfloat16, 16)
