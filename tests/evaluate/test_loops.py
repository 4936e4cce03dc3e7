"""The degeneration probe's loop detector and classes (kconvert.evaluate.loops), on crafted
strings and token lists."""

from __future__ import annotations

import pytest

from kconvert.evaluate.loops import (
    CLEAN,
    DUPLICATE_LINE,
    LENGTH_FINISH,
    REPEATED_CHARACTER,
    REPEATED_NGRAM,
    SINGLE_TOKEN_LOOP,
    Cycle,
    LoopRule,
    classify,
    tail_cycle,
)

RULE = LoopRule()  # period <= 128, >= 3 copies, >= 48 covered
# Words that never repeat: no tail of them is a cycle of words or characters.
CLEAN_TEXT = " ".join(f"w{i * 37 % 101}x{i}" for i in range(60))


def test_the_tail_cycle_is_the_smallest_period_and_its_cover():
    # 10 elements of prefix, then "abc" 20 times and "ab": 62 trailing elements repeat "abc"
    seq = list("0123456789") + list("abc" * 20 + "ab")
    assert tail_cycle(seq, RULE) == Cycle(period=3, cover=62)
    assert tail_cycle("x" * 47, RULE) is None  # 47 < min_cover
    assert tail_cycle("y" + "x" * 48, RULE) == Cycle(1, 48)
    # period 40 with 2.5 copies: 100 elements cover >= 48 but fewer than 3 copies
    block = "".join(chr(65 + i % 26) + str(i) for i in range(20))  # 40 distinct-ish chars
    assert len(block) == 50 and tail_cycle(block * 2, RULE) is None
    assert tail_cycle(block * 3, RULE) == Cycle(50, 150)
    assert tail_cycle(block * 3, LoopRule(max_period=49)) is None
    assert tail_cycle(list(range(10)) * 5, LoopRule(min_copies=5, min_cover=50)) == Cycle(10, 50)


def test_a_cycle_must_reach_the_end():
    looped_then_clean = "ab" * 40 + CLEAN_TEXT
    assert tail_cycle(looped_then_clean, RULE) is None
    assert classify(looped_then_clean, None, False, RULE).kind == CLEAN


@pytest.mark.parametrize(("text", "tokens", "hit_limit", "kind", "unit"), [
    ("The answer is " + "!" * 60, None, True, REPEATED_CHARACTER, "characters"),
    # one token whose text is a word: the characters repeat with period 7, the tokens with 1
    ("It said " + "saliva " * 60, [11, 12] + [99] * 60, True, SINGLE_TOKEN_LOOP, "tokens"),
    # three copies of a 29-character line and a fourth cut short
    ("intro\n" + "the same line is here, again\n" * 3 + "the sa", None, True, DUPLICATE_LINE,
     None),
    # a line longer than the longest period: only the line check sees it
    ("x\n" + ("a long line " + "z" * 150 + "\n") * 3, None, False, DUPLICATE_LINE, None),
    ("prefix " + "one two three " * 10, None, True, REPEATED_NGRAM, "characters"),
    # 20 distinct words of ~8 characters: a 180-character cycle, seen only on words
    ("start " + "".join(f"word{i:04d} " for i in range(20)) * 3, None, True, REPEATED_NGRAM,
     "words"),
    ("0 1 " + " ".join(["a", "b"] * 30), [5, 6, 7] + [1, 2, 3, 4] * 15, False, REPEATED_NGRAM,
     "tokens"),
    (CLEAN_TEXT, None, True, LENGTH_FINISH, None),
    (CLEAN_TEXT, list(range(60)), False, CLEAN, None),
    (CLEAN_TEXT, None, None, CLEAN, None),
])
def test_each_class_on_a_crafted_continuation(text, tokens, hit_limit, kind, unit):
    verdict = classify(text, tokens, hit_limit, RULE)
    assert verdict.kind == kind
    assert verdict.unit == unit
    assert verdict.loops == (kind not in (LENGTH_FINISH, CLEAN))


def test_a_rule_that_cannot_be_a_loop_is_refused():
    with pytest.raises(ValueError, match="at least 2 copies"):
        LoopRule(min_copies=1)
