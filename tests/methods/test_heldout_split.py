"""GPTQ's held-out tokens stay out of the expert fit (CalibrationHessians.split_hessians): the
fit's Hessian and the held-out one, against Hessians rebuilt here from the matrix's inputs with
every 8th of its tokens held out, and the two adding up to X^T X of all of them (so no token is
in both, and none is lost). For the shared expert (every token), a routed expert with enough
routed tokens to hold 128 out, and their down_proj inputs. And `gram`, the Hessian of bf16
inputs, against float64."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from kconvert.io.checkpoint import open_checkpoint
from kconvert.methods.hessians import CalibrationHessians
from kconvert.testing.tiny_moe import corpus_ids, windows

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
EVERY, LEAST = 8, 128  # every 8th token held out, where that holds out at least 128


@pytest.fixture(scope="module")
def handed_over():
    ids = windows(corpus_ids("train"), 48, 128, torch.Generator().manual_seed(2))
    ckpt = open_checkpoint(str(SRC))
    hessians = CalibrationHessians(ckpt, ids, torch.device("cpu"), 8, dtype=torch.float32)
    try:
        yield hessians
    finally:
        hessians.close()
        ckpt.close()


def _rebuilt(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    held = [i for i in range(x.shape[0]) if i % EVERY == EVERY - 1]
    fit = [i for i in range(x.shape[0]) if i % EVERY != EVERY - 1]
    assert len(held) >= LEAST and not set(held) & set(fit)
    xf, xh = x[fit].double(), x[held].double()
    return xf.T @ xf, xh.T @ xh


def test_held_out_tokens_are_out_of_the_fit(handed_over):
    layer = 1
    moe = handed_over.moe_layer(layer)
    counts = torch.tensor([moe.routed_inputs(e).shape[0] for e in range(moe.n_experts)])
    busiest = int(counts.argmax())
    assert counts[busiest] >= EVERY * LEAST, counts
    for expert in (None, busiest):
        for proj in ("gate_proj", "down_proj"):
            x = handed_over.inputs(layer, expert, proj)
            split = handed_over.split_hessians(layer, expert, proj)
            assert split.held_out is not None
            fit, held = _rebuilt(x)
            scale = float(fit.abs().max())
            for got, want in ((split.fit, fit), (split.held_out, held),
                              (split.fit + split.held_out, x.double().T @ x.double())):
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * scale,
                                           msg=lambda m, e=expert, p=proj: f"{e} {p}: {m}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the tensor-core path needs a GPU"))])
def test_gram_of_bf16_inputs_sums_their_exact_products_in_fp32(device):
    """The Hessians of bf16 activations (on a GPU: tensor cores, fp32 accumulation) agree with
    the float64 product within the bound of any fp32 summation order, (n - 1) u sum|x_i y_i|
    per entry (products of bf16 values are exact in fp32). A bf16 accumulation misses the
    diagonal by far more: its spacing there is 2^-8 of the sum, not 2^-24."""
    from kconvert.methods.hessians import gram

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, 256, generator=gen) * 3).to(torch.bfloat16)
    got = gram(x.to(device))
    want = x.double().T @ x.double()
    bound = (x.shape[0] - 1) * 2.0 ** -24 * (x.double().abs().T @ x.double().abs())
    assert got.dtype == torch.float32
    assert bool(((got.double().cpu() - want).abs() <= bound).all())
    in_bf16 = (x.T @ x).double()  # a bf16 result: the bound is tight enough to catch it
    assert not bool(((in_bf16 - want).abs() <= bound).all())


def test_routed_rows_select_what_a_mask_selects(handed_over):
    """Each expert's rows from the one sort per layer: the tokens whose top-k ids name it, in
    token order (what `x[(ids == e).any(-1)]` selects), and slots that point at those ids."""
    moe = handed_over.moe_layer(1)
    x, ids = moe.captured()
    rows = moe.routed_rows()
    assert len(rows.tokens) == moe.n_experts
    for e in range(moe.n_experts):
        chosen = (ids == e).any(-1)
        assert torch.equal(rows.tokens[e], chosen.nonzero().reshape(-1)), e
        assert torch.equal(ids.reshape(-1)[rows.slots[e]], torch.full_like(rows.slots[e], e))
        assert torch.equal(rows.slots[e] // ids.shape[1], rows.tokens[e])
        assert torch.equal(moe.routed_inputs(e), x[chosen]), e
