"""The methods that decide a matrix's values before its codec encodes them, one module each,
and their registry (kconvert.methods.base.Method): round to nearest, GPTQ and SparseGPT on the
OBS engine (docs/obs.md, its kernels and the Hessians it is given), and the paired-4:8 masks by
magnitude and Wanda (docs/p48.md).

Adding a method: its module here and its class in METHODS below; its name in the command
line's choices (kconvert.options, which imports no torch; a test keeps the lists equal).
"""

from __future__ import annotations

from kconvert.errors import KconvertError
from kconvert.methods.base import Method, MethodInputs
from kconvert.methods.gptq import Gptq
from kconvert.methods.learned import LearnedNvfp4, LearnedP48
from kconvert.methods.magnitude import Magnitude
from kconvert.methods.rtn import Rtn
from kconvert.methods.sparsegpt import SparseGpt
from kconvert.methods.wanda import Wanda

# (stage kind, name) -> method: a name means one method per stage kind (`learned` is p48's in
# sparsify and NVFP4's in quantize).
METHODS: dict[tuple[str, str], type[Method]] = {
    (m.stage, m.name): m for m in (Rtn, Gptq, LearnedNvfp4, Magnitude, Wanda, SparseGpt,
                                   LearnedP48)}


def methods_of(stage: str) -> dict[str, type[Method]]:
    """The methods a stage kind's --method may name, by name."""
    return {name: m for (kind, name), m in METHODS.items() if kind == stage}


def default_method(stage: str) -> type[Method]:
    return next(m for m in methods_of(stage).values() if m.default)


def method_named(stage: str, name: str | None) -> type[Method]:
    """The method `name` (None: the stage's default) of stage kind `stage`, or a clear error
    (naming the stage it belongs to where it is another's)."""
    if name is None:
        return default_method(stage)
    found = methods_of(stage).get(name)
    if found is not None:
        return found
    others = [kind for kind, other in METHODS if other == name]
    what = f"is a {others[0]} method" if others else "is not a method"
    raise KconvertError(f"--method {name} {what}; this run's {stage} stage takes --method "
                        f"{' or '.join(methods_of(stage))}")


__all__ = ["METHODS", "Method", "MethodInputs", "default_method", "method_named", "methods_of"]
