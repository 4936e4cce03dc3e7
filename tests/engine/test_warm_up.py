"""The GPU warm-up (engine.warm_up): the item it computes on zero-filled buffers is laid out as
the reader lays out the real item, goes through the same decode and encode and yields the same
output tensors (names, dtypes, shapes), so the kernels it loads are the ones the real item
needs; an item with a method is never warmed, and a CPU run starts no thread."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import BUNDLED
from kconvert.driver.recipes import build_stages, load_recipe
from kconvert.engine.compute import compute_item, read_item, zero_buffers
from kconvert.engine.items import TransformItem
from kconvert.engine.warm_up import first_to_warm, start_warm_up, warm_up
from kconvert.engine.work import build_work_plan
from kconvert.io.checkpoint import open_checkpoint

CHUNK = 1 << 22


@pytest.fixture(scope="module")
def plan():
    ckpt = open_checkpoint(str(BUNDLED))
    yield build_work_plan(ckpt, build_stages(load_recipe("int4-to-nvfp4"), {}, {}), 1 << 16)
    ckpt.close()


def test_zero_buffers_are_the_reader_layout_filled_with_zeros(plan):
    items = [it for it in plan.items if isinstance(it, TransformItem)]
    assert len(items) > 1
    for item in items:
        real, zero = read_item(plan.ckpt, item, pin=False), zero_buffers(item, pin=False)
        assert [(t.dtype, t.shape) for t in zero] == [(t.dtype, t.shape) for t in real]
        assert all(not t.view(torch.uint8).any() for t in zero)
        assert any(t.view(torch.uint8).any() for t in real)  # the fixture's are not zeros


def test_the_warm_item_yields_the_real_items_tensors(plan, monkeypatch):
    """warm_up computes the first item that encodes; its output tensors are the real item's."""
    from kconvert.engine import warm_up as module

    item = first_to_warm(plan.items)
    assert item is plan.items[next(i for i, it in enumerate(plan.items)
                                   if isinstance(it, TransformItem))]
    seen = []
    real_compute = module.compute_item
    monkeypatch.setattr(module, "compute_item",
                        lambda *a, **k: seen.append(real_compute(*a, **k)) or seen[-1])
    warm_up(plan, item, torch.device("cpu"), CHUNK)
    real = compute_item(plan, item, read_item(plan.ckpt, item, pin=False), torch.device("cpu"),
                        0, CHUNK)
    assert [(n, t.dtype, t.shape) for n, t, _ in seen[0].writes] == \
        [(n, t.dtype, t.shape) for n, t, _ in real.writes]
    assert len(real.writes) > 0


def test_an_item_with_a_method_is_not_warmed(plan):
    first = first_to_warm(plan.items)
    with_method = TransformItem([[dataclasses.replace(m, transform=object()) for m in fused]
                                 for fused in first.sets])
    assert first_to_warm([with_method, first]) is None
    assert first_to_warm([it for it in plan.items if not isinstance(it, TransformItem)]) is None


def test_a_cpu_run_starts_no_thread(plan):
    assert start_warm_up(plan, plan.items, torch.device("cpu"), CHUNK) is None
