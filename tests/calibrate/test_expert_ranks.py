"""Expert-parallel MoE layers (kconvert.calibrate.expert_ranks): the blocks of experts, and the
claim the exchange rests on: a rank holding only a block of a layer's experts, given the rows
of that block's pairs (a contiguous run of the batch's pairs sorted by expert) and where the
run starts, computes those experts' outputs and statistics bit for bit as one process holding
every expert does, the statistics' row steps cut inside the block included. The exchange
itself runs under torchrun in tests/distributed."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from kconvert.calibrate import moe as moe_module
from kconvert.calibrate.expert_ranks import MIN_TOKENS_PER_RANK, blocks, note_small_run
from kconvert.calibrate.forward import model_config
from kconvert.calibrate.load import build_layer, read_layer, tensors_by_layer
from kconvert.calibrate.moe import ForwardContext
from kconvert.io.checkpoint import open_checkpoint

TRAINED = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


def test_blocks_are_contiguous_cover_every_item_and_balance_bytes():
    assert blocks([1] * 16, 3) == [range(0, 5), range(5, 11), range(11, 16)]
    assert blocks([1] * 4, 4) == [range(i, i + 1) for i in range(4)]
    # more ranks than experts: some ranks hold none
    assert blocks([1] * 2, 3) == [range(0, 1), range(1, 1), range(1, 2)]
    # uneven bytes: the cut follows the bytes, not the count
    assert blocks([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 9)]


def test_a_run_with_few_tokens_per_rank_says_so(caplog):
    with caplog.at_level("INFO", logger="kconvert.calibrate.expert_ranks"):
        note_small_run(2 * MIN_TOKENS_PER_RANK, 2)
        note_small_run(2 * MIN_TOKENS_PER_RANK - 1, 2)
        note_small_run(10, 1)
    assert len(caplog.records) == 1
    assert "one process may be as fast" in caplog.records[0].getMessage()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_of_experts_computes_as_the_whole_layer(monkeypatch, dtype):
    monkeypatch.setattr(moe_module, "GROUP_STAT_ROWS", 16)  # row steps cut inside the block
    ckpt = open_checkpoint(str(TRAINED))
    try:
        cfg = model_config(ckpt)
        tensors = tensors_by_layer(ckpt, cfg.num_hidden_layers)[1]
        cpu = torch.device("cpu")

        def layer(held):
            raw = read_layer(ckpt, cfg, 1, tensors, dtype, cpu, held)
            return build_layer(raw, cfg, ForwardContext(), cpu, dtype).moe

        whole, part = layer(None), layer(range(8, 17))
    finally:
        ckpt.close()
    assert part.experts.down.shape[0] == 9 and part.experts.first == 8
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        _, w, idx = whole.gate(x)
        k = idx.shape[1]
        exp, order = torch.sort(idx.reshape(-1), stable=True)
        w = w.reshape(-1).float()[order]
        tokens = order // k
        counts = torch.bincount(exp, minlength=whole.n_experts)
        f_whole = whole.expert_outputs(x[tokens], exp, w, counts)
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        a, b = int(starts[8]), int(starts[17])
        assert a % 16 and b - a > 32  # the block starts inside a row step and spans several
        mine = torch.where((torch.arange(whole.n_experts) >= 8)
                           & (torch.arange(whole.n_experts) < 17), counts, 0)
        f_part = part.expert_outputs(x[tokens[a:b]], exp[a:b], w[a:b], mine, a)
    assert torch.equal(f_part, f_whole[a:b])
    held = slice(8, 17)
    for name in ("count", "gate_sum", "reap_sum", "ean_sum", "ean_sq_sum", "amax_in",
                 "amax_down", "sq_in", "sq_down"):
        got, want = getattr(part, name), getattr(whole, name)
        assert torch.equal(got[held], want[held]), name
        assert not got[:8].any() and not got[17:].any(), name  # the others' stay 0
    assert whole.sq_in[held].any()
