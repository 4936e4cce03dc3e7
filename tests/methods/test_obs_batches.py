"""An expert's OBS result (GPTQ, SparseGPT) does not depend on the experts solved beside it:
the budget, the card's free memory and the rank count decide which experts share a batch.

On a CPU the batch's size does not change an expert's bits. On a GPU it does (cuBLAS picks a
batched product's kernel by its batch count: docs/obs.md, "A batch's size changes its experts'
bits on a GPU"), so a GPU solves every batch at one count, OBS_BATCH, the last one padded with
repeats of its last member whose results are dropped. That the padding changes no real
member's result is checked here on the CPU, with the padding forced; that it makes a GPU's
bytes the same on 1 and 2 ranks was measured on two H200s (benchmarks/results/README.md,
"Session 24")."""

from __future__ import annotations

import pytest
import torch

from helpers import obs_problem
from kconvert.gpu.parts import OBS_BATCH
from kconvert.methods import obs, obs_memory, sparsegpt
from kconvert.methods.obs_method import PRECISION

MASKS = pytest.mark.parametrize("mask", [None, sparsegpt.p48_mask], ids=["gptq", "sparsegpt"])


def _solve(w: torch.Tensor, h: torch.Tensor, gs: torch.Tensor, experts: list[int], mask,
           budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """`experts` of the problem solved together, as the engine batches an item's, at the
    precision the methods run with."""
    members = [obs.Member(0, e, "gate_proj") for e in experts]
    return obs.quantize_batches(w[experts], gs[experts], members,
                                lambda mb: obs.HessianSplit(h[mb.expert], None), 16, "mse",
                                torch.float32, "compressed-tensors", mask=mask,
                                against_rtn=True, budget=budget, precision=PRECISION)


def _same_per_expert(whole, part, experts) -> None:
    (w_all, codes_all, choices_all), (w_part, codes_part, choices_part) = whole, part
    for i, e in enumerate(experts):
        assert torch.equal(w_all[e], w_part[i]), f"expert {e}'s values"
        assert torch.equal(codes_all[e], codes_part[i]), f"expert {e}'s codes"
        assert choices_all[e] == choices_part[i], f"expert {e}'s choice"


@MASKS
def test_an_experts_result_on_a_cpu_does_not_depend_on_its_batch(mask):
    """Four experts solved in one OBS batch and one at a time: the same bytes."""
    w, h, gs = obs_problem(4, 32, 512, 1500, seed=5, arithmetic="compressed-tensors")
    per_matrix = obs_memory.batch_bytes(32, 512, against_rtn=True)
    whole = _solve(w, h, gs, list(range(4)), mask, budget=per_matrix * 4)
    _same_per_expert(whole, _solve(w, h, gs, list(range(4)), mask, budget=per_matrix), range(4))


@MASKS
def test_padded_batches_drop_their_repeats(mask, monkeypatch):
    """OBS_BATCH + 3 experts with the GPU's padding forced (batches of OBS_BATCH and of 3
    padded to OBS_BATCH with repeats of the last): every expert's values, codes and GPTQ/RTN
    choice are those of the unpadded run, and the experts come back in their order."""
    n = OBS_BATCH + 3
    w, h, gs = obs_problem(n, 16, 64, 300, seed=7, arithmetic="compressed-tensors")
    plain = _solve(w, h, gs, list(range(n)), mask)
    solved = []
    factor = obs.prepare_inverse
    monkeypatch.setattr(obs, "prepare_inverse", lambda hs, **kw: solved.append(len(hs))
                        or factor(hs, **kw))
    monkeypatch.setattr(obs_memory, "pads_batches", lambda device: True)
    _same_per_expert(plain, _solve(w, h, gs, list(range(n)), mask), range(n))
    assert solved == [OBS_BATCH, OBS_BATCH]
