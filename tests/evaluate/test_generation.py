"""The degeneration probe's statistics (kconvert.evaluate.generation) and `kconvert eval
--generations` on JSONL files with planted loops, and its refusals of bad files."""

from __future__ import annotations

import json
import math

import pytest

from conftest import ROOT
from helpers import assert_user_error, cli_inproc, write_jsonl
from kconvert.evaluate.generation import (
    Continuation,
    compare,
    distinct_ngram_ratio,
    first_difference,
    two_proportion_z,
)
from kconvert.evaluate.loops import LoopRule

TOKENIZER = ROOT / "tests" / "fixtures" / "tiny-k2-thinking-int4"  # a tokenizer.json


def clean(i: int) -> str:
    """A continuation with no loop: words that never repeat."""
    return " ".join(f"v{i}w{j * 7 % 23}n{j}" for j in range(30))


def looping(i: int) -> str:
    """A continuation that ends in a loop of a phrase (period 10 characters, 80 covered)."""
    return f"start {i} and then " + "loop more " * 8


def rows(n: int, loops: set[int], reason: bool = True) -> list[dict]:
    return [{"id": f"p{i}", "prompt": f"prompt {i}:", "completion": looping(i) if i in loops
             else clean(i), **({"finish_reason": "length" if i in loops else "stop"}
                               if reason else {})}
            for i in range(n)]


def test_a_hand_computed_two_proportion_z():
    # 2 loops of 10 against 6 of 10: pooled p = 8/20 = 0.4, standard error
    # sqrt(0.4 x 0.6 x (1/10 + 1/10)) = sqrt(0.048) = 0.2190890; z = (0.6 - 0.2) / 0.2190890
    # = 1.8257419; two-sided p = erfc(1.8257419 / sqrt 2) = 0.0678892
    z, p = two_proportion_z(2, 10, 6, 10)
    assert z == pytest.approx(1.8257419, abs=1e-6)
    assert p == pytest.approx(0.0678892, abs=1e-6)
    assert two_proportion_z(6, 10, 2, 10)[0] == pytest.approx(-1.8257419, abs=1e-6)
    assert two_proportion_z(3, 10, 3, 10) == (0.0, 1.0)  # equal rates
    assert two_proportion_z(0, 10, 0, 20) == (0.0, 1.0)  # no variance at all
    assert two_proportion_z(10, 10, 20, 20) == (0.0, 1.0)


def test_distinct_ngrams_and_first_difference():
    assert distinct_ngram_ratio(["a b c d e f g h i"]) == 1.0  # two 8-grams, both distinct
    assert distinct_ngram_ratio(["a b c d e f g h", "a b c d e f g h"]) == 0.5
    assert distinct_ngram_ratio(["too short"]) is None
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference("abc", "abcdef") == 3
    assert first_difference("abc", "abc") == 3


def test_the_replacement_character_rate():
    conts = [Continuation("p", "broken \ufffd byte"), Continuation("p", "fine"),
             Continuation("p", "\ufffd\ufffd"), Continuation("p", "fine too")]
    report = compare(conts, conts[::-1], LoopRule())
    assert report.source.replacement_rate == report.candidate.replacement_rate == 0.5


def test_identical_continuations_give_no_difference():
    conts = [Continuation(f"p{i}", looping(i) if i % 3 == 0 else clean(i), hit_limit=i % 2 == 0)
             for i in range(12)]
    report = compare(conts, conts, LoopRule())
    assert report.source == report.candidate
    assert report.source.loop_rate == pytest.approx(4 / 12)
    assert (report.loop_rate_difference, report.z, report.p) == (0.0, 0.0, 1.0)
    assert report.identical == 1.0
    assert report.divergence_median == statistics_median_length(conts)


def statistics_median_length(conts: list[Continuation]) -> float:
    lengths = sorted(len(c.text) for c in conts)
    return (lengths[5] + lengths[6]) / 2


def test_generations_find_planted_loops_at_their_share(tmp_path):
    """4 of 40 source lines loop, 16 of 40 candidate lines (the source's 4 and 12 more); the
    candidate file's lines are in another order (paired by id)."""
    src = write_jsonl(tmp_path / "src.jsonl", rows(40, set(range(0, 40, 10))))
    cand_rows = rows(40, set(range(0, 40, 10)) | set(range(1, 40, 3)))
    n_cand = sum(r["completion"].endswith("loop more ") for r in cand_rows)
    cand = write_jsonl(tmp_path / "cand.jsonl", reversed(cand_rows))
    res = cli_inproc("eval", "--generations", src, cand, "--json")
    assert res.exit_code == 0, res.output
    gen = json.loads(res.stdout)["generation"]
    assert gen["source"]["loop_rate"] == 4 / 40
    assert gen["candidate"]["loop_rate"] == n_cand / 40 == 16 / 40
    assert gen["candidate"]["class_rates"]["repeated_ngram"] == 16 / 40
    assert gen["candidate"]["class_rates"]["clean"] == 24 / 40
    assert gen["source"]["length_limit_rate"] == 4 / 40
    pooled = 20 / 80
    z = (16 / 40 - 4 / 40) / math.sqrt(pooled * (1 - pooled) * (2 / 40))
    assert gen["z"] == pytest.approx(z) and gen["p"] == pytest.approx(math.erfc(z / 2 ** 0.5))
    assert gen["units"] == ["words", "characters"] and gen["temperature"] is None
    # the worst examples: candidate loops the source does not share, beside its text
    assert len(gen["examples"]) == 3
    for ex in gen["examples"]:
        assert ex["source_class"] == "clean" and ex["candidate_class"] == "repeated_ngram"
        assert ex["candidate"] == looping(ex["index"])
    text = cli_inproc("eval", "--generations", src, cand)
    assert text.exit_code == 0, text.output
    assert "loop rate" in text.output
    assert f"z {z:.2f}, p {math.erfc(z / 2 ** 0.5):.3g}" in text.output


def test_without_ids_lines_pair_in_order_and_tokens_come_from_a_tokenizer(tmp_path):
    lines = [{"prompt": f"q{i}", "completion": "hello world " * 6 if i < 2 else clean(i)}
             for i in range(5)]
    src = write_jsonl(tmp_path / "src.jsonl", lines)
    res = cli_inproc("eval", "--generations", src, src, "--tokenizer", TOKENIZER, "--json")
    assert res.exit_code == 0, res.output
    gen = json.loads(res.stdout)["generation"]
    assert gen["units"] == ["tokens", "words", "characters"]
    assert gen["source"]["loop_rate"] == gen["candidate"]["loop_rate"] == 2 / 5
    assert gen["source"]["length_limit_rate"] is None  # no finish_reason given
    assert (gen["z"], gen["p"], gen["identical"]) == (0.0, 1.0, 1.0)


@pytest.mark.parametrize(("src_lines", "cand_lines", "said", "bad"), [
    (['{"prompt": "a", "completion": "b"}', '{"prompt": "c"}'], None,
     'line 2 has no "completion"', "src"),
    (['{"completion": "b"}'], None, 'line 1 has no "prompt"', "src"),
    (['{"prompt": "a", "completion": "b"}', "{not json"], None, "line 2 is not JSON", "src"),
    (['{"prompt": "a", "completion": ""}'], None, "line 1: the completion is empty", "src"),
    (['{"prompt": "", "completion": "b"}'], None, "line 1: the prompt is empty", "src"),
    (["[1, 2]"], None, "line 1 is not a JSON object", "src"),
    ([], None, "holds no line", "src"),
    (['{"prompt": "a", "completion": "b"}'] * 2, ['{"prompt": "a", "completion": "b"}'],
     "holds 2 generations", "cand"),
    (['{"id": 1, "prompt": "a", "completion": "b"}'],
     ['{"id": 2, "prompt": "a", "completion": "b"}'], "the two files' ids differ", "cand"),
    (['{"id": 1, "prompt": "a", "completion": "b"}', '{"id": 1, "prompt": "a", "completion": "c"}'],
     None, "line 2: id '1' is also on line 1", "src"),
    (['{"prompt": "a", "completion": "b"}'], ['{"prompt": "z", "completion": "b"}'],
     "line 1: its prompt is not the prompt of", "cand"),
])
def test_bad_generation_files_are_refused_before_any_work(src_lines, cand_lines, said, bad,
                                                           tmp_path):
    """Each one line, exit 1, naming the file; checked before the tokenizer (which does not
    exist here) is even looked for."""
    src, cand = tmp_path / "src.jsonl", tmp_path / "cand.jsonl"
    src.write_text("".join(line + "\n" for line in src_lines))
    if cand_lines is None:  # a file bad by itself, against itself
        cand = src
    else:
        cand.write_text("".join(line + "\n" for line in cand_lines))
    res = cli_inproc("eval", "--generations", src, cand, "--tokenizer", tmp_path / "none")
    assert_user_error(res, said, str(src if bad == "src" else cand))
    assert res.output.count("kconvert: error:") == 1


def test_an_empty_completion_that_stopped_is_an_answer(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "",
                                              "finish_reason": "stop"}])
    res = cli_inproc("eval", "--generations", src, src, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["generation"]["source"]["class_rates"]["clean"] == 1.0


@pytest.mark.parametrize(("args", "said"), [
    (["--data", "DATA"], "--generations compares two files"),
    (["--generate", "4"], "--generations compares two files"),
])
def test_generations_take_no_checkpoint_options(args, said, tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", rows(2, set()))
    args = [src if a == "DATA" else a for a in args]
    assert_user_error(cli_inproc("eval", "--generations", src, src, *args), said, code=2)
