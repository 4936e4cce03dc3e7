"""Round to nearest: the codec's own encode of the decoded weights (its `--block-scale` rule)."""

from __future__ import annotations

from kconvert.methods.base import Method
from kconvert.plugins.methods import RTN


class Rtn(Method):
    declaration = RTN

    def record(self) -> dict[str, object]:
        return {}  # a round-to-nearest run records no method (its manifests predate methods)
