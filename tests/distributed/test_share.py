"""How a run's work items are divided among ranks (engine.work.share_work), in process: with
an expert-parallel part (GPTQ and SparseGPT under torchrun) each routed expert's item goes to
the rank that holds the expert in the calibration (calibrate.expert_ranks), a MoE layer's
shard is then written by several ranks and finished by one; without it every item goes with
its shard, as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from kconvert.calibrate.expert_ranks import blocks
from kconvert.driver.recipes import build_stages, load_recipe
from kconvert.engine.work import CopyItem, build_work_plan, share_work
from kconvert.io.checkpoint import open_checkpoint
from kconvert.model.names import Role

BUNDLED = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-k2-thinking-int4"


@pytest.fixture(scope="module")
def ckpt():
    opened = open_checkpoint(str(BUNDLED))
    yield opened
    opened.close()


def expert_part(ranks: int, n_experts: int = 16):
    owned = blocks([1] * n_experts, ranks)

    def part(m):
        if m.tn.role is not Role.ROUTED_EXPERT:
            return None
        return next(r for r, b in enumerate(owned) if m.tn.expert in b)

    return part


@pytest.mark.parametrize("ranks", [2, 3])
def test_expert_items_go_to_their_rank_and_moe_shards_are_shared(ckpt, ranks):
    part = expert_part(ranks)
    stages = build_stages(load_recipe("int4-to-nvfp4"), {}, {})
    # small items: an item per few experts, so that the division shows
    plan = build_work_plan(ckpt, stages, 1 << 16, part=part)
    for item in plan.items:
        if not isinstance(item, CopyItem):
            assert len({part(m) for s in item.sets for m in s}) == 1  # no item mixes ranks
    shares = share_work(plan, set(), ranks, part)
    assigned = sorted(i for s in shares for i in s.items)
    assert assigned == list(range(len(plan.items)))  # every item exactly once
    for r, share in enumerate(shares):
        for i in share.items:
            item = plan.items[i]
            if not isinstance(item, CopyItem) and part(item.sets[0][0]) is not None:
                assert part(item.sets[0][0]) == r
    owners = [s for share in shares for s in share.owned]
    assert sorted(owners) == sorted(plan.shard_entries)  # every shard finished by one rank
    moe_shards = {m.primary.file.name for m in plan.modules if m.tn.role is Role.ROUTED_EXPERT}
    writers = shares[0].writers
    assert set(writers) == moe_shards
    for shard in moe_shards:
        assert writers[shard] == frozenset(range(ranks))
        assert all(shard in share.shared for share in shares)


def test_without_a_part_shards_are_whole(ckpt):
    stages = build_stages(load_recipe("int4-to-nvfp4"), {}, {})
    plan = build_work_plan(ckpt, stages, 1 << 16)
    shares = share_work(plan, set(), 2)
    assert all(not s.shared and not s.writers for s in shares)
    for share in shares:
        for i in share.items:
            assert plan.item_shards(plan.items[i]) <= share.owned
    done = {next(iter(shares[0].owned))}
    again = share_work(plan, done, 2)
    assert not any(done & s.owned for s in again)
    assert not any(plan.item_shards(plan.items[i]) & done for s in again for i in s.items)
