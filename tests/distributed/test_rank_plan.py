"""The GPU memory plan of one rank under torchrun (docs/many-gpus.md, docs/gpu-memory.md), on
the full-size Kimi-K2 layout, with the world size patched (no process group is needed to
plan): a rank holds the hidden states of its batches, its block of each MoE layer's routed
experts (and, on rank 0 repairing, every expert), the exchange's buffers, and when capturing
a buffer for the rows routed to its experts from every rank; its OBS batches are drawn from
its block, as many matrices a batch as one process's. The share is printed with the plan (a
conversion's --dry-run, inspect)."""

from __future__ import annotations

import pytest

from kconvert.calibrate.plan import forward
from kconvert.common import distributed
from kconvert.engine.execute import gpu_encode
from kconvert.gpu.parts import OBS_BATCH
from kconvert.gpu.plan import forward_footprint, plan_conversion, plan_forward
from kconvert.gpu.shapes import Shapes
from kconvert.methods import obs_memory
from kconvert.pruning.repair import REPAIR_TOKENS, stream_bytes
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.header_only import KIMI_K2_THINKING

GIB = 1 << 30
KIMI = Shapes.from_config(k2_config(KIMI_K2_THINKING, quantized=True))


@pytest.fixture
def world(monkeypatch):
    """world(n, rank): plan as rank `rank` of `n`."""

    def set_world(n: int, rank: int = 0) -> None:
        monkeypatch.setattr(distributed, "world", lambda: n)
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        monkeypatch.setattr(distributed, "is_main", lambda: rank == 0)

    return set_world


def resident(fw, batch: int = 8) -> dict[str, int]:
    return forward_footprint(KIMI, fw, batch, True).resident


def test_a_rank_holds_its_share_of_experts_and_hidden_states(world):
    world(1)
    one = forward(KIMI, 1024, 2048, 8)
    world(4)
    four = forward(KIMI, 1024, 2048, 8)
    assert (four.sequences, four.job_sequences, four.ranks) == (256, 1024, 4)
    r1, r4 = resident(one), resident(four)
    assert r4["hidden states"] * 4 == r1["hidden states"]
    routed = KIMI.experts * KIMI.expert_elems() * 2  # bf16 bytes of every routed expert
    assert r1["layer weights"] - r4["layer weights"] == routed * 3 // 4
    # the exchange's buffers are part of a micro-batch's activations
    act1 = forward_footprint(KIMI, one, 8, True).phases["running a micro-batch"]["activations"]
    act4 = forward_footprint(KIMI, four, 8, True).phases["running a micro-batch"]["activations"]
    assert act4 > act1
    # 4 ranks on 80 GB each keep the hidden states on the GPU where one rank cannot
    assert not plan_forward(KIMI, one, 75 * GIB, "calibrate").hidden_on_device
    plan = plan_forward(KIMI, four, 75 * GIB, "calibrate")
    assert plan.hidden_on_device and plan.batch_size == 8
    assert any("96 of 384 routed experts per MoE layer" in line and "256 of 1024" in line
               for line in plan.lines("calibrate"))


def test_rank_0_repairing_holds_every_expert_and_the_repair_stream(world):
    stream = stream_bytes(KIMI.hidden, 2, REPAIR_TOKENS)
    world(4, 0)
    main = forward(KIMI, 256, 2048, 8, repair_bytes=stream)
    world(4, 1)
    other = forward(KIMI, 256, 2048, 8, repair_bytes=stream)
    r0, r1 = resident(main), resident(other)
    assert r0["repair stream"] == stream and "repair stream" not in r1
    assert r0["layer weights"] - r1["layer weights"] == KIMI.experts * KIMI.expert_elems() * 2
    assert "every routed expert" in main.share_line(KIMI)


def test_eval_is_data_parallel_only(world):
    world(4)
    fw = forward(KIMI, 128, 2048, 8, models=2)
    assert fw.ranks == 1 and fw.sequences == 32
    assert fw.routed_held(KIMI) == KIMI.experts


def test_gptq_rank_captures_rows_routed_to_its_experts_and_solves_its_block(world):
    world(1)
    one = obs_memory.gpu_work(KIMI, forward(KIMI, 128, 2048, 8, capture=True), shared=False,
                       against_rtn=True)
    world(4)
    four = obs_memory.gpu_work(KIMI, forward(KIMI, 128, 2048, 8, capture=True), shared=False,
                        against_rtn=True)
    # every token of the job may come to a rank (1 - (3/4)^8 of them do, with one of their 8
    # experts among its 96): its buffer holds them all, as one process's
    assert resident(four.forward)["captured layer inputs"] == resident(one.forward)[
        "captured layer inputs"]
    assert four.forward.held_fraction(KIMI) == pytest.approx(1 - 0.75 ** 8)
    plan = plan_conversion(KIMI, 75 * GIB, "quantize", KIMI.expert_set(), four,
                           encode=gpu_encode())
    assert plan.obs_matrices == OBS_BATCH
    assert any("96 of 384" in line for line in plan.lines("quantize"))


@pytest.mark.parametrize("ranks", [1, 32])
def test_a_rank_with_fewer_experts_than_a_batch_plans_a_whole_batch(world, ranks):
    """32 ranks hold 12 of Kimi's 384 experts each, fewer than OBS_BATCH. On a GPU a batch's
    size changes its experts' bits, and every batch is padded to the plan's count
    (obs_memory.padded): so the plan gives the rank's batches OBS_BATCH matrices, as one
    process's, not its 12 (with 12, the trained tiny MoE's learned experts differed between
    1 and 2 ranks on an H200: docs/obs.md)."""
    world(ranks)
    work = obs_memory.gpu_work(KIMI, forward(KIMI, 128, 2048, 8, capture=True), shared=False,
                               against_rtn=True)
    plan = plan_conversion(KIMI, 75 * GIB, "quantize", KIMI.expert_set(), work,
                           encode=gpu_encode())
    assert plan.obs_matrices == OBS_BATCH
    assert obs_memory.experts_per_batch(2 * KIMI.moe_inter, KIMI.hidden, plan.obs_bytes,
                                        against_rtn=True) == OBS_BATCH
