"""What stays in one process under torchrun, refused in one line before anything runs (the
world size patched: the methods decide when they are built, on every rank alike): GPTQ of the
linears whose Hessians come from every token; GPTQ, SparseGPT and the learned methods of the
routed experts run (tests/distributed/test_ranks.py, test_learned_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.io.checkpoint import open_checkpoint
from kconvert.methods import MethodInputs, method_named
from kconvert.methods.hessians import Calibration, CalibrationHessians
from kconvert.model.names import Role

BUNDLED = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-k2-thinking-int4"
EXPERTS = frozenset({Role.ROUTED_EXPERT})


@pytest.fixture
def calibration():
    ckpt = open_checkpoint(str(BUNDLED))
    yield Calibration(CalibrationHessians(ckpt, torch.zeros(2, 16, dtype=torch.long),
                                          torch.device("cpu"), 8))
    ckpt.close()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("stage", "name", "targets", "refused"), [
    ("quantize", "gptq", EXPERTS, None),
    ("sparsify", "sparsegpt", EXPERTS, None),
    ("quantize", "learned", EXPERTS, None),
    ("sparsify", "learned", EXPERTS, None),
    ("quantize", "gptq", EXPERTS | {Role.ATTENTION}, "gptq of attention runs in one process"),
    ("quantize", "gptq", EXPERTS | {Role.SHARED_EXPERT}, "gptq of shared_expert runs in one"),
])
def test_methods_across_ranks(monkeypatch, calibration, world, stage, name, targets, refused):
    monkeypatch.setattr(distributed, "world", lambda: world)
    method = method_named(stage, name)
    if refused is None or world == 1:
        method(MethodInputs(targets, calibration))
        return
    with pytest.raises(KconvertError, match=refused):
        method(MethodInputs(targets, calibration))
