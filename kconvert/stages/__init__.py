"""The stages a recipe is made of, one module each, and the registry of their kinds.

A stage module declares its kind once (`KIND`, a kconvert.stages.base.StageKind): the name a
recipe's `stage = "..."` gives, the settings a recipe or the command line may give it, the
command-line options from which its `prepare` makes its input out of the opened source, and the
factory that builds the stage from those. A new stage is its module plus one line here; the
engine sees only its hooks (kconvert.engine.stage.Stage).
"""

from __future__ import annotations

from kconvert.stages import densify, dequant, prune, quantize, sparsify
from kconvert.stages.base import StageKind

# In the order a recipe usually runs them; the manifest's options list them in this order.
KINDS: dict[str, StageKind] = {m.KIND.name: m.KIND for m in
                               (dequant, quantize, prune, sparsify, densify)}
