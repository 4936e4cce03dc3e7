"""Shared fixtures: tiny Kimi-shaped checkpoints made by scripts/make_fixture.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from make_fixture import FixtureDims, make_fixture  # noqa: E402

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
