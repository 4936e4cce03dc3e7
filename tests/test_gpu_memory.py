"""One GPU memory budget (docs/gpu-memory.md), the planner's arithmetic: its weight counts
against the full-size Kimi-K2 layout and a loaded tiny layer, the budget split and the lowering
of micro-batches and OBS batches, its refusals, and the one plan both OBS stages and every rank
read. No GPU here: a refusal is the planner's. The card's budget, read once and capped, is
tests/test_gpu_context.py's subject; the errors and plans the user sees are
tests/test_gpu_memory_messages.py's."""

from __future__ import annotations

import pytest
import torch

from conftest import BUNDLED
from helpers import built_layer
from kconvert.calibrate.plan import forward, forward_plan
from kconvert.common.options import parse_size
from kconvert.engine.execute import gpu_encode
from kconvert.errors import UsageError
from kconvert.evaluate.metrics import LOGIT_ELEMS
from kconvert.gpu import budget as gpu_budget
from kconvert.gpu import plan as gpu_plan
from kconvert.gpu.budget import GpuContext
from kconvert.gpu.parts import GpuWork, Obs
from kconvert.gpu.plan import GpuMemoryError, plan_conversion, plan_forward
from kconvert.gpu.shapes import Shapes
from kconvert.io.checkpoint import open_checkpoint
from kconvert.methods import MethodInputs, obs_memory
from kconvert.methods.gptq import Gptq
from kconvert.methods.hessians import Calibration, CalibrationHessians
from kconvert.methods.sparsegpt import SparseGpt
from kconvert.model.names import Role
from kconvert.pruning.repair import REPAIR_TOKENS, stream_bytes
from kconvert.stages.quantize import Quantize
from kconvert.stages.sparsify import Sparsify
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.header_only import KIMI_K2_THINKING, kimi_int4_shards

GIB = 1 << 30
KIMI = Shapes.from_config(k2_config(KIMI_K2_THINKING, quantized=True))
KIMI_OBS = Obs(obs_memory.batch_bytes(2 * KIMI.moe_inter, KIMI.hidden), gpu_plan.OBS_BATCH,
               KIMI.hidden)


def test_sizes_parse_as_documented():
    assert parse_size("40GiB") == parse_size("40G") == parse_size("40 gib") == 40 * GIB
    assert parse_size("40GB") == 40 * 10 ** 9
    assert parse_size("512MiB") == 512 << 20 and parse_size("1.5TiB") == int(1.5 * (1 << 40))
    assert parse_size("2097152") == 2 << 20
    for bad in ("", "40 GiBs", "lots", "-1G", "1KiB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(UsageError, match="--gpu-memory"):
        gpu_budget.size_option("forty")


def _decoded_elems(specs) -> int:
    """Decoded elements of a shard's linears, from the header-only layout (an INT4 linear's
    weight_packed holds 8 values per int32)."""
    n = 0
    for name, _, shape in specs:
        if name.endswith("weight_packed"):
            n += shape[0] * shape[1] * 8
        elif name.endswith(".weight") and len(shape) == 2:
            n += shape[0] * shape[1]
    return n


def test_layer_weights_match_the_full_size_kimi_layout():
    shards = kimi_int4_shards(KIMI_K2_THINKING)
    dense, moe = _decoded_elems(shards[0]), _decoded_elems(shards[1])
    assert KIMI.layer_elems() == moe
    assert KIMI.attention_elems() + 3 * KIMI.hidden * KIMI.dense_inter == dense
    assert moe * 2 / GIB == pytest.approx(31.78, abs=0.01)  # one MoE layer in BF16


def test_layer_weights_match_a_loaded_tiny_layer():
    """The plan's weight count against what transformers' decoder layer really holds."""
    with built_layer(BUNDLED, 1) as (ckpt, _, _, loaded):
        held = sum(p.numel() for p in loaded.module.parameters() if p.dim() == 2)
        held += loaded.moe.experts.gate_up.numel() + loaded.moe.experts.down.numel()
        assert Shapes.from_config(ckpt.text_config).layer_elems() == held


@pytest.mark.parametrize("fw", [
    forward(KIMI, 1024, 2048, 8),
    forward(KIMI, 128, 2048, 8, models=3, logit_elems=LOGIT_ELEMS["cuda"]),
    forward(KIMI, 1024, 2048, 8, repair_bytes=stream_bytes(KIMI.hidden, 2, REPAIR_TOKENS))])
def test_forward_lowers_its_micro_batch_to_fit(fw):
    plans = {gib: plan_forward(KIMI, fw, gib * GIB, "calibrate") for gib in range(80, 36, -4)}
    assert plans[80].batch_size == 8
    for budget, plan in plans.items():
        assert plan.footprint.peak <= budget * GIB
    sizes = [p.batch_size for p in plans.values()]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < 8
    # the footprint is its parts: resident plus the largest phase
    fp = plans[40].footprint
    assert fp.peak == sum(fp.resident.values()) + max(sum(p.values())
                                                      for p in fp.phases.values())


def test_hidden_states_move_to_the_host_before_the_micro_batch_shrinks():
    fw = forward(KIMI, 1024, 2048, 8)  # 28 GiB of hidden states
    assert not plan_forward(KIMI, fw, 75 * GIB, "calibrate").hidden_on_device
    assert plan_forward(KIMI, forward(KIMI, 16, 2048, 8), 75 * GIB,
                        "calibrate").hidden_on_device


def test_a_layer_beyond_the_budget_is_refused_with_what_it_needs():
    with pytest.raises(GpuMemoryError) as err:
        plan_forward(KIMI, forward(KIMI, 64, 2048, 8), 30 * GIB, "calibrate")
    msg = str(err.value)
    assert "calibrate needs at least 3" in msg and "layer weights 31.8 GiB" in msg
    assert "30.0 GiB budget" in msg and "--gpu-memory" in msg and "--device cpu" in msg


def test_sparsegpt_splits_the_budget_between_forward_and_obs_batches():
    fw = forward(KIMI, 128, 2048, 8, capture=True)
    plans = {b: plan_conversion(KIMI, b * GIB, "sparsify", KIMI.expert_set(),
                                GpuWork(fw, KIMI_OBS), encode=gpu_encode())
             for b in (40, 48, 60, 75, 139)}
    matrices = [p.obs_matrices for p in plans.values()]
    # a budget that holds OBS_BATCH matrices gets exactly that many: a batch solves no more, so
    # its bits do not depend on the budget (docs/obs.md)
    assert 1 <= matrices[0] <= matrices[1] <= matrices[2] < gpu_plan.OBS_BATCH
    assert matrices[3:] == [gpu_plan.OBS_BATCH] * 2
    for b, plan in plans.items():
        assert plan.footprint.peak <= b * GIB
        # what the stage's batch sizing makes of the OBS share is the plan's batch
        assert obs_memory.experts_per_batch(2 * KIMI.moe_inter, KIMI.hidden,
                                           plan.obs_bytes) == plan.obs_matrices
        assert plan.work_elems == plan.obs_matrices * KIMI.expert_elems()
    assert plans[40].batch_size < 8 and plans[75].batch_size == 8
    # below OBS_BATCH, the most that fit: one more expert would not
    p = plans[40]
    more = plan_conversion(KIMI, p.footprint.peak + KIMI_OBS.bytes_per_matrix // 2,
                           "sparsify", KIMI.expert_set(), GpuWork(fw, KIMI_OBS),
                           encode=gpu_encode())
    assert more.obs_matrices == p.obs_matrices


def test_a_budget_too_small_for_one_expert_is_refused():
    fw = forward(KIMI, 128, 2048, 8, capture=True)
    least = plan_conversion(KIMI, 40 * GIB, "sparsify", KIMI.expert_set(),
                            GpuWork(forward(KIMI, 128, 2048, 1, capture=True),
                                    Obs(KIMI_OBS.bytes_per_matrix, 1, KIMI.hidden)),
                            encode=gpu_encode())
    with pytest.raises(GpuMemoryError, match="--samples") as err:
        plan_conversion(KIMI, least.footprint.peak - 1, "sparsify", KIMI.expert_set(),
                        GpuWork(fw, KIMI_OBS), encode=gpu_encode())
    assert "sparsify needs at least" in str(err.value)


def test_plain_conversion_items_shrink_with_the_budget():
    big = plan_conversion(KIMI, 75 * GIB, "quantize", KIMI.expert_set(), encode=gpu_encode())
    small = plan_conversion(KIMI, 3 * GIB, "quantize", KIMI.expert_set(), encode=gpu_encode())
    assert big.work_elems == gpu_encode().item_elems
    assert KIMI.expert_set() <= small.work_elems < big.work_elems
    assert small.footprint.peak <= 3 * GIB
    with pytest.raises(GpuMemoryError):
        plan_conversion(KIMI, GIB, "quantize", KIMI.expert_set(), encode=gpu_encode())


def _obs_stages(ckpt):
    """A SparseGPT and a GPTQ stage, each with its calibration pass (not started)."""
    ids = torch.zeros(2, 16, dtype=torch.long)
    cpu = torch.device("cpu")
    experts = frozenset({Role.ROUTED_EXPERT})
    return [Sparsify(method=SparseGpt(MethodInputs(experts, Calibration(
                CalibrationHessians(ckpt, ids, cpu, 8))))),
            Quantize(targets=experts, method=Gptq(MethodInputs(experts, Calibration(
                CalibrationHessians(ckpt, ids, cpu, 8)))))]


def test_both_obs_stages_take_their_batches_from_the_one_plan():
    """SparseGPT and GPTQ: the plan made for the run is the one their calibration forward
    and OBS batches read; on a GPU an OBS batch is the plan's share (never sized from the
    memory free at the moment), on a CPU OBS_BATCH matrices."""
    ckpt = open_checkpoint(str(BUNDLED))
    try:
        s = Shapes.from_config(ckpt.text_config)
        for stage in _obs_stages(ckpt):
            hessians = stage.method.calibration.hessians
            plan = gpu_plan.plan_gpu(ckpt, [stage], 40 * GIB, stage.name, encode=gpu_encode())
            assert hessians.gpu_plan is plan and plan.obs_matrices >= 1
            assert hessians.obs_budget(torch.device("cuda")) == plan.obs_bytes
            assert hessians.obs_budget(torch.device("cpu")) is None
            assert obs_memory.experts_per_batch(8, 16, None) == gpu_plan.OBS_BATCH
            gptq = stage.name == "quantize"
            assert obs_memory.experts_per_batch(2 * s.moe_inter, s.hidden, plan.obs_bytes,
                                         against_rtn=gptq) == plan.obs_matrices
            work = stage.gpu_work(s)
            assert work.forward.capture and work.forward.tokens() == 2 * 16
            assert work.obs.bytes_per_matrix == obs_memory.batch_bytes(2 * s.moe_inter, s.hidden,
                                                                against_rtn=gptq)
    finally:
        ckpt.close()


def test_each_rank_plans_for_the_hidden_states_of_its_own_batches(monkeypatch):
    """Under torchrun a rank keeps only its batches' hidden states: 2M tokens' (28 GiB) do not
    fit on an 80 GB card beside a Kimi MoE layer, one rank's half does."""
    from types import SimpleNamespace

    from kconvert.common import distributed

    ckpt = SimpleNamespace(text_config=k2_config(KIMI_K2_THINKING, quantized=True))

    gpu = GpuContext(torch.device("cuda"), 75 * GIB, 75 * GIB)

    def plan():
        return forward_plan(ckpt, gpu, (1024, 2048), 8, torch.bfloat16, "calibrate")

    assert not plan().hidden_on_device
    monkeypatch.setattr(distributed, "world", lambda: 2)
    assert plan().hidden_on_device and plan().batch_size == 8
