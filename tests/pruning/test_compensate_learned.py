"""`reap --compensate learned` (kconvert.pruning.compensate_learned): the block's routed sum
the trainer computes, its training, and its guard inside the calibration pass.

Oracles: transformers' DeepseekV3MLP (each expert) and a per-token sum over the routing
written here for the routed sum; the closed form's own run (`--compensate down`) for what a
refused training leaves; the guard's rule written here."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

from conftest import ROOT
from helpers import compensated_on_trained
from kconvert.pruning.compensate_learned import LearnedSettings, train
from kconvert.pruning.learned_pairs import Pairs, routed_sum
from kconvert.pruning.repair import RepairSettings

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
KEEP = 12
H, INTER, K, E, T = 16, 8, 3, 7, 40  # hidden, inter, top-k, kept experts, tokens


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, INTER, generator=g) / INTER ** 0.5
    return x, weights, ids, gate_up, down


def _mlps(gate_up: torch.Tensor, down: torch.Tensor) -> list[DeepseekV3MLP]:
    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=INTER, hidden_act="silu")
    out = []
    for gu, dn in zip(gate_up, down, strict=True):
        mlp = DeepseekV3MLP(cfg, intermediate_size=INTER)
        mlp.load_state_dict({"gate_proj.weight": gu[:INTER], "up_proj.weight": gu[INTER:],
                             "down_proj.weight": dn})
        out.append(mlp)
    return out


@pytest.mark.parametrize("batch", [1, 3, E])
def test_the_routed_sum_is_transformers_experts_weighted_per_token(batch):
    x, weights, ids, gate_up, down = _problem()
    mlps = _mlps(gate_up, down)
    with torch.no_grad():
        expected = torch.stack([sum(weights[t, s] * mlps[ids[t, s]](x[t]) for s in range(K))
                                for t in range(T)])
        got = routed_sum(x, weights, ids, E, lambda p: (gate_up[p.start:p.stop],
                                                        down[p.start:p.stop]), batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    pairs = Pairs.of(x, weights, ids, range(0, 3))
    assert pairs.depth == int((ids < 3).sum(-1).max())  # a token's slots in the batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hand_written_gradients_are_autograds(dtype):
    """Pairs.gradients against torch's autograd through Pairs.output's loss: within fp32's
    rounding in fp32 (the weight gradients' products are written straight into the buffer's
    layout, which sums in another order than autograd's product-then-transpose), within
    bf16's in bf16."""
    x, weights, ids, gate_up, down = _problem()
    pairs = Pairs.of(x, weights, ids, range(1, 5), dtype)
    residual = torch.randn(len(pairs.tokens), H, generator=torch.Generator().manual_seed(3))
    norm = residual.square().sum()
    part = [gate_up[1:5].to(dtype).requires_grad_(True), down[1:5].to(dtype).requires_grad_(True)]
    ((pairs.output(*part) - residual).square().sum() / norm).backward()
    got = tuple(torch.empty_like(p) for p in part)
    with torch.no_grad():
        pairs.gradients(*(p.detach() for p in part), residual, norm, got, range(4),
                        lambda rows: rows)
    for expected, mine in zip((p.grad for p in part), got, strict=True):
        assert expected.abs().max() > 0
        tol = {torch.float32: (1e-5, 1e-8), torch.bfloat16: (2e-2, 1e-3)}[dtype]
        torch.testing.assert_close(mine.float(), expected.float(), rtol=tol[0], atol=tol[1])


def _trained(settings: LearnedSettings, goal: torch.Tensor, seed: int = 0):
    x, weights, ids, gate_up, down = _problem(seed)
    store = {"gate_up": gate_up.clone(), "down": down.clone()}
    writes = []

    def read(p: range):
        return store["gate_up"][p.start:p.stop], store["down"][p.start:p.stop]

    def write(p: range, gu: torch.Tensor, dn: torch.Tensor):
        writes.append(p)
        store["gate_up"][p.start:p.stop], store["down"][p.start:p.stop] = gu, dn

    before = routed_sum(x, weights, ids, E, read, settings.batch)
    train(x, weights, ids, goal, E, read, write, settings)
    after = routed_sum(x, weights, ids, E, read, settings.batch)
    return store, writes, (before - goal).square().sum(), (after - goal).square().sum()


def test_training_lowers_the_block_error_and_repeats_exactly():
    goal = _problem(seed=1)[0] * 0.3  # another block's output to approach
    settings = LearnedSettings(steps=60, lr=2e-2, batch=3)
    store, writes, before, after = _trained(settings, goal)
    assert after < 0.8 * before
    assert writes == [range(0, 3), range(3, 6), range(6, 7)]  # each batch once, ascending
    again = _trained(settings, goal)[0]
    for name, t in store.items():
        assert torch.equal(t, again[name]), name


def test_bf16_products_train_fp32_masters_and_repeat_exactly():
    """As on a GPU: the products in bf16, the masters, their moments and the loss in fp32."""
    goal = _problem(seed=1)[0] * 0.3
    settings = LearnedSettings(steps=60, lr=2e-2, batch=3, bf16=True)
    assert settings.dtype(torch.device("cpu")) == torch.bfloat16
    assert LearnedSettings().dtype(torch.device("cpu")) == torch.float32
    store, _, before, after = _trained(settings, goal)
    assert after < 0.8 * before
    assert all(t.dtype == torch.float32 for t in store.values())
    # the trained masters are fp32 values, not bf16's (bf16 masters would be on its grid)
    for t in store.values():
        assert not torch.equal(t, t.bfloat16().float())
    again = _trained(settings, goal)[0]
    for name, t in store.items():
        assert torch.equal(t, again[name]), name


def test_bf16_routed_sum_is_the_fp32_one_to_bf16_precision():
    x, weights, ids, gate_up, down = _problem()

    def read(p: range):
        return gate_up[p.start:p.stop], down[p.start:p.stop]

    exact = routed_sum(x, weights, ids, E, read, 3)
    rounded = routed_sum(x, weights, ids, E, read, 3, torch.bfloat16)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
    torch.testing.assert_close(rounded, exact, rtol=0.05, atol=0.05)


def test_no_step_changes_nothing():
    goal = _problem(seed=1)[0]
    store, _, before, after = _trained(LearnedSettings(steps=0, batch=4), goal)
    *_, gate_up, down = _problem()
    assert torch.equal(store["gate_up"], gate_up) and torch.equal(store["down"], down)
    assert after == before


def _reap(compensate: str, learned: LearnedSettings | None = None):
    """(the repair, its stage) of `reap --compensate ...` on the trained tiny MoE, half of 8
    short sequences held out."""
    extra = {} if learned is None else {"learned": learned}
    fixer, _, stage = compensated_on_trained(RepairSettings(
        "none", KEEP, "reap", compensate=compensate, ridges=(0.1,), heldout=0.5, **extra), SRC)
    return fixer, stage


def test_a_training_that_raises_the_heldout_error_is_never_written():
    """Every layer's refusal is clear by far (held-out MSE, measured): 0.343 -> 6.71,
    0.186 -> 4.41, 0.268 -> 5.66."""
    closed, _ = _reap("down")
    # steps of a whole RMS: the trained experts are far off on held-out tokens
    fixer, stage = _reap("learned", LearnedSettings(steps=4, lr=1.0))
    for layer, rec in fixer.compensations.items():
        assert rec.learned is not None and rec.learned.applied is False, layer
        assert rec.learned.heldout_mse_after > rec.learned.heldout_mse_before, layer
        # what the closed form wrote, and the stream went on with it (the later layers'
        # errors are those of the closed form's run, whose inputs the earlier layers make)
        base = closed.compensations[layer]
        assert (rec.heldout_mse_before, rec.heldout_mse_after) == (
            base.heldout_mse_before, base.heldout_mse_after), layer
        assert rec.matrices_xxh3 == base.matrices_xxh3, layer
    assert fixer.matrices.keys() == closed.matrices.keys()
    for name, t in fixer.matrices.items():
        assert torch.equal(t, closed.matrices[name]), name
    assert all("gate_proj" not in name for name, _ in stage.replaced)


def test_a_training_that_lowers_the_heldout_error_writes_gate_up_and_down():
    """Training applied by a wide margin in layer 1 (held-out MSE 0.343 -> 0.231, 33%) and
    layer 2 (0.192 -> 0.142, 26%); layer 3's (0.2835 -> 0.2807, 1%) is checked only against
    the guard's rule and its consequence."""
    fixer, stage = _reap("learned")
    applied = [layer for layer, rec in fixer.compensations.items() if rec.learned.applied]
    assert applied, "no layer's training lowered its held-out error"
    for layer, rec in fixer.compensations.items():
        learned = rec.learned
        assert (learned.heldout_mse_after < learned.heldout_mse_before) == learned.applied
        gate = {n for n in rec.matrices_xxh3 if ".gate_proj." in n}
        assert len(gate) == (KEEP if learned.applied else 0), layer
    replaced = dict(stage.replaced)
    assert any(".up_proj." in name for name in replaced)
