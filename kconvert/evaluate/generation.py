"""The degeneration probe's statistics: what a source's and a candidate's continuations of the
same prompts say about loops, length finishes, diversity and where the two part ways.

Pure Python (no torch): the continuations come from `kconvert eval --generate` (the models
run by kconvert.evaluate.decode) or from any engine's JSONL (`--generations`,
kconvert.evaluate.completions). Per model: the share of continuations in each class of
kconvert.evaluate.loops (the loop rate is the share in the four loop classes), the length-limit
rate (no end of sequence within the limit), the distinct word-8-gram ratio (distinct 8-grams
of whitespace-separated words over all 8-grams, each continuation's own 8-grams pooled). Per
prompt: the first position where the two continuations differ (in tokens when both have them,
else characters; a continuation that is a prefix of the other differs at its end). The loop
rates' difference is judged by the pooled two-proportion z test.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

from kconvert.evaluate.loops import CLASSES, LoopRule, Verdict, classify

NGRAM = 8
# What a decoder writes for bytes that are not UTF-8: a model that emits broken byte sequences
# (a byte-level BPE's pieces out of order) shows it.
REPLACEMENT = "\ufffd"
# Worst examples the report lists, and the characters of each text it shows.
EXAMPLES = 3
SHOWN_CHARS = 240


@dataclass(frozen=True)
class Continuation:
    """One model's continuation of one prompt."""

    prompt: str
    text: str
    tokens: Sequence[int] | None = None  # its token ids, where known
    hit_limit: bool | None = None  # ran to the token limit without an end of sequence
    id: str | None = None


class ModelGeneration(BaseModel):
    continuations: int
    loops: int = Field(description="Continuations in a loop class")
    loop_rate: float = Field(description="loops / continuations")
    class_rates: dict[str, float] = Field(description=(
        "Share of continuations in each class (kconvert.evaluate.loops.CLASSES; they sum to "
        "1): repeated_character, single_token_loop, duplicate_line, repeated_ngram, "
        "length_finish, clean"))
    length_limit_rate: float | None = Field(description=(
        "Share that ran to the token limit without an end of sequence, loops included (None: "
        "not known, e.g. JSONL without finish_reason)"))
    distinct_8gram_ratio: float | None = Field(description=(
        "Distinct word 8-grams / all word 8-grams over the continuations (None: none has 8 "
        "words)"))
    replacement_rate: float = Field(description=(
        "Share of continuations holding U+FFFD, the replacement character (bytes that are not "
        "UTF-8)"))


class Example(BaseModel):
    index: int = Field(description="The prompt's place in the run (0-based)")
    id: str | None
    prompt_tail: str = Field(description="The prompt's last characters")
    source_class: str
    candidate_class: str
    source: str
    candidate: str


class GenerationReport(BaseModel):
    prompts: int
    new_tokens: int | None = Field(description="Token limit of each continuation (None: "
                                               "texts from another engine)")
    temperature: float | None = Field(description="0: greedy; None: not known (texts from "
                                                  "another engine)")
    sample_seed: int | None
    units: list[str] = Field(description="Where loops were looked for: tokens, words, "
                                         "characters")
    loop_rule: dict[str, int] = Field(description="max_period, min_copies, min_cover "
                                                  "(kconvert.evaluate.loops.LoopRule)")
    source: ModelGeneration
    candidate: ModelGeneration
    loop_rate_difference: float = Field(description="candidate.loop_rate - source.loop_rate")
    z: float = Field(description="Pooled two-proportion z of the difference (0 when both "
                                 "rates are 0 or both 1)")
    p: float = Field(description="Its two-sided p-value")
    divergence_unit: str = Field(description="tokens or characters")
    divergence_median: float = Field(description=(
        "Median over prompts of the first position where the continuations differ (a "
        "continuation that is a prefix of the other differs at its end; identical ones count "
        "their length)"))
    identical: float = Field(description="Share of prompts with identical continuations")
    examples: list[Example] = Field(description=(
        "The worst candidate loops beside the source's continuation: loops the source does "
        "not have first, then by the loop's cover"))


def two_proportion_z(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """(z, two-sided p) of x2/n2 against x1/n1 under the pooled two-proportion z test; equal
    pooled rates of 0 or 1 (no variance) give (0, 1)."""
    if n1 < 1 or n2 < 1:
        raise ValueError("both samples need at least one trial")
    pooled = (x1 + x2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:
        return 0.0, 1.0
    z = (x2 / n2 - x1 / n1) / se
    return z, math.erfc(abs(z) / math.sqrt(2))


def distinct_ngram_ratio(texts: Sequence[str], n: int = NGRAM) -> float | None:
    """Distinct word n-grams / all word n-grams, each text's own n-grams pooled (None: no
    text has n words)."""
    seen: set[tuple[str, ...]] = set()
    total = 0
    for text in texts:
        words = text.split()
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        seen.update(grams)
        total += len(grams)
    return len(seen) / total if total else None


def first_difference(a: Sequence, b: Sequence) -> int:
    """The first index where `a` and `b` differ (the shorter one's length when it is a prefix
    of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def model_stats(conts: Sequence[Continuation], verdicts: Sequence[Verdict]) -> ModelGeneration:
    n = len(conts)
    counts = dict.fromkeys(CLASSES, 0)
    for v in verdicts:
        counts[v.kind] += 1
    loops = sum(v.loops for v in verdicts)
    limits = [c.hit_limit for c in conts if c.hit_limit is not None]
    return ModelGeneration(
        continuations=n, loops=loops, loop_rate=loops / n,
        class_rates={k: c / n for k, c in counts.items()},
        length_limit_rate=sum(limits) / len(limits) if limits else None,
        distinct_8gram_ratio=distinct_ngram_ratio([c.text for c in conts]),
        replacement_rate=sum(REPLACEMENT in c.text for c in conts) / n)


def compare(source: Sequence[Continuation], candidate: Sequence[Continuation], rule: LoopRule,
            *, new_tokens: int | None = None, temperature: float | None = None,
            sample_seed: int | None = None) -> GenerationReport:
    """The probe's report of two models' continuations of the same prompts (paired in order)."""
    if len(source) != len(candidate) or not source:
        raise ValueError(f"{len(source)} source and {len(candidate)} candidate continuations: "
                         "the same positive number is needed")
    verdicts = [[classify(c.text, c.tokens, c.hit_limit, rule) for c in conts]
                for conts in (source, candidate)]
    src, cand = (model_stats(c, v) for c, v in zip((source, candidate), verdicts, strict=True))
    z, p = two_proportion_z(src.loops, src.continuations, cand.loops, cand.continuations)
    with_tokens = all(c.tokens is not None for c in (*source, *candidate))
    pairs = list(zip(source, candidate, strict=True))
    divergence = [first_difference(s.tokens, c.tokens) if with_tokens  # type: ignore[arg-type]
                  else first_difference(s.text, c.text) for s, c in pairs]
    identical = sum((s.tokens == c.tokens) if with_tokens else (s.text == c.text)
                    for s, c in pairs)
    return GenerationReport(
        prompts=len(source), new_tokens=new_tokens, temperature=temperature,
        sample_seed=sample_seed,
        units=["tokens", "words", "characters"] if with_tokens else ["words", "characters"],
        loop_rule={"max_period": rule.max_period, "min_copies": rule.min_copies,
                   "min_cover": rule.min_cover},
        source=src, candidate=cand, loop_rate_difference=cand.loop_rate - src.loop_rate,
        z=z, p=p, divergence_unit="tokens" if with_tokens else "characters",
        divergence_median=float(statistics.median(divergence)),
        identical=identical / len(pairs),
        examples=worst_examples(pairs, *verdicts))


def worst_examples(pairs: Sequence[tuple[Continuation, Continuation]],
                   source: Sequence[Verdict], candidate: Sequence[Verdict],
                   k: int = EXAMPLES) -> list[Example]:
    """The k candidate loops most worth reading: those the source does not share first, then
    the longest."""
    looping = [i for i, v in enumerate(candidate) if v.loops]
    looping.sort(key=lambda i: (source[i].loops, -candidate[i].severity, i))
    return [Example(index=i, id=pairs[i][1].id, prompt_tail=pairs[i][0].prompt[-80:],
                    source_class=source[i].kind, candidate_class=candidate[i].kind,
                    source=pairs[i][0].text[:SHOWN_CHARS],
                    candidate=pairs[i][1].text[:SHOWN_CHARS])
            for i in looping[:k]]


def render(report: GenerationReport, width: int = 100) -> str:
    """The probe's table, the test and the worst examples, each beside the source's."""
    rows = [("", "source", "candidate")]
    s, c = report.source, report.candidate

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    rows.append(("loop rate", f"{pct(s.loop_rate)} ({s.loops}/{s.continuations})",
                 f"{pct(c.loop_rate)} ({c.loops}/{c.continuations})"))
    rows += [(f"  {k.replace('_', ' ')}", pct(s.class_rates[k]), pct(c.class_rates[k]))
             for k in CLASSES]
    rows.append(("length-limit rate", pct(s.length_limit_rate), pct(c.length_limit_rate)))
    rows.append(("replacement characters", pct(s.replacement_rate), pct(c.replacement_rate)))
    rows.append(("distinct word 8-grams",
                 *("-" if m.distinct_8gram_ratio is None else f"{m.distinct_8gram_ratio:.3f}"
                   for m in (s, c))))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"generation: {report.prompts} prompts, "
             + (f"{report.new_tokens} new tokens, " if report.new_tokens else "")
             + ("greedy; " if report.temperature == 0 else "" if report.temperature is None
                else f"temperature {report.temperature}, seed {report.sample_seed}; ")
             + f"loops on {', '.join(report.units)} (period <= "
             f"{report.loop_rule['max_period']}, >= {report.loop_rule['min_copies']} copies, "
             f">= {report.loop_rule['min_cover']} covered)"]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                        for i, (v, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    median = f"{report.divergence_median:g} {report.divergence_unit}"
    lines.append(f"loop rate difference {100 * report.loop_rate_difference:+.1f} points: "
                 f"z {report.z:.2f}, p {report.p:.3g} (pooled two-proportion test)")
    lines.append(f"first divergence from the source: median {median}; identical "
                 f"{pct(report.identical)}")
    for ex in report.examples:
        lines.append(f"-- prompt {ex.index}" + (f" ({ex.id})" if ex.id else "")
                     + f": ...{ex.prompt_tail!r}")
        lines += side_by_side((f"source [{ex.source_class}]", ex.source),
                              (f"candidate [{ex.candidate_class}]", ex.candidate), width)
    return "\n".join(lines)


def side_by_side(left: tuple[str, str], right: tuple[str, str], width: int) -> list[str]:
    """Two titled texts in two columns of width // 2, escaped (newlines shown as \\n)."""
    col = max(20, width // 2 - 2)

    def cells(title: str, text: str) -> list[str]:
        body = repr(text)[1:-1]
        return [title[:col]] + [body[i:i + col] for i in range(0, len(body), col)]

    a, b = cells(*left), cells(*right)
    a += [""] * (len(b) - len(a))
    b += [""] * (len(a) - len(b))
    return [f"  {x.ljust(col)} | {y}" for x, y in zip(a, b, strict=True)]
