"""What every failed or interrupted run is checked for, shared by the engine's robustness
tests."""

from __future__ import annotations

from pathlib import Path

from helpers import MANIFEST


def assert_no_result(dst: Path) -> None:
    assert not (dst / MANIFEST).exists(), "a failed run left a manifest"
    assert not (dst / "config.json").exists(), "a failed run left config.json"

