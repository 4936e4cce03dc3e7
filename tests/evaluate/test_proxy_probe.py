"""The degeneration probe on the Kimi-routed proxy (tests/fixtures/kimi-proxy), where the tiny
MoEs cannot show it: they loop on most prompts uncompressed (86.5% for tiny-moe-96), the proxy
on about 5%, so damage that makes a model loop stands out. p48 magnitude pruning of every
routed expert is such damage (on an H200 at 1,000 prompts: 45.9% against the source's 5.0%,
benchmarks/results/quality_lab); here the same commands on the CPU, on 64 prompts of 64 new
tokens, with the proxy's own BPE tokenizer reading text lines as Kimi's would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import cli_inproc

PROXY = ROOT / "tests" / "fixtures" / "kimi-proxy"
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 64, 32, 64


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    """Held-out stdlib text (files the proxy never trained on), one prompt a line."""
    path = tmp_path_factory.mktemp("proxy-probe") / "heldout.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_calibration_data.py"),
                    str(path), "--split", "heldout", "--samples", str(PROMPTS), "--seq-len",
                    "1024", "--text", "--seed", "1"], check=True, capture_output=True)
    return path


def test_pruning_that_makes_the_proxy_loop_is_found_significant(heldout, tmp_path):
    pruned = tmp_path / "p48"
    res = cli_inproc("sparsify", PROXY, pruned, "--method", "magnitude", "--device", "cpu",
                     "--quiet")
    assert res.exit_code == 0, res.output
    res = cli_inproc("eval", PROXY, pruned, "--data", heldout, "--seq-len", PROMPT_TOKENS,
                     "--samples", 2, "--device", "cpu", "--dtype", "float32", "--quiet",
                     "--json", "--generate", PROMPTS, "--prompt-tokens", PROMPT_TOKENS,
                     "--new-tokens", NEW_TOKENS, "--generate-batch-size", PROMPTS)
    assert res.exit_code == 0, res.output
    gen = json.loads(res.stdout)["generation"]
    assert gen["prompts"] == PROMPTS
    # the source loops on few held-out prompts, the pruned proxy on many more, significantly
    assert gen["source"]["loop_rate"] <= 0.15, gen["source"]
    assert gen["candidate"]["loop_rate"] >= gen["source"]["loop_rate"] + 0.15, gen
    assert gen["z"] > 0 and gen["p"] < 0.01, gen
