"""The quality lab's goals and merge (benchmarks.quality.quality_table) on rows made by hand:
each goal judged from the rows it names, "not measured" where a row or the probe's prompts are
missing, and parts of one table joined only when they are parts of one table."""

from __future__ import annotations

import pytest

from benchmarks.quality.quality_table import goals, loops_not_above, merge


def row(name: str, kl: float, loops: tuple[float, float, float] | None = None,
        prompts: int = 1000) -> dict:
    """A row with its KL and, given (candidate loop rate, z, p), its probe."""
    gen = None if loops is None else {
        "prompts": prompts, "candidate": {"loop_rate": loops[0]}, "source": {"loop_rate": 0.05},
        "z": loops[1], "p": loops[2]}
    return {"row": name, "logits": {"kl_mean": kl}, "generation": gen}


def by_goal(rows: list[dict]) -> dict[str, dict]:
    return {g["goal"].split(" at most")[0].split(" (")[0]: g for g in goals(rows, 384)}


def test_each_goal_is_the_ratio_of_the_rows_it_names():
    rows = [row("reap192-reap", 2.0), row("reap192-router-down", 0.9, (0.06, 1.0, 0.3)),
            row("reap192-none-down", 1.2), row("p48-sparsegpt", 1.0), row("p48-learned", 0.5),
            row("nvfp4-gptq", 0.1), row("nvfp4-learned", 0.09), row("reap-gptq", 1.2)]
    g = by_goal(rows)
    best = g["REAP keep 192 with the best repair/compensation"]
    assert best["row"] == "reap192-router-down" and best["ratio"] == 0.45 and best["met"]
    assert g["... and its loop rate not significantly above the source's"]["met"] is True
    assert g["p48 learned"]["ratio"] == 0.5 and g["p48 learned"]["met"]
    assert g["NVFP4 learned"]["ratio"] == 0.9 and not g["NVFP4 learned"]["met"]
    # REAP + GPTQ against the sum of each alone: 1.2 / (0.9 + 0.1)
    assert g["REAP 192 + GPTQ NVFP4"]["ratio"] == 1.2 and not g["REAP 192 + GPTQ NVFP4"]["met"]


def test_a_missing_row_or_a_small_probe_is_not_measured():
    g = by_goal([row("reap192-reap", 2.0), row("reap192-router-down", 0.9, (0.3, 5.0, 1e-6),
                                                prompts=999)])
    assert g["p48 learned"]["met"] is None and g["p48 learned"]["figure"] == "not measured"
    loops = g["... and its loop rate not significantly above the source's"]
    assert loops["met"] is None  # 999 prompts: fewer than the goal needs


def test_a_loop_rate_below_the_sources_passes_whatever_its_p():
    assert loops_not_above(row("r", 1, (0.01, -4.0, 1e-4)))
    assert not loops_not_above(row("r", 1, (0.09, 4.0, 1e-4)))
    assert loops_not_above(row("r", 1, (0.06, 1.0, 0.3)))
    assert loops_not_above(row("r", 1)) is None


def test_the_restoring_keep_is_the_smallest_whose_loops_pass():
    rows = [row(f"reap{k}-router-down", 1.0, (rate, z, p)) for k, rate, z, p in
            ((192, 0.1, 4.0, 1e-5), (240, 0.06, 1.0, 0.2), (288, 0.09, 3.0, 0.003),
             (336, 0.05, 0.0, 1.0))]
    g = goals(rows, 384)[-1]
    assert g["figure"] == "keep 240" and g["met"]
    assert g["judged"] == {192: False, 240: True, 288: False, 336: True}


def part(rows: list[dict], **settings) -> dict:
    return {"record": {"bench": "quality_lab"}, "source": "proxy", "experts": 384,
            "samples": 64} | settings | {"rows": rows}


def test_parts_of_one_table_are_joined_and_others_refused():
    joined = merge([part([row("a", 1.0)]), part([row("b", 2.0)])])
    assert [r["row"] for r in joined["rows"]] == ["a", "b"] and len(joined["records"]) == 2
    again = merge([joined, part([row("c", 3.0)])])  # an earlier merge is a part too
    assert [r["row"] for r in again["rows"]] == ["a", "b", "c"] and len(again["records"]) == 3
    with pytest.raises(SystemExit, match="differ in samples"):
        merge([part([row("a", 1.0)]), part([row("b", 2.0)], samples=384)])
    with pytest.raises(SystemExit, match="measured twice: a"):
        merge([part([row("a", 1.0)]), part([row("a", 2.0)])])
