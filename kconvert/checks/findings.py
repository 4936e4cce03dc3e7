"""What a check reports (`Finding`) and where checks collect their findings (`Checks`): shared
by `kconvert audit` (kconvert.audit) and the checks a conversion runs on its source
(kconvert.checks.structure, kconvert.checks.quant_config)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kconvert.model.names import parse_name


@dataclass
class Finding:
    group: str
    check: str
    message: str
    layer: int | None = None
    tensor: str | None = None
    file: str | None = None
    severity: str = "fail"

    def where(self) -> str:
        parts = []
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.tensor:
            parts.append(self.tensor)
        if self.file and not self.tensor:
            parts.append(self.file)
        return ", ".join(parts) or "checkpoint"

    def line(self) -> str:
        tag = "FAIL" if self.severity == "fail" else "warn"
        return f"{tag} [{self.group}/{self.check}] {self.where()}: {self.message}"


class Checks:
    """Where checks report: how many ran per group, and what failed or warns."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.counts: Counter = Counter()  # group -> checks run
        self.failed: Counter = Counter()  # group -> checks failed

    def ran(self, group: str, n: int = 1) -> None:
        self.counts[group] += n

    def add(self, group: str, check: str, message: str, *, layer: int | None = None,
            tensor: str | None = None, file: str | None = None, severity: str = "fail") -> None:
        if layer is None and tensor is not None:
            layer = parse_name(tensor).layer
        if severity == "fail":
            self.failed[group] += 1
        self.keep(Finding(group, check, message, layer, tensor, file, severity))

    def keep(self, finding: Finding) -> None:
        self.findings.append(finding)

    def check(self, group: str, ok: bool, check: str, message: str | Callable[[], str],
              **where) -> bool:
        """Count the check in `group` and keep a failure where not `ok`. A check run once per
        tensor of a full-size checkpoint passes its message as a callable, made only on
        failure (docs/performance.md, planning a full-size Kimi)."""
        self.ran(group)
        if not ok:
            self.add(group, check, message if isinstance(message, str) else message(), **where)
        return ok

    def warn(self, group: str, check: str, message: str, **where) -> None:
        self.add(group, check, message, severity="warn", **where)


def text_config(config: dict) -> dict:
    """The language model's config: `text_config` of a K2.5/K2.6 wrapper, else the top level."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def short(v: object, n: int = 80) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
