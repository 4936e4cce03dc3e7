"""Shared fixtures: tiny Kimi-shaped checkpoints made by kconvert.testing.fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kconvert.testing.fixture_weights import FixtureDims
from kconvert.testing.fixtures import make_fixture

# The suite runs on CPU tensors: Triton kernels (kconvert.methods.obs_kernel) run under
# Triton's interpreter, which must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Where the Triton tests put their tensors: the interpreter reads CPU memory, a compiled kernel
# (TRITON_INTERPRET=0 on a GPU machine) only CUDA memory.
TRITON_DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tests" / "fixtures" / "tiny-k2-thinking-int4"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny tensors: torch's thread pool costs far more than it gains (index_add_ on a 10x128
    tensor takes ~100 ms multi-threaded on a busy 2-core machine, ~16 us on one thread)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    """make(variant, **dims) -> path of a fixture checkpoint, cached per session."""
    cache: dict = {}

    def make(variant: str, seed: int = 0, **dims) -> Path:
        key = (variant, seed, tuple(sorted(dims.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(variant)
            cache[key] = make_fixture(out, variant, FixtureDims(**dims), seed=seed)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def converted(fixture_dir, tmp_path_factory):
    """converted(variant, recipe="int4-to-nvfp4", **options) -> (source, output) directories,
    cached per module (see oracles.make_converter)."""
    from oracles import make_converter

    return make_converter(fixture_dir, tmp_path_factory)
