"""`reap` refuses a kept-expert count that no common expert-parallel size (2, 4, 8, 16)
divides, before any work (vLLM #52435: `n_physical_experts=256 must be divisible by
ep_size=3`), naming the sizes that do and the counts to keep instead; with --allow-uneven-ep it
warns and writes. --keep, --prune-ratio and a --plan's count alike, on the bundled fixture (16
routed experts per MoE layer, top-4 routing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kconvert
from conftest import BUNDLED
from helpers import assert_user_error, calibrated, cli_inproc, write_jsonl
from kconvert.errors import UsageError
from kconvert.model.expert_parallel import (
    ep_divisors,
    even_counts_near,
    splits_on_common_ep,
    uneven_ep_reason,
)

REFUSED = "keep 15: no expert-parallel size of 2, 4, 8 or 16 divides it (15 = 3 x 5"
INSTEAD = "keep 16 or 8, or pass --allow-uneven-ep"
WARNING = "kconvert: warning: keep 15:"


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory) -> Path:
    """Real `kconvert calibrate` statistics of the bundled fixture (for --stats)."""
    return calibrated(BUNDLED, tmp_path_factory.mktemp("stats"), 7)


def plan_keeping(path: Path, kept: int) -> Path:
    path.write_text(json.dumps({"criterion": "manual", "layers": {
        str(layer): {"keep": list(range(kept))} for layer in (1, 2)}}))
    return path


def kept_experts(dst: Path) -> int:
    return json.loads((dst / "config.json").read_text())["n_routed_experts"]


@pytest.mark.parametrize(("count", "divisors", "splits"), [
    (255, [1, 3, 5, 15], False),
    (256, [1, 2, 4, 8, 16], True),
    (192, [1, 2, 3, 4, 6, 8, 12, 16], True),
    (384, [1, 2, 3, 4, 6, 8, 12, 16], True),
    (15, [1, 3, 5, 15], False),
    (18, [1, 2, 3, 6, 9], True),  # EP 2 splits it: only counts no common size divides fail
])
def test_the_rule(count, divisors, splits):
    assert ep_divisors(count) == divisors
    assert splits_on_common_ep(count) is splits


def test_the_reason_and_the_counts_suggested():
    assert uneven_ep_reason(255) == ("no expert-parallel size of 2, 4, 8 or 16 divides it "
                                     "(255 = 3 x 5 x 17; only 1, 3, 5, 15 do)")
    assert "13 is prime" in uneven_ep_reason(13)
    assert even_counts_near(255, 8, 384) == [256, 248]
    assert even_counts_near(255, 8, 255) == [248]  # no more than the source has
    assert even_counts_near(5, 4, 16) == [8]  # 0 keeps fewer than the router's top-k
    assert even_counts_near(5, 4, 6) == [6, 4]  # no multiple of 8 in range: the neighbours


@pytest.mark.parametrize("command", ["reap", "run reap"])
@pytest.mark.parametrize("asked", [["--keep", "15"], ["--prune-ratio", "0.0625"]])
def test_an_uneven_keep_is_refused_before_dst_and_the_statistics(command, asked, stats_dir,
                                                                   tmp_path):
    dst = tmp_path / "out"
    res = cli_inproc(*command.split(), BUNDLED, dst, "--stats", stats_dir, *asked, "--quiet")
    assert_user_error(res, REFUSED, INSTEAD, code=2)
    assert not dst.exists()


def test_with_data_it_is_refused_before_the_calibration_reads_it(tmp_path):
    """The data file is not even valid JSONL: the refusal comes before anything reads it."""
    data = write_jsonl(tmp_path / "bad.jsonl", [{"neither": "text nor input_ids"}])
    dst = tmp_path / "out"
    res = cli_inproc("reap", BUNDLED, dst, "--data", data, "--keep", 15, "--samples", 4,
                     "--seq-len", 16, "--device", "cpu", "--quiet")
    assert_user_error(res, REFUSED, code=2)
    assert not dst.exists()


def test_a_plan_keeping_an_uneven_count_is_refused_before_dst(tmp_path):
    dst = tmp_path / "out"
    res = cli_inproc("reap", BUNDLED, dst, "--plan", plan_keeping(tmp_path / "p.json", 15),
                     "--quiet")
    assert_user_error(res, REFUSED, INSTEAD, code=2)
    assert not dst.exists()


@pytest.mark.parametrize("asked", [["--keep", "15"], ["--prune-ratio", "0.0625"], ["--plan"]])
def test_allow_uneven_ep_warns_and_writes(asked, stats_dir, tmp_path):
    source = (["--plan", plan_keeping(tmp_path / "p.json", 15)] if asked == ["--plan"]
              else ["--stats", stats_dir, *asked])
    res = cli_inproc("reap", BUNDLED, tmp_path / "out", *source, "--allow-uneven-ep", "--quiet")
    assert res.exit_code == 0, res.output
    assert WARNING in res.output and "(15 = 3 x 5; only 1, 3, 5, 15 do)" in res.output
    assert kept_experts(tmp_path / "out") == 15


@pytest.mark.parametrize("kept", [12, 8])
def test_counts_a_common_size_divides_pass_silently(kept, stats_dir, tmp_path):
    by_keep = cli_inproc("reap", BUNDLED, tmp_path / "k", "--stats", stats_dir, "--keep", kept,
                         "--quiet")
    by_plan = cli_inproc("reap", BUNDLED, tmp_path / "p", "--plan",
                         plan_keeping(tmp_path / "p.json", kept), "--quiet")
    for dst, res in ((tmp_path / "k", by_keep), (tmp_path / "p", by_plan)):
        assert res.exit_code == 0, res.output
        assert "expert-parallel size" not in res.output, res.output
        assert kept_experts(dst) == kept


def test_the_api_takes_the_flag(stats_dir, tmp_path):
    with pytest.raises(UsageError, match="keep 15: no expert-parallel size"):
        kconvert.reap(str(BUNDLED), str(tmp_path / "a"), stats=str(stats_dir), keep=15)
    said: list[str] = []
    kconvert.reap(str(BUNDLED), str(tmp_path / "b"), stats=str(stats_dir), keep=15,
                  allow_uneven_ep=True, echo=said.append)
    assert any(line.startswith(WARNING) for line in said), said
    assert kept_experts(tmp_path / "b") == 15

