"""`--input-scale layer-max` on Kimi-K3's expert names (w1 gate, w3 up, w2 down): one input
scale per MoE layer for the gates and ups together (w1 with w3) and one for the downs (w2),
as the conversion writes them (the policy's amax) and as eval serves them (the policy's
served); a DeepSeek-named layer beside them is grouped by its own names."""

from __future__ import annotations

import torch

from kconvert.calibrate.input_scales import input_scale_policy
from kconvert.calibrate.stats import ActStats

K3_MOE = "language_model.model.layers.{layer}.block_sparse_moe"
DEEPSEEK_MOE = "model.layers.{layer}.mlp"
# per (layer, expert) the input amax of w1 (gate), w3 (up), w2 (down)
AMAX = {(1, 0): (1.0, 5.0, 100.0), (1, 1): (2.0, 3.0, 50.0), (2, 0): (7.0, 1.0, 20.0),
        (2, 1): (4.0, 6.0, 30.0)}


def policy_amax(calibrated: dict[str, float], policy: str
                ) -> tuple[dict[str, float], list[str]]:
    return input_scale_policy(policy).amax(ActStats(calibrated, {}, {}))


def _modules(block: str, names: tuple[str, str, str]) -> dict[str, float]:
    return {f"{block.format(layer=layer)}.experts.{e}.{n}": a
            for (layer, e), amaxes in AMAX.items() for n, a in zip(names, amaxes, strict=True)}


def _expected(block: str, names: tuple[str, str, str]) -> dict[str, float]:
    """Each module its layer's largest of its group, computed here from AMAX."""
    out = {}
    for (layer, e), _ in AMAX.items():
        same = [a for (lay, _), a in AMAX.items() if lay == layer]
        w13, w2 = max(max(a[:2]) for a in same), max(a[2] for a in same)
        for n, v in zip(names, (w13, w13, w2), strict=True):
            out[f"{block.format(layer=layer)}.experts.{e}.{n}"] = v
    return out


K3 = ("w1", "w3", "w2")
DEEPSEEK = ("gate_proj", "up_proj", "down_proj")


def test_layer_max_groups_k3s_w1_w3_apart_from_w2():
    shared = {"language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj": 9.0}
    calibrated = {**_modules(K3_MOE, K3), **shared}
    amax, filled = policy_amax(calibrated, "layer-max")
    assert amax == {**_expected(K3_MOE, K3), **shared} and filled == []


def test_layer_max_groups_each_familys_names_by_their_parts():
    calibrated = {**_modules(K3_MOE, K3), **_modules(DEEPSEEK_MOE, DEEPSEEK)}
    amax, _ = policy_amax(calibrated, "layer-max")
    assert amax == {**_expected(K3_MOE, K3), **_expected(DEEPSEEK_MOE, DEEPSEEK)}


def test_eval_serves_k3s_layer_max_as_written():
    """served takes the smallest g = 2688 / amax of each group: the largest amax's."""
    g = {m: torch.tensor(2688.0 / a) for m, a in _modules(K3_MOE, K3).items()}
    got = input_scale_policy("layer-max").served(g)
    for m, a in _expected(K3_MOE, K3).items():
        assert float(got[m]) == float(torch.tensor(2688.0 / a)), m
