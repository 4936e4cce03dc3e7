"""Calibration data is checked when it is read, by every data-driven command (calibrate, eval,
reap --data, GPTQ, SparseGPT), before the model is touched: data that cannot fill --samples x
--seq-len is an error saying what it holds (with --allow-short-data a warning, and the output
records what was used); a token id beyond the vocabulary names the file, line and id (a dry run
refuses it too); text without a tokenizer says so; REAP says when the data never reached experts
it keeps."""

from __future__ import annotations

import json

import pytest

from conftest import BUNDLED, ROOT
from helpers import assert_user_error, cli_inproc, write_input_ids, write_jsonl

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


def _commands(data, out):
    """Each data-driven command on `data`, writing under `out`."""
    cpu = ["--device", "cpu", "--quiet"]
    return {
        "calibrate": ["calibrate", TINY_MOE, "--data", data, "-o", out / "stats", *cpu],
        "eval": ["eval", TINY_MOE, TINY_MOE, "--data", data, *cpu],
        "reap": ["reap", TINY_MOE, out / "reap", "--data", data, "--keep", 12, *cpu],
        "gptq": ["int4-to-nvfp4", BUNDLED, out / "gptq", "--method", "gptq", "--data", data,
                 *cpu],
        "sparsegpt": ["sparsify", BUNDLED, out / "sgpt", "--method", "sparsegpt", "--data",
                      data, *cpu],
    }


@pytest.mark.parametrize("command", ["calibrate", "eval", "reap", "gptq", "sparsegpt"])
def test_data_that_cannot_fill_samples_is_an_error_saying_what_it_holds(tmp_path, command):
    one = write_input_ids(tmp_path / "onetoken.jsonl", [[5]])
    args = _commands(one, tmp_path)[command]
    res = cli_inproc(*args, "--samples", 16, "--seq-len", 128)
    assert_user_error(res, "onetoken.jsonl holds 1 tokens in 1 line(s): 0 full sequence(s) of "
                           "128 tokens and one of 1, fewer than --samples 16 x --seq-len 128",
                      "--allow-short-data")
    assert not [p for p in tmp_path.iterdir() if p.name != "onetoken.jsonl"]


def test_allow_short_data_warns_and_the_output_records_what_was_used(tmp_path):
    """3 sequences of 16 tokens where 8 are asked."""
    data = write_input_ids(tmp_path / "d.jsonl", [[(7 * i + j) % 250 for j in range(16)]
                                                   for i in range(3)])
    made = _commands(data, tmp_path)
    for command in ("calibrate", "reap", "gptq"):
        res = cli_inproc(*made[command], "--samples", 8, "--seq-len", 16, "--allow-short-data")
        assert res.exit_code == 0, res.output
        assert "kconvert: warning:" in res.output and "d.jsonl holds 48 tokens" in res.output
    meta = json.loads((tmp_path / "stats" / "stats.json").read_text())
    assert (meta["samples"], meta["tokens"]) == (3, 48)
    for dst, stage in (("reap", "prune"), ("gptq", "quantize")):
        recorded = json.loads((tmp_path / dst / "kconvert-manifest.json").read_text())
        data_record = recorded["options"][stage]["data"]
        assert (data_record["samples"], data_record["seq_len"], data_record["tokens"]) == \
            (3, 16, 48), data_record


@pytest.mark.parametrize("command", ["calibrate", "eval", "reap", "gptq", "sparsegpt"])
def test_a_token_id_beyond_the_vocabulary_names_file_line_and_id(tmp_path, command,
                                                                 monkeypatch):
    """Found when the data is read: the model's layers are never read."""
    from kconvert.calibrate import load

    def never(*_args, **_kwargs):
        raise AssertionError("a layer was read before the data was checked")

    monkeypatch.setattr(load, "read_layer", never)
    vocab = 512 if command in ("gptq", "sparsegpt") else 258  # the bundled INT4, the tiny MoE
    data = write_input_ids(tmp_path / "d.jsonl", [[1, 2, 3, 4], [5, vocab + 88, 7, 8]])
    res = cli_inproc(*_commands(data, tmp_path)[command], "--samples", 2, "--seq-len", 4)
    assert_user_error(res, f"line 2: token id {vocab + 88} is beyond the model's vocabulary "
                           f"(vocab_size {vocab}: ids 0..{vocab - 1})", str(data))


@pytest.mark.parametrize("command", ["reap", "gptq"])
def test_a_dry_run_refuses_such_data(tmp_path, command):
    data = write_input_ids(tmp_path / "d.jsonl", [[1, 2, 3, 4], [5, 700, 7, 8]])
    res = cli_inproc(*_commands(data, tmp_path)[command], "--samples", 2, "--seq-len", 4,
                     "--dry-run")
    assert_user_error(res, "line 2: token id", "beyond the model's vocabulary")


def test_text_without_a_tokenizer_says_so(tmp_path):
    """The trained tiny MoE ships no tokenizer (transformers failed with an attribute error)."""
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "def main():\n    pass\n"}])
    res = cli_inproc("calibrate", TINY_MOE, "--data", data, "-o", tmp_path / "s", "--samples", 1,
                     "--seq-len", 4, "--device", "cpu")
    assert_user_error(res, "line 1 has text or messages, which need a tokenizer",
                      f"{TINY_MOE} has no tokenizer", "input_ids")
    assert "attribute" not in res.output


def test_reap_says_when_it_keeps_experts_the_data_never_reached(tmp_path):
    """8 tokens route to at most 8 x 4 of 24 experts: keeping 22 keeps some never routed."""
    data = write_input_ids(tmp_path / "d.jsonl", [[3, 3, 3, 3, 3, 3, 3, 3]])
    res = cli_inproc("reap", TINY_MOE, tmp_path / "o", "--data", data, "--keep", 22,
                     "--samples", 1, "--seq-len", 8, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    assert "were never routed a calibration token, so they were kept by the lower-id rule" \
        in res.output
