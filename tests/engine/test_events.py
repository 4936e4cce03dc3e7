"""The engine's timing events (kconvert.common.events): every step of every work item, once, in the
thread that did it, in causal order, with byte counts that add up to the source and output
files; nothing timed when nobody listens."""

from __future__ import annotations

import itertools
import json
import threading
from collections import defaultdict

import pytest

from conftest import BUNDLED
from helpers import data_bytes, run_inproc
from kconvert.common import events
from kconvert.engine import work

ITEM_STEPS = ("read", "wait-read", "compute", "wait-put", "hash", "wait-get", "write",
              "wait-hash")



@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One CPU conversion of the bundled fixture with a timing listener and a plain one; copy
    items of 16 KiB, so that there are many items (58) and tensors span several."""
    timed: list[tuple[str, dict]] = []
    plain: list[str] = []
    dst = tmp_path_factory.mktemp("events") / "out"
    stop_timed = events.subscribe(lambda e, info: timed.append((e, info)), timings=True)
    stop_plain = events.subscribe(lambda e, info: plain.append(e))
    try:
        assert events.timing
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(work, "COPY_CHUNK", 1 << 14)
            run_inproc("int4-to-nvfp4", BUNDLED, dst)
    finally:
        stop_timed()
        stop_plain()
    return timed, plain, dst


def test_every_item_has_each_step_once_in_its_thread_in_causal_order(recorded):
    timed, _, _ = recorded
    steps: dict[str, dict[int, dict]] = defaultdict(dict)
    for event, info in timed:
        if event in ITEM_STEPS and info["item"] is not None:
            assert info["item"] not in steps[event], (event, info)
            steps[event][info["item"]] = info
    items = sorted(steps["read"])
    assert len(items) > 20 and items == list(range(len(items)))  # a fresh run: every item
    kinds = {i: steps["read"][i]["kind"] for i in items}
    assert set(kinds.values()) == {"copy", "transform"}
    main = threading.current_thread().name
    threads = {"read": "kconvert-read_", "wait-read": main, "compute": main, "wait-put": main,
               "hash": "kconvert-hash_", "wait-get": "kconvert-writer",
               "write": "kconvert-writer", "wait-hash": "kconvert-writer"}
    for step in ITEM_STEPS:
        assert sorted(steps[step]) == items, step
        for i, info in steps[step].items():
            assert (info["kind"], info["nbytes"]) == (kinds[i], steps["read"][i]["nbytes"])
            assert info["start"] <= info["end"]
            assert info["thread"].startswith(threads[step]), (step, info["thread"])
    for i in items:
        s = {step: steps[step][i] for step in ITEM_STEPS}
        assert s["read"]["end"] <= s["wait-read"]["end"] <= s["compute"]["start"]
        assert s["compute"]["end"] <= s["wait-put"]["start"]
        assert s["compute"]["end"] <= s["hash"]["start"]
        assert s["wait-get"]["end"] <= s["write"]["start"]
        assert s["write"]["start"] <= s["wait-hash"]["start"]
        assert s["hash"]["end"] <= s["wait-hash"]["end"] <= s["write"]["end"]
    # Items are computed and written in plan order, one after another.
    for step in ("compute", "write"):
        spans = [steps[step][i] for i in items]
        assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(spans))
    # One more wait each at the end: for no item left to read, for the end-of-run mark.
    ends = {e: info for e, info in timed if e in ITEM_STEPS and info["item"] is None}
    assert sorted(ends) == ["wait-get", "wait-read"]
    assert sum(e in ("wait-get", "wait-read") and i["item"] is None for e, i in timed) == 2
    assert ends["wait-read"]["start"] >= steps["compute"][items[-1]]["end"]
    assert ends["wait-get"]["start"] >= steps["write"][items[-1]]["end"]


def test_bytes_add_up_to_the_source_and_output_files(recorded):
    timed, _, dst = recorded
    reads = sum(info["nbytes"] for e, info in timed if e == "read")
    assert reads == sum(data_bytes(p) for p in BUNDLED.glob("*.safetensors"))
    pwrites: dict[str, int] = defaultdict(int)
    fsyncs = []
    for event, info in timed:
        if event == "pwrite":
            assert info["thread"] == "kconvert-writer"
            pwrites[info["shard"]] += info["nbytes"]
        elif event == "fsync":
            fsyncs.append((info["shard"], info["nbytes"]))
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert sorted(pwrites) == shards
    assert all(pwrites[s] == data_bytes(dst / s) for s in shards)
    assert sorted(fsyncs) == [(s, (dst / s).stat().st_size) for s in shards]
    # Each shard is flushed after its last pwrite and before the run says it is done.
    order = [(e, info.get("shard")) for e, info in timed]
    for s in shards:
        last_pwrite = max(i for i, x in enumerate(order) if x == ("pwrite", s))
        assert last_pwrite < order.index(("fsync", s)) < order.index(("shard-done", s))
    manifest = json.loads((dst / "kconvert-manifest.json").read_text())
    assert sum(1 for e, _ in timed if e == "pwrite") >= len(manifest["tensors"])


def test_phases_nest_and_run_events_reach_every_listener(recorded):
    timed, plain, _ = recorded
    phases = {info["name"]: info for e, info in timed if e == "phase"}
    assert sorted(phases) == ["build_work_plan", "execute", "open_source", "prepare",
                              "read_shape_values", "validate_source"]
    opened, prepare, shapes, plan, checked, run = (phases[n] for n in (
        "open_source", "prepare", "read_shape_values", "build_work_plan", "validate_source",
        "execute"))
    assert opened["end"] <= prepare["start"]
    assert prepare["end"] <= plan["start"] <= shapes["start"] <= shapes["end"] <= plan["end"] \
        <= checked["start"] <= checked["end"] <= run["start"]
    items = [info for e, info in timed if e in ITEM_STEPS]
    assert all(run["start"] <= info["start"] <= info["end"] <= run["end"] for info in items)
    # A listener that did not ask for timings gets the run events only, the same ones.
    assert not set(plain) & set(events.TIMING_EVENTS)
    assert plain == [e for e, _ in timed if e not in events.TIMING_EVENTS]
    assert {"shard-done", "manifest-written", "run-finished"} <= set(plain)


def test_nothing_is_timed_without_a_timing_listener():
    """No clock read, no event built: `span` hands back one shared no-op."""
    got: list[str] = []
    unsubscribe = events.subscribe(lambda e, info: got.append(e))
    try:
        assert not events.timing
        with events.span("read", item=0) as span:
            span.add(kind="copy")
        assert span is events.NO_SPAN and got == []
        stop_timed = events.subscribe(lambda e, info: None, timings=True)
        assert events.timing and isinstance(events.span("read"), events.Span)
        stop_timed()
        assert not events.timing and events.span("read") is events.NO_SPAN
    finally:
        unsubscribe()
