"""benchmarks overhead's split of a conversion process's wall: the phases add up to the wall,
each import is counted in the phase it began in, and a tree without the serve checks' marks
gets none of that phase."""

from __future__ import annotations

import math

import pytest

from benchmarks.overhead import PHASES, attribute

CLOCK = {
    "first": 100.0, "imported": 101.0, "ended": 107.5, "cuda_thread_s": None, "cpu_s": 4.0,
    "phases": {"prepare": [103.0, 103.0], "read_shape_values": [103.0, 103.1],
               "build_work_plan": [103.1, 103.5], "execute": [104.0, 106.0]},
    "events": {"run-finished": 106.5, "serve-start": 106.6, "serve-end": 107.2},
    "imports": [["kconvert", 100.2, 0.3], ["torch", 101.5, 1.0], ["numba", 103.6, 0.2],
                ["kconvert", 106.7, 0.1], ["tiny", 102.0, 0.01]],
}


def test_the_phases_add_up_to_the_process_and_hold_their_imports():
    got = attribute(8.0, 0.1, CLOCK, {"total": 4.0})
    assert math.isclose(sum(got[p] for p in PHASES), 8.0)
    assert got["interpreter_exit_s"] == pytest.approx(0.5)  # 8.0 - (107.5 - 100.0)
    assert got["exit_s"] == pytest.approx(0.4)
    assert (got["cli_import_s"], got["to_run_s"], got["plan_s"]) == pytest.approx((1, 2, 0.5))
    assert (got["startup_s"], got["execute_s"], got["finish_s"]) == pytest.approx((0.5, 2, 0.5))
    assert (got["serve_check_s"], got["after_s"]) == pytest.approx((0.7, 0.3))
    assert got["imports_by_phase"] == pytest.approx(
        {"cli_import_s": 0.3, "to_run_s": 1.01, "plan_s": 0, "startup_s": 0.2, "execute_s": 0,
         "finish_s": 0, "serve_check_s": 0.1, "after_s": 0})
    assert got["imports_s"] == pytest.approx(1.61)
    assert list(got["imports_by_package"]) == ["torch", "kconvert", "numba"]  # "tiny": < 0.05


def test_a_tree_without_the_serve_marks_has_no_serve_phase():
    events = {"run-finished": 106.5}
    got = attribute(8.0, 0.1, {**CLOCK, "events": events}, {"total": 4.0})
    assert got["serve_check_s"] == 0 and got["after_s"] == pytest.approx(1.0)
    assert math.isclose(sum(got[p] for p in PHASES), 8.0)
