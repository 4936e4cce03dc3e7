"""Start-up of the data-driven commands: every phase logged with -v (the bench reads them),
the same statistics bytes as measure_stats called directly, and a failed CUDA start on the
thread left to the main thread to report."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import torch

from helpers import cli_subprocess, write_input_ids
from kconvert.calibrate import startup

PHASE = re.compile(r"kconvert: INFO: phase ([\w ]+): [\d.]+ s")

# measure_stats and save_stats called directly on what the CLI reads (argv: src, data, out)
DIRECT = """
import sys, torch
from kconvert.calibrate.data import load_calibration_data
from kconvert.calibrate.run import measure_stats
from kconvert.calibrate.stats import save_stats
from kconvert.io.checkpoint import open_checkpoint
ckpt = open_checkpoint(sys.argv[1])
ids = load_calibration_data(sys.argv[2], None, 3, 16, 1)
save_stats(measure_stats(ckpt, ids, "cpu", 2, dtype=torch.float32), sys.argv[3])
"""


def _data(path, rows: int = 3, seq: int = 16):
    return write_input_ids(path, ([(7 * i + j) % 500 for j in range(seq)] for i in range(rows)))


def test_calibrate_logs_its_phases_and_writes_the_same_bytes(fixture_dir, tmp_path):
    src = fixture_dir("bf16")
    data = _data(tmp_path / "d.jsonl")
    args = ["--data", data, "--samples", 3, "--seq-len", 16, "--batch-size", 2, "--seed", 1,
            "--device", "cpu", "--dtype", "float32"]
    # one intra-op thread in both processes below: the same summation order
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = cli_subprocess("calibrate", src, "-o", tmp_path / "cli", *args, "-v", env=env)
    assert res.returncode == 0, res.stderr
    assert PHASE.findall(res.stderr) == ["imports", "open checkpoint", "data", "model code",
                                         "embedding", "write"]
    assert "wrote " in res.stdout  # stdout flushed before the quick exit
    quiet = cli_subprocess("calibrate", src, "-o", tmp_path / "quiet", *args)
    assert quiet.returncode == 0 and not PHASE.findall(quiet.stderr + quiet.stdout)
    # the CLI's bytes are those of measure_stats called directly (no start-up step changes
    # what is measured), in a fresh process as the CLI's is (nothing of this test session)
    direct = subprocess.run([sys.executable, "-c", DIRECT, str(src), str(data),
                             str(tmp_path / "direct")], capture_output=True, text=True, env=env)
    assert direct.returncode == 0, direct.stderr
    assert ((tmp_path / "cli" / "stats.safetensors").read_bytes()
            == (tmp_path / "direct" / "stats.safetensors").read_bytes())


def test_eval_and_reap_log_the_same_phases(fixture_dir, tmp_path):
    src = fixture_dir("bf16")
    data = _data(tmp_path / "d.jsonl")
    common = ["--data", data, "--samples", 3, "--seq-len", 16, "--batch-size", 2, "--device",
              "cpu", "-v"]
    res = cli_subprocess("eval", src, src, *common)
    assert res.returncode == 0, res.stderr
    assert PHASE.findall(res.stderr) == ["imports", "open checkpoint", "data", "model code",
                                         "embedding"]
    res = cli_subprocess("reap", src, tmp_path / "pruned", "--keep", 4, *common)
    assert res.returncode == 0, res.stderr
    assert PHASE.findall(res.stderr)[:3] == ["data", "model code", "embedding"]


def test_failed_cuda_start_on_the_thread_is_left_to_the_main_thread(monkeypatch, caplog):
    """And the thread starts the main thread's current device (a torchrun rank's own), not
    a new thread's default device 0."""
    seen = []

    def fail(device):
        seen.append(device)
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(torch.cuda, "device", fail)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert startup.start_device(torch.device("cpu")) is None
    with caplog.at_level(logging.DEBUG, logger=startup.__name__):
        startup.start_device(torch.device("cuda")).join()
        startup.start_device(torch.device("cuda", 2)).join()
    assert seen == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert caplog.text.count("CUDA start on a thread failed: no CUDA here") == 2
    assert "CUDA started" not in caplog.text
