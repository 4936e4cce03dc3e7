"""The manifest's `options`: a RunRecord, the recipe and what each of its stages recorded.

Each stage module declares its record (a kconvert.engine.stage.StageRecord) beside the stage;
RunRecord has one optional field per stage kind of the registry, named as the kind. The resume
fingerprint hashes it, and `kconvert audit` reads it (the p48 pattern and its targets, the kept
expert count, the plan's hash).
"""

from __future__ import annotations

from pydantic import ConfigDict, create_model

from kconvert.stages import KINDS

RunRecord = create_model(
    "RunRecord", __config__=ConfigDict(extra="forbid"),
    __doc__="The manifest's `options`: the recipe and what each of its stages recorded.",
    recipe=(str, ...), **{name: (kind.record_type | None, None) for name, kind in KINDS.items()})
