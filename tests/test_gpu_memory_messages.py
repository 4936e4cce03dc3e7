"""One GPU memory budget (docs/gpu-memory.md), what the user sees: the out-of-memory line that
quotes the allocator, one line and exit 1 through the command line (a GpuMemoryError through
the API), and the plans that --dry-run and inspect print. No GPU here: an out-of-memory error
is raised from a patched step."""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from conftest import BUNDLED
from helpers import write_input_ids
from kconvert import api
from kconvert.calibrate.plan import forward
from kconvert.cli import main
from kconvert.cli.base import KconvertCommand
from kconvert.engine.execute import gpu_encode
from kconvert.errors import KconvertError
from kconvert.gpu import budget as gpu_budget
from kconvert.gpu.parts import GpuWork, Obs
from kconvert.gpu.plan import GpuMemoryError, plan_conversion
from kconvert.gpu.shapes import Shapes
from kconvert.methods import obs, obs_memory
from kconvert.records.manifest import MANIFEST
from kconvert.sizing.gpu_memory import command_plans
from kconvert.testing.fixture_config import k2_config
from kconvert.testing.header_only import KIMI_K2_THINKING

GIB = 1 << 30

# A real allocator message (torch 2.x, one H100), as the error line must quote it.
ALLOCATOR = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
             "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
             "has 78.12 GiB memory in use. Of the allocated memory 37.10 GiB is allocated by "
             "PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")


def test_the_oom_line_quotes_the_allocator():
    line = gpu_budget.oom_message(ALLOCATOR, "sparsify", 40 * GIB, "--batch-size --samples")
    assert "sparsify ran out of GPU memory: it tried to allocate 2.00 GiB" in line
    assert "37.10 GiB allocated within its 40.0 GiB budget" in line
    assert "lower --batch-size or --samples" in line and "--gpu-memory" in line
    assert "\n" not in line


def _data(tmp_path):
    return write_input_ids(tmp_path / "d.jsonl", (range(i, i + 16) for i in range(2)))


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
