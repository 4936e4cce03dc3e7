"""Pruning quality on a real (trained) tiny MoE: REAP beats random and frequency plans.

The fixture is a DeepSeek-V3-architecture model trained by scripts/train_tiny_moe.py on the
standard library's source (24 experts per layer, top-4, sigmoid+bias routing, no dead expert).
Calibration is on training text, the loss on held-out files. Everything is computed here:
the plans from our own calibration pass, the losses by transformers (train_tiny_moe's loader).
"""

from __future__ import annotations

import random
import statistics

import torch

from conftest import ROOT
from kconvert.calibrate.run import measure_stats as calibrate
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.io.checkpoint import open_checkpoint
from kconvert.pruning.plan import parse_plan
from kconvert.pruning.reap import plan_from_scores, scores_of
from kconvert.stages.prune import prune_stage
from kconvert.testing.tiny_moe import corpus_ids, heldout_ids, heldout_loss, windows

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
KEEP = 12  # of 24: 50%


def _pruned_loss(plan, tmp_path, name, held) -> float:
    dst = tmp_path / name
    convert(str(SRC), str(dst), load_recipe("reap"), {}, RunControl(quiet=True),
            prepare=lambda ckpt: {"prune": prune_stage(plan, ckpt)})
    return heldout_loss(dst, held)


def test_reap_keeps_more_quality_than_random_and_frequency(tmp_path):
    calib = windows(corpus_ids("train"), 64, 256, torch.Generator().manual_seed(1))
    ckpt = open_checkpoint(str(SRC))
    try:
        scores = scores_of(calibrate(ckpt, calib, "cpu", 16, dtype=torch.float32))
    finally:
        ckpt.close()
    held = heldout_ids(16384, seed=0)
    base = heldout_loss(SRC, held)
    increase = {
        crit: _pruned_loss(plan_from_scores(scores, KEEP, crit), tmp_path, crit, held) - base
        for crit in ("reap", "frequency")
    }
    random_increase = []
    for seed in range(3):
        rng = random.Random(seed)
        layers = {str(layer): {"keep": sorted(rng.sample(range(24), KEEP))} for layer in scores}
        plan = parse_plan({"criterion": "random", "layers": layers})
        random_increase.append(_pruned_loss(plan, tmp_path, f"random{seed}", held) - base)
    print(f"held-out loss {base:.4f}; increase at keep {KEEP}/24: {increase}, "
          f"random {random_increase}")
    assert increase["reap"] > 0  # pruning half the experts must cost something
    assert increase["reap"] < statistics.mean(random_increase)
    assert increase["reap"] <= increase["frequency"]
