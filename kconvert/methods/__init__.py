"""The methods that decide a matrix's values before its codec encodes them, one module each
(kconvert.methods.base.Method): round to nearest, GPTQ and SparseGPT on the OBS engine
(docs/obs.md, its kernels and the Hessians it is given), the paired-4:8 masks by magnitude
and Wanda (docs/p48.md), and the learned ones (docs/learned.md).

Each is declared once in a torch-free registry (kconvert.plugins.methods: its name, settings,
needs and records); its class is imported when a run takes it.
"""

from __future__ import annotations

from kconvert.methods.base import Method, MethodInputs
from kconvert.plugins.methods import METHODS


def methods_of(stage: str) -> dict[str, type[Method]]:
    """The methods a stage kind's --method may name, by name."""
    return {name: d.load() for name, d in METHODS.of(stage).items()}


def method_named(stage: str, name: str | None) -> type[Method]:
    """The method `name` (None: the stage's default) of stage kind `stage`, or a clear error
    (naming the stage it belongs to where it is another's)."""
    return METHODS.named(stage, name, "method").load()


__all__ = ["Method", "MethodInputs", "method_named", "methods_of"]
