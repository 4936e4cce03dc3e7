"""What `kconvert audit` reports: every finding (kconvert.checks.findings), how many checks of
each group ran, the per-layer table, the expert mapping; as a table or as JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kconvert.checks.findings import Checks, Finding

GROUPS = ("structure", "quant-config", "scales", "manifest", "source", "p48")
MAX_STORED_PER_CHECK = 200  # findings kept per check (all are counted)
SHOWN_PER_CHECK = 10  # of those, listed by the table


@dataclass
class LayerRow:
    experts: str = "-"
    ids: str = "-"
    router: str = "-"
    scales: str = "-"
    max_rel_mse: float | None = None
    max_abs_err: float | None = None
    compared: int = 0


class Report(Checks):
    def __init__(self, ckpt: str, source: str | None, plan: str | None):
        super().__init__()
        self.ckpt, self.source, self.plan = ckpt, source, plan
        self.per_check: Counter = Counter()  # (group, check, severity) -> findings
        self.failed_in_layer: Counter = Counter()  # (group, layer) -> failures
        self.notes: list[str] = []
        self.layers: dict[int, LayerRow] = {}
        self.mapping: dict[str, dict] = {}
        # --serve: {engine: {"ready", "checks"}} and its table lines (kconvert.audit.serve).
        self.serve: dict[str, dict] | None = None
        self.serve_lines: list[str] = []

    @property
    def passed(self) -> bool:
        return not any(f.severity == "fail" for f in self.findings) and not any(
            self.failed.values())

    @property
    def serve_ready(self) -> bool:
        """Every engine --serve checked is READY (True where none was)."""
        return all(e["ready"] for e in (self.serve or {}).values())

    def row(self, layer: int) -> LayerRow:
        return self.layers.setdefault(layer, LayerRow())

    def keep(self, finding: Finding) -> None:
        key = (finding.group, finding.check, finding.severity)
        self.per_check[key] += 1
        if finding.severity == "fail":
            self.failed_in_layer[(finding.group, finding.layer)] += 1
        if self.per_check[key] <= MAX_STORED_PER_CHECK:
            self.findings.append(finding)

    def merge(self, checks: Checks) -> None:
        """Take in what checks run elsewhere (a reader thread, the decode worker) found."""
        self.counts.update(checks.counts)
        self.failed.update(checks.failed)
        for finding in checks.findings:
            self.keep(finding)

    def fill_scales_column(self) -> None:
        for layer, row in self.layers.items():
            bad = self.failed_in_layer[("scales", layer)]
            row.scales = f"{bad} bad" if bad else "ok"

    # -------------------------------------------------------------- output

    def to_json(self) -> dict:
        fails = [f for f in self.findings if f.severity == "fail"]
        warns = [f for f in self.findings if f.severity == "warn"]
        omitted = {f"{g}/{c}/{s}": n - MAX_STORED_PER_CHECK
                   for (g, c, s), n in self.per_check.items() if n > MAX_STORED_PER_CHECK}
        serve = {} if self.serve is None else {"serve": self.serve}
        return {
            "ckpt": self.ckpt, "source": self.source, "plan": self.plan,
            "passed": self.passed,
            "checks": {g: {"run": self.counts[g], "failed": self.failed[g]} for g in GROUPS},
            "failures": [_finding_json(f) for f in fails],
            "warnings": [_finding_json(f) for f in warns],
            "omitted": omitted,
            "notes": self.notes,
            "mapping": self.mapping,
            "layers": {str(k): vars(v) for k, v in sorted(self.layers.items())},
            **serve,
        }

    def render(self) -> str:
        out = [f"kconvert audit {self.ckpt}"
               + (f" --source {self.source}" if self.source else "")
               + (f" --plan {self.plan}" if self.plan else "")]
        head = (f"{'layer':>5}  {'experts':>8}  {'ids':<14} {'router/bias':<22} {'scales':<8} "
                f"{'max rel-MSE':>11}  {'max |err|':>9}  status")
        out += ["", head, "-" * len(head)]
        bad_layers = Counter()
        for (_, layer), n in self.failed_in_layer.items():
            bad_layers[layer] += n
        for layer, r in sorted(self.layers.items()):
            rel = f"{r.max_rel_mse:.2e}" if r.max_rel_mse is not None else "-"
            err = f"{r.max_abs_err:.2e}" if r.max_abs_err is not None else "-"
            status = f"FAIL ({bad_layers[layer]})" if bad_layers[layer] else "ok"
            out.append(f"{layer:>5}  {r.experts:>8}  {r.ids:<14} {r.router:<22} {r.scales:<8} "
                       f"{rel:>11}  {err:>9}  {status}")
        if bad_layers[None]:
            out.append(f"{'other':>5}  {'':>8}  {'':<14} {'':<22} {'':<8} {'':>11}  {'':>9}  "
                       f"FAIL ({bad_layers[None]})")
        out += ["", "checks:"]
        for g in GROUPS:
            if self.counts[g] or self.failed[g]:
                mark = "ok" if not self.failed[g] else f"{self.failed[g]} FAILED"
                out.append(f"  {g:<13} {self.counts[g]:>9} run   {mark}")
            else:
                out.append(f"  {g:<13} {'-':>9}       not applicable")
        if self.notes:
            out += ["", "notes:"] + [f"  - {n}" for n in self.notes]
        for severity, title in (("fail", "failures"), ("warn", "warnings")):
            items = [f for f in self.findings if f.severity == severity]
            if items:
                out += ["", f"{title}:", *self._listing(items, severity)]
        out += self.serve_lines
        n_fail = sum(n for (_, _, s), n in self.per_check.items() if s == "fail")
        out += ["", "PASS: every check passed" if self.passed else f"FAIL: {n_fail} failure(s)"]
        if not self.serve_ready:
            out.append("NOT READY to serve: " + ", ".join(
                e for e, v in (self.serve or {}).items() if not v["ready"]))
        return "\n".join(out)

    def _listing(self, items: list[Finding], severity: str) -> list[str]:
        out = []
        shown: Counter = Counter()
        for f in items:
            shown[(f.group, f.check)] += 1
            if shown[(f.group, f.check)] <= SHOWN_PER_CHECK:
                out.append("  " + f.line())
        for g, c in shown:
            total = self.per_check[(g, c, severity)]
            if total > SHOWN_PER_CHECK:
                out.append(f"  ... and {total - SHOWN_PER_CHECK} more [{g}/{c}] (see --json)")
        return out


def _finding_json(f: Finding) -> dict:
    return {k: v for k, v in vars(f).items() if v is not None}
