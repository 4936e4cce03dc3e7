"""Degeneration in one continuation: whether its tail repeats one cycle, and of what kind.

A sequence (tokens, words or characters) "loops" when its tail is one cycle repeated: for some
period p in 1..max_period, the last L >= max(min_copies x p, min_cover) elements each equal the
element p before them (the last copy may be cut short). The smallest such p is reported. This
is the check vLLM runs on a request's output tokens when `repetition_detection` is set
(`RepetitionDetectionParams(min_pattern_size, max_pattern_size, min_count)`,
`vllm/v1/core/sched/utils.py: check_sequence_repetition`: the last pattern_len x min_count
tokens are min_count exact copies), with one more bound, `min_cover`: vLLM with min_count 3
fires on three spaces of indentation; a loop here covers at least 48 elements by default, so a
period-1 loop needs 48 copies and a period-16 loop 3. llama.cpp has no such detector: it only
penalises repeats while sampling (`--repeat-last-n` 64 tokens with `--repeat-penalty`, and DRY:
`--dry-allowed-length` 2, `--dry-base` 1.75, `--dry-penalty-last-n` -1 = the whole context,
off while `--dry-multiplier` is 0); docs/eval-generation.md sets the three side by side.

Each continuation gets one class, the first that applies, in `CLASSES` order (the kinds the
published REAP Kimi-K2.6 NVFP4 card's degeneracy sweep looked for): a repeated character (the
characters' tail is one character), a single-token loop (the tokens' tail is one token), a
duplicate line (the last `min_copies` complete lines are one non-blank line), a repeated n-gram
(any other cycle of tokens, words or characters), a length finish (no loop, but the
continuation ran to the token limit without an end of sequence), clean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPEATED_CHARACTER = "repeated_character"
SINGLE_TOKEN_LOOP = "single_token_loop"
DUPLICATE_LINE = "duplicate_line"
REPEATED_NGRAM = "repeated_ngram"
LENGTH_FINISH = "length_finish"
CLEAN = "clean"
CLASSES = (REPEATED_CHARACTER, SINGLE_TOKEN_LOOP, DUPLICATE_LINE, REPEATED_NGRAM,
           LENGTH_FINISH, CLEAN)
# The classes that are loops (the loop rate counts these).
LOOP_CLASSES = CLASSES[:4]


@dataclass(frozen=True)
class LoopRule:
    """When a tail counts as a loop (module docstring); one rule for tokens, words and
    characters alike."""

    max_period: int = 128
    min_copies: int = 3
    min_cover: int = 48

    def __post_init__(self) -> None:
        if self.max_period < 1 or self.min_copies < 2 or self.min_cover < 1:
            raise ValueError(f"a loop needs a period of at least 1, at least 2 copies and a "
                             f"cover of at least 1 (got {self.max_period}, {self.min_copies}, "
                             f"{self.min_cover})")


@dataclass(frozen=True)
class Cycle:
    """A looping tail: its period and how many trailing elements repeat it."""

    period: int
    cover: int

    @property
    def copies(self) -> float:
        return self.cover / self.period


def tail_cycle(seq: Sequence, rule: LoopRule) -> Cycle | None:
    """The smallest period whose cycle the tail of `seq` repeats under `rule`, or None."""
    n = len(seq)
    for p in range(1, min(rule.max_period, n // rule.min_copies) + 1):
        i = n - 1
        while i >= p and seq[i] == seq[i - p]:
            i -= 1
        cover = n - 1 - i + p  # the matching run, and the first copy it matched against
        if cover >= rule.min_copies * p and cover >= rule.min_cover:
            return Cycle(p, cover)
    return None


def duplicate_line(text: str, copies: int) -> bool:
    """Whether the last `copies` complete lines of `text` are one non-blank line (a last line
    cut short by the limit, a prefix of the line before it, is left out)."""
    lines = text.split("\n")
    if len(lines) > 1 and lines[-2].startswith(lines[-1]):
        lines = lines[:-1]
    tail = lines[-copies:]
    return len(tail) == copies and bool(tail[0].strip()) and len(set(tail)) == 1


@dataclass(frozen=True)
class Verdict:
    """One continuation's class and the cycle that made it a loop (None: not a loop; a
    duplicate line reports no cycle)."""

    kind: str
    cycle: Cycle | None = None
    unit: str | None = None  # "tokens", "words" or "characters": where the cycle was found

    @property
    def loops(self) -> bool:
        return self.kind in LOOP_CLASSES

    @property
    def severity(self) -> int:
        """How much of the continuation the loop covers, in its unit (0: no cycle)."""
        return self.cycle.cover if self.cycle is not None else 0


def classify(text: str, tokens: Sequence[int] | None, hit_limit: bool | None,
             rule: LoopRule) -> Verdict:
    """The class of one continuation: its text, its token ids where known, and whether it ran
    to the token limit without an end of sequence (None: unknown)."""
    chars = tail_cycle(text, rule)
    if chars is not None and chars.period == 1:
        return Verdict(REPEATED_CHARACTER, chars, "characters")
    token_cycle = tail_cycle(tokens, rule) if tokens is not None else None
    if token_cycle is not None and token_cycle.period == 1:
        return Verdict(SINGLE_TOKEN_LOOP, token_cycle, "tokens")
    if duplicate_line(text, rule.min_copies):
        return Verdict(DUPLICATE_LINE)
    for unit, cycle in (("tokens", token_cycle), ("words", tail_cycle(text.split(), rule)),
                        ("characters", chars)):
        if cycle is not None:
            return Verdict(REPEATED_NGRAM, cycle, unit)
    return Verdict(LENGTH_FINISH if hit_limit else CLEAN)
