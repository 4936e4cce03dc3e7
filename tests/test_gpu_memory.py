"""One GPU memory budget (docs/gpu-memory.md): the planner's arithmetic against the full-size
Kimi-K2 layout and a loaded tiny layer, the budget split and the lowering of micro-batches and
OBS batches, the refusal and out-of-memory errors through the command line, and the plans that
--dry-run and inspect print. No GPU here: a refusal is the planner's, an out-of-memory error is
raised from a patched step."""

from __future__ import annotations

import json
from dataclasses import dataclass

import click
import pytest
import torch
from click.testing import CliRunner

from conftest import BUNDLED
from helpers import built_layer
from kconvert import api
from kconvert.calibrate.plan import forward, forward_plan
from kconvert.cli import main
from kconvert.cli.base import KconvertCommand
from kconvert.common.options import parse_size
from kconvert.engine.execute import gpu_encode
from kconvert.errors import KconvertError, UsageError
from kconvert.evaluate.metrics import LOGIT_ELEMS
from kconvert.gpu import budget as gpu_budget
from kconvert.gpu import plan as gpu_plan
from kconvert.gpu.budget import GpuContext, GpuRequest
from kconvert.gpu.parts import GpuWork, Obs
from kconvert.gpu.plan import GpuMemoryError, plan_conversion, plan_forward
from kconvert.gpu.shapes import Shapes
from kconvert.io.checkpoint import open_checkpoint
from kconvert.methods import MethodInputs, obs, obs_memory
from kconvert.methods.gptq import Gptq
from kconvert.methods.hessians import Calibration, CalibrationHessians
from kconvert.methods.sparsegpt import SparseGpt
from kconvert.model.names import Role
from kconvert.pruning.repair import REPAIR_TOKENS, stream_bytes
from kconvert.records.manifest import MANIFEST
from kconvert.sizing.gpu_memory import command_plans
from kconvert.stages.quantize import Quantize
from kconvert.stages.sparsify import Sparsify
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.header_only import KIMI_K2_THINKING, kimi_int4_shards

GIB = 1 << 30
KIMI = Shapes.from_config(k2_config(KIMI_K2_THINKING, quantized=True))
KIMI_OBS = Obs(obs_memory.batch_bytes(2 * KIMI.moe_inter, KIMI.hidden), KIMI.experts, KIMI.hidden)

# A real allocator message (torch 2.x, one H100), as the error line must quote it.
ALLOCATOR = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
             "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
             "has 78.12 GiB memory in use. Of the allocated memory 37.10 GiB is allocated by "
             "PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")


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
    assert 1 <= matrices[0] < gpu_plan.OBS_BATCH <= matrices[2] <= matrices[-1] <= KIMI.experts
    for b, plan in plans.items():
        assert plan.footprint.peak <= b * GIB
        # what the stage's batch sizing makes of the OBS share is the plan's batch
        assert obs_memory.experts_per_batch(2 * KIMI.moe_inter, KIMI.hidden,
                                           plan.obs_bytes) == plan.obs_matrices
        assert plan.work_elems == plan.obs_matrices * KIMI.expert_elems()
    assert plans[40].batch_size < 8 and plans[75].batch_size == 8
    # the most that fit: one more expert would not
    p = plans[75]
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


def test_the_oom_line_quotes_the_allocator():
    line = gpu_budget.oom_message(ALLOCATOR, "sparsify", 40 * GIB, "--batch-size --samples")
    assert "sparsify ran out of GPU memory: it tried to allocate 2.00 GiB" in line
    assert "37.10 GiB allocated within its 40.0 GiB budget" in line
    assert "lower --batch-size or --samples" in line and "--gpu-memory" in line
    assert "\n" not in line


def test_a_run_reads_the_card_once_and_plans_without_one_for_the_reference_card(monkeypatch):
    """GpuRequest.context reads what the card has free once: every later step of the run gets
    the same GpuContext. Without a GPU, plans are made for --gpu-memory, else for an 80 GB
    H100's default budget (a dry run, inspect)."""
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: reads.append(device) or (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _device: 0)
    request = GpuRequest(torch.device("cuda", 0))
    first = request.context
    assert request.context is first and len(reads) == 1
    assert first.budget == first.plan_budget == 60 * GIB - gpu_budget.margin(80 * GIB)
    with pytest.raises(GpuMemoryError, match="more than cuda:0 has free"):
        _ = GpuRequest(torch.device("cuda", 0), 70 * GIB).context
    cpu = GpuRequest(torch.device("cpu")).context
    assert cpu.budget is None and cpu.plan_budget == (
        gpu_budget.REFERENCE_FREE - gpu_budget.margin(gpu_budget.REFERENCE_CARD))
    assert GpuRequest(torch.device("cpu"), 40 * GIB).context.plan_budget == 40 * GIB


def test_reap_data_and_its_conversion_share_one_gpu_context(tmp_path, monkeypatch):
    """reap --data: REAP's calibration (the stage's preparation) resolves the run's budget and
    the conversion after it takes the same GpuContext; it is not resolved again."""
    made = []

    @dataclass(frozen=True)
    class Counted(GpuContext):
        def __post_init__(self):
            made.append(self)

    monkeypatch.setattr(gpu_budget, "GpuContext", Counted)
    api.reap(str(BUNDLED), str(tmp_path / "out"), data=str(_data(tmp_path, 4)), keep=8,
             samples=4, seq_len=16, device="cpu")
    assert len(made) == 1


def _data(tmp_path, n: int = 2):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(i, i + 16))}) + "\n"
                            for i in range(n)))
    return data


def _sparsegpt(tmp_path, dst, *extra):
    return CliRunner().invoke(main, [
        "sparsify", str(BUNDLED), str(dst), "--method", "sparsegpt", "--data",
        str(_data(tmp_path)), "--seq-len", "16", "--samples", "2", "--device", "cpu", "--quiet",
        *extra])


def _least_sparsify_bytes() -> int:
    """What the bundled checkpoint's SparseGPT run needs at the least (one expert, one
    sequence per step, hidden states on the host)."""
    s = Shapes.from_config(json.loads((BUNDLED / "config.json").read_text()))
    plan = plan_conversion(s, 1 << 40, "sparsify", s.expert_set(),
                           GpuWork(forward(s, 2, 16, 1, capture=True),
                                   Obs(obs_memory.batch_bytes(2 * s.moe_inter, s.hidden), 1,
                                       s.hidden)),
                           encode=gpu_encode())
    return plan.footprint.peak


def test_dry_run_prints_the_plan_and_notes_a_budget_below_one_expert(tmp_path):
    res = _sparsegpt(tmp_path, tmp_path / "a", "--dry-run", "--gpu-memory", "40GiB")
    assert res.exit_code == 0, res.output
    assert "GPU memory for sparsify:" in res.output and "of a 40.0 GiB budget" in res.output
    assert "expert matrices per OBS batch" in res.output and "while solving an OBS batch" \
        in res.output
    least = _least_sparsify_bytes()
    # a dry run on the CPU says what the run would need on a GPU, and does not refuse it
    res = _sparsegpt(tmp_path, tmp_path / "b", "--dry-run", "--gpu-memory", str(least - 1))
    assert res.exit_code == 0, res.output
    assert "this run would not fit (sparsify needs at least" in res.output
    assert "Traceback" not in res.output and "internal error" not in res.output
    assert not (tmp_path / "b").exists()
    res = CliRunner().invoke(main, ["quantize", str(BUNDLED), str(tmp_path / "q"), "--dry-run"])
    assert res.exit_code == 0 and "GPU memory for quantize:" in res.output, res.output
    assert "work items of up to" in res.output and "80 GB H100" in res.output
    res = CliRunner().invoke(main, ["quantize", str(BUNDLED), str(tmp_path / "q"),
                                    "--gpu-memory", "lots"])
    assert res.exit_code == 2 and "lots" in res.output


@pytest.mark.parametrize("command,method", [("sparsify", "sparsegpt"),
                                            ("int4-to-nvfp4", "gptq")])
def test_an_out_of_memory_step_is_one_line_exit_1_no_manifest(tmp_path, monkeypatch, command,
                                                                method):
    """An OBS batch (SparseGPT's, GPTQ's) that runs out of GPU memory: one line through the
    command line, a GpuMemoryError through the API."""
    def exhausted(*_args, **_kwargs):
        raise torch.OutOfMemoryError(ALLOCATOR)

    monkeypatch.setattr(obs, "obs_quantize", exhausted)
    dst = tmp_path / "out"
    data = str(_data(tmp_path))
    res = CliRunner().invoke(main, [
        command, str(BUNDLED), str(dst), "--method", method, "--data", data, "--seq-len", "16",
        "--samples", "2", "--device", "cpu", "--quiet"])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"kconvert: error: {command} ran out of GPU memory: it tried to allocate 2.00 GiB"), lines
    assert "lower --batch-size or --samples" in lines[0]
    assert not (dst / MANIFEST).exists()
    with pytest.raises(GpuMemoryError, match="ran out of GPU memory"):
        getattr(api, command.replace("-", "_"))(str(BUNDLED), str(tmp_path / "api"),
                                               method=method, data=data, seq_len=16,
                                               samples=2, device="cpu")
    assert issubclass(GpuMemoryError, KconvertError)


def test_an_out_of_memory_error_outside_a_plan_is_still_one_line():
    @click.command("probe", cls=KconvertCommand)
    @click.option("--batch-size", default=8)
    def probe(batch_size):
        raise torch.OutOfMemoryError(ALLOCATOR)

    res = CliRunner().invoke(probe, [])
    assert res.exit_code == 1
    assert res.output.strip().startswith("kconvert: error: probe ran out of GPU memory")
    assert "lower --batch-size" in res.output and "internal error" not in res.output


def test_inspect_prints_each_commands_plan():
    """inspect's section on the bundled checkpoint; its plans on full-size Kimi shapes (the
    header-only layout's config) through the same function."""
    report = api.inspect(str(BUNDLED), gpu_memory="40GiB")
    assert report.to_json()["gpu_memory"]["budget"] == 40 * GIB
    text = report.render()
    assert "GPU memory of each command at its defaults, on one GPU with a 40.0 GiB" in text
    assert "GPU memory for sparsify --method sparsegpt:" in text
    full = k2_config(KIMI_K2_THINKING, quantized=True)
    plans = command_plans(full, 40 * GIB)
    cal = plans["calibrate"]
    assert cal["fits"] and cal["batch_size"] < 8 and not cal["hidden_on_device"]
    assert cal["peak_bytes"] <= 40 * GIB and "  layer weights: 31.8 GiB" in cal["lines"]
    sgpt = plans["sparsify --method sparsegpt"]
    assert sgpt["fits"] and sgpt["obs_matrices"] >= 1 and sgpt["peak_bytes"] <= 40 * GIB
    # GPTQ compares every result with RTN: more bytes per matrix, no more matrices per batch
    gptq = plans["quantize --method gptq"]
    assert gptq["fits"] and 1 <= gptq["obs_matrices"] <= sgpt["obs_matrices"]
    assert "GPU memory for quantize --method gptq:" in text
    small = command_plans(full, 24 * GIB)
    assert not small["calibrate"]["fits"] and "--gpu-memory" in small["calibrate"]["error"]


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
    memory free at the moment), on a CPU obs_memory.CPU_BATCH matrices."""
    ckpt = open_checkpoint(str(BUNDLED))
    try:
        s = Shapes.from_config(ckpt.text_config)
        for stage in _obs_stages(ckpt):
            hessians = stage.method.calibration.hessians
            plan = gpu_plan.plan_gpu(ckpt, [stage], 40 * GIB, stage.name, encode=gpu_encode())
            assert hessians.gpu_plan is plan and plan.obs_matrices >= 1
            assert hessians.obs_budget(torch.device("cuda")) == plan.obs_bytes
            assert hessians.obs_budget(torch.device("cpu")) is None
            assert obs_memory.experts_per_batch(8, 16, None) == obs_memory.CPU_BATCH
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


def test_the_cap_names_the_card_by_index_for_a_bare_cuda_device(monkeypatch):
    """`--device cuda` (no index) is the usual device: torch's per-process cap refuses it, so
    the cap, its release and the card's size must get the current card's index (a GPU-only
    path, checked here with torch.cuda's calls recorded instead of made)."""
    calls = []

    def needs_index(name):
        def call(*args):
            device = args[-1]
            assert isinstance(device, int), f"{name} got {device!r}"
            calls.append((name, *args))
            return type("P", (), {"total_memory": 80 << 30})()
        return call

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name in ("set_per_process_memory_fraction", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, needs_index(name))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *_: 1 << 30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with GpuContext(torch.device("cuda"), 40 << 30, 40 << 30).enforced("calibrate"):
        pass
    assert [c[0] for c in calls] == ["get_device_properties", "set_per_process_memory_fraction",
                                     "set_per_process_memory_fraction"]
    assert calls[1][1] == 0.5 and calls[2][1] == 1.0
