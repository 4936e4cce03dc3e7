"""`kconvert eval --generate` on the trained tiny MoE: the probe against the model itself, a
candidate made to loop (its lm_head edited so one token always wins), the files it writes read
back by --generations, sampling, the refusal of a model that does not fit, and the KL on the
source's highest-entropy positions."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import ROOT
from helpers import assert_user_error, cli_inproc, edit_tensor, write_input_ids
from kconvert.errors import KconvertError
from kconvert.evaluate import decode
from kconvert.evaluate.decode import cache_bytes, check_fits, model_bytes
from kconvert.evaluate.metrics import high_entropy_mean
from kconvert.evaluate.probe import CANDIDATE_FILE, SOURCE_FILE
from kconvert.gpu.plan import gib
from kconvert.io.checkpoint import open_checkpoint
from kconvert.testing.tiny_moe import heldout_ids

TRAINED = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
# a loop of one token covers all 48 new tokens: the least the default loop rule counts
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 24, 48


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Held-out text of the trained tiny MoE, one prompt a line."""
    path = tmp_path_factory.mktemp("probe") / "heldout.jsonl"
    return write_input_ids(path, heldout_ids(PROMPTS * PROMPT_TOKENS, seed=5,
                                             window=PROMPT_TOKENS).reshape(PROMPTS, -1))


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    """The trained tiny MoE with an lm_head of zeros: every logit ties, so greedy decoding
    picks token 0 at every step, a loop on every prompt."""
    out = tmp_path_factory.mktemp("looping") / "m"
    shutil.copytree(TRAINED, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    edit_tensor(out / index["lm_head.weight"], "lm_head.weight", torch.zeros_like)
    return out


def probe(src, cand, data, *args, prompts: int = PROMPTS, new_tokens: int = NEW_TOKENS):
    res = cli_inproc("eval", src, cand, "--data", data, "--seq-len", PROMPT_TOKENS, "--samples",
                     2, "--device", "cpu", "--dtype", "float32", "--quiet", "--json",
                     "--generate", prompts, "--prompt-tokens", PROMPT_TOKENS, "--new-tokens",
                     new_tokens, *map(str, args))
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), res.stderr


def test_the_model_against_itself_differs_by_nothing(data, tmp_path):
    report, table = probe(TRAINED, TRAINED, data, "-o", tmp_path / "ev")
    gen = report["generation"]
    assert gen["source"] == gen["candidate"]
    assert (gen["loop_rate_difference"], gen["z"], gen["p"]) == (0.0, 0.0, 1.0)
    assert gen["identical"] == 1.0 and gen["divergence_median"] == NEW_TOKENS
    assert gen["prompts"] == PROMPTS and gen["units"] == ["tokens", "words", "characters"]
    assert report["candidates"][0]["logits"]["kl_high_entropy"] == 0
    assert "loop rate" in table and "z 0.00, p 1" in table
    # the files beside eval.json, read back by --generations, give the same statistics
    again = cli_inproc("eval", "--generations", tmp_path / "ev" / SOURCE_FILE,
                       tmp_path / "ev" / CANDIDATE_FILE, "--json")
    assert again.exit_code == 0, again.output
    read = json.loads(again.stdout)["generation"]
    for key in ("source", "candidate", "z", "p", "identical", "divergence_median", "units"):
        assert read[key] == gen[key], key


def test_a_candidate_made_to_loop_is_found_on_every_prompt(data, looping, tmp_path):
    report, table = probe(TRAINED, looping, data, "-o", tmp_path / "ev")
    gen = report["generation"]
    src, cand = gen["source"], gen["candidate"]
    assert cand["loop_rate"] == 1.0 and cand["loops"] == PROMPTS
    assert cand["class_rates"]["repeated_character"] == 1.0  # token 0 is one byte
    assert cand["length_limit_rate"] == 1.0
    assert gen["divergence_median"] < NEW_TOKENS and gen["identical"] == 0.0
    # the test as written in generation.two_proportion_z, from the two counts
    x1, x2, n = src["loops"], cand["loops"], PROMPTS
    if x1 < n:
        pooled = (x1 + x2) / (2 * n)
        z = (x2 - x1) / n / (pooled * (1 - pooled) * 2 / n) ** 0.5
        assert gen["z"] == pytest.approx(z) and gen["z"] > 0
    # the worst examples: the candidate's loops, the source's text beside each
    made = [json.loads(line) for line in
            (tmp_path / "ev" / CANDIDATE_FILE).read_text().splitlines()]
    assert all(set(row["token_ids"]) == {0} for row in made)
    assert gen["examples"] and all(ex["candidate_class"] == "repeated_character"
                                   for ex in gen["examples"])
    assert "candidate [repeated_character]" in table
    assert report["candidates"][0]["logits"]["kl_high_entropy"] > 0


def test_sampling_is_seeded(data):
    first, _ = probe(TRAINED, TRAINED, data, "--temperature", 1.0, "--sample-seed", 3,
                     prompts=4, new_tokens=8)
    gen = first["generation"]
    assert gen["temperature"] == 1.0 and gen["sample_seed"] == 3
    assert gen["identical"] == 1.0 and gen["z"] == 0.0  # one seed, one model: the same draws


def test_generate_options_need_generate_and_one_candidate(data):
    res = cli_inproc("eval", TRAINED, TRAINED, "--data", data, "--new-tokens", 8)
    assert_user_error(res, "--new-tokens applies only with --generate", code=2)
    res = cli_inproc("eval", TRAINED, TRAINED, TRAINED, "--data", data, "--generate", 2)
    assert_user_error(res, "--generate compares SRC with one CANDIDATE", code=2)


def test_a_model_that_does_not_fit_is_refused_in_one_line():
    ckpt = open_checkpoint(str(TRAINED))
    try:
        weights = model_bytes(ckpt.text_config, torch.bfloat16)
        # every decoder layer, embedding and lm_head of the fixture, counted from its tensors
        stored = sum(math.prod(t.shape) for t in ckpt.tensors.values()
                     if "norm" not in t.name and "e_score" not in t.name) * 2
        assert weights == stored
        with pytest.raises(KconvertError) as err:
            check_fits("SRC", ckpt, 16, 256, torch.bfloat16, torch.device("cuda"), weights)
        assert "\n" not in str(err.value)
        assert "--generate holds the whole model in memory: SRC needs" in str(err.value)
        assert "the GPU memory budget (--gpu-memory) is" in str(err.value)
        check_fits("SRC", ckpt, 16, 256, torch.bfloat16, torch.device("cuda"), 2 * weights)
    finally:
        ckpt.close()


def test_a_probe_that_does_not_fit_the_ram_stops_before_eval_runs(data, tmp_path,
                                                                  monkeypatch):
    """A machine with 1 MiB free: refused in one line before the teacher-forced pass."""
    monkeypatch.setattr(decode, "available_ram", lambda: 1 << 20)
    res = cli_inproc("eval", TRAINED, TRAINED, "--data", data, "--seq-len", PROMPT_TOKENS,
                     "--samples", 2, "--device", "cpu", "--generate", 2, "-o", tmp_path / "ev")
    text = json.loads((TRAINED / "config.json").read_text())
    need = model_bytes(text, torch.bfloat16) + cache_bytes(text, 2, 64 + 192, torch.bfloat16)
    assert_user_error(res, f"--generate holds the whole model in memory: {TRAINED} needs "
                      f"{gib(need)} (its weights in bfloat16 and the KV cache of 2 sequences "
                      "of 256 tokens) but the free RAM is 1.0 MiB")
    assert res.output.count("\n") == 1
    assert not (tmp_path / "ev" / "eval.json").exists()


def test_the_high_entropy_kl_is_the_mean_over_the_top_tenth():
    kl = torch.arange(20, dtype=torch.float64)
    entropy = torch.tensor([0.5] * 20, dtype=torch.float64)
    entropy[7], entropy[13] = 3.0, 2.0  # the two highest of 20 positions: 10%
    assert high_entropy_mean(kl, entropy) == (7 + 13) / 2
    assert high_entropy_mean(kl[:5], entropy[:5]) == 0  # ceil(0.5) = 1 position: the first tie


def test_the_cache_goes_under_the_name_the_decoder_layer_takes():
    """transformers renamed the decoder layer's KV-cache argument (past_key_values -> cache);
    a cache passed under the other name lands in **kwargs and is ignored."""
    class Older:
        def forward(self, hidden_states, past_key_values=None, **kwargs): ...

    class Newer:
        def forward(self, hidden_states, cache=None, **kwargs): ...

    assert decode.cache_keyword(Older) == "past_key_values"
    assert decode.cache_keyword(Newer) == "cache"


def test_a_layer_that_ignores_the_cache_is_refused_not_measured(data, monkeypatch):
    """Without its cache each step would attend to the new token alone: every continuation
    garbage and both loop rates meaningless. The probe refuses in one line instead."""
    monkeypatch.setattr(decode, "cache_keyword", lambda layer: "not_the_cache")
    res = cli_inproc("eval", TRAINED, TRAINED, "--data", data, "--seq-len", PROMPT_TOKENS,
                     "--samples", 2, "--device", "cpu", "--quiet", "--generate", 2,
                     "--prompt-tokens", PROMPT_TOKENS, "--new-tokens", 4)
    assert_user_error(res, "the KV cache holds 0 positions after 24 tokens",
                      "did not fill it")
