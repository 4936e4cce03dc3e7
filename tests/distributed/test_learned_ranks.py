"""The learned methods under torch.distributed (gloo on the CPU): `sparsify --method learned`
on 2 ranks and `quantize --method learned` on 3, each rank training the routed experts it
holds, write every byte one process writes (the manifest but for its world size), with most
experts trained; a rank killed once its part of a MoE layer's shard is on disk fails the job,
and `--resume` on 3 ranks completes it to the same bytes. The helpers are test_ranks.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ranks import (
    HERE,
    MANIFEST,
    TRAINED,
    env_launch,
    files,
    manifest_without_world,
    write_commands,
)

from helpers import write_input_ids
from kconvert.testing.tiny_moe import corpus_ids, windows

COMMANDS = ("sparsify", "quantize")
# Seconds a job may take: each trains every MoE layer's experts, ranks sharing a CPU.
JOB_TIMEOUT = 1800


def torchrun(ranks: int, cmds_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(HERE / "rank_main.py"),
                           str(cmds_file)], capture_output=True, text=True, timeout=JOB_TIMEOUT)


def learned(command: str, dst: Path, data: Path) -> list[str]:
    """24 sequences of 256 tokens in batches of 6 (4 batches: uneven on 3 ranks) give about
    half of the trained tiny MoE's experts (top-4 of 24) the routed tokens learning needs."""
    return [command, "--method", "learned", str(TRAINED), str(dst), "--data", str(data),
            "--samples", "24", "--seq-len", "256", "--batch-size", "6", "--steps", "2",
            "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("learned-ranks")
    data = write_input_ids(root / "data.jsonl", windows(
        corpus_ids("train"), 24, 256, torch.Generator().manual_seed(1)).tolist())
    one = subprocess.run([sys.executable, str(HERE / "rank_main.py"), str(write_commands(
        root / "one.json", [learned(c, root / "one" / c, data) for c in COMMANDS]))],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=JOB_TIMEOUT)
    assert one.returncode == 0, one.stderr[-4000:]
    # each method on one rank count (sparsify on 2, quantize on 3): both counts' splits of
    # the experts are covered once, and the suite's time with them
    two = torchrun(2, write_commands(root / "two.json", [
        learned("sparsify", root / "two" / "sparsify", data)]))
    assert two.returncode == 0, two.stderr[-4000:]
    killed_dst = root / "killed"
    killed = env_launch(2, write_commands(root / "killed.json", [
        learned("sparsify", killed_dst, data)]), DIE_ON_RANK="1", DIE_ON="part-done")
    partial = sorted(p.name for p in (killed_dst / ".kconvert" / "partial").iterdir())
    three = torchrun(3, write_commands(root / "three.json", [
        learned("quantize", root / "three" / "quantize", data),
        [*learned("sparsify", killed_dst, data), "--resume"]]))
    assert three.returncode == 0, three.stderr[-4000:]
    return {"one": root / "one", 2: root / "two", 3: root / "three", "killed": killed,
            "killed_dst": killed_dst, "partial": partial}


def assert_as_one_process(one: Path, many: Path, ranks: int) -> None:
    a, b = files(one), files(many)
    assert sorted(a) == sorted(b)
    for rel in a:
        if rel != MANIFEST:
            assert a[rel] == b[rel], rel
    m_one, w_one = manifest_without_world(one / MANIFEST)
    m_many, w_many = manifest_without_world(many / MANIFEST)
    assert (w_one, w_many) == (None, ranks)
    assert m_one == m_many


@pytest.mark.parametrize(("command", "ranks"), [("sparsify", 2), ("quantize", 3)])
def test_every_byte_as_one_process(runs, command, ranks):
    assert_as_one_process(runs["one"] / command, runs[ranks] / command, ranks)
    obs = json.loads((runs["one"] / command / MANIFEST).read_text())["obs"]
    routed = [r for r in obs.values() if "oneshot" in r]
    # the comparison covers trained experts (their recorded held-out errors are the trained
    # values'): many had the tokens; p48 writes some learned (2 steps of NVFP4 beat none).
    # Margin, measured in one process on a 2-core CPU: p48 trains 126 of 216 matrices (the
    # bound is 54) and writes all 126 learned, the best at 0.948x its one-shot error: the
    # "some learned" needs only one of 126 to beat its one-shot result
    assert sum(r["learned_error"] is not None for r in routed) > len(routed) // 4
    assert command == "quantize" or any(r["method"] == "learned" for r in routed)


def test_killed_rank_fails_the_job_and_resume_on_three_ranks_completes(runs):
    rank0, rank1 = runs["killed"]
    assert rank1.returncode == -9  # killed once its part of a MoE layer's shard was on disk
    assert rank0.returncode == 1, rank0.stderr
    assert "lost contact with another rank" in rank0.stderr and "--resume" in rank0.stderr
    assert runs["partial"]
    assert_as_one_process(runs["one"] / "sparsify", runs["killed_dst"], 3)
