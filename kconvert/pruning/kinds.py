"""The pruning plug-ins' behaviour, one class each (their declarations:
kconvert.plugins.pruning): a criterion names the calibration statistic it keeps the highest
of, a repair kind what of the router it re-fits, a compensation kind which matrices it re-fits
and whether it trains them. The prune stage and the repair stream ask these classes, never a
kind's name."""

from __future__ import annotations

from typing import ClassVar

from kconvert.plugins import pruning
from kconvert.plugins.registry import Declaration


class Criterion:
    """How a prune stage ranks each layer's experts: by `statistic`, a per-expert calibration
    statistic (kconvert.calibrate.stats; reap.md, "Criteria"), the highest kept."""

    declaration: ClassVar[Declaration]
    statistic: ClassVar[str]


class Reap(Criterion):
    declaration, statistic = pruning.REAP, "saliency"


class Frequency(Criterion):
    declaration, statistic = pruning.FREQUENCY, "count"


class Ean(Criterion):
    declaration, statistic = pruning.EAN, "ean_sum"


class Man(Criterion):
    declaration, statistic = pruning.MAN, "man"


class Msan(Criterion):
    declaration, statistic = pruning.MSAN, "msan"


class RepairKind:
    """What router repair re-fits (reap.md, "Router repair"): nothing (`fits` False), the
    bias, or the bias and the kept gate rows (`tunes_gate`)."""

    declaration: ClassVar[Declaration]
    fits: ClassVar[bool] = True
    tunes_gate: ClassVar[bool] = False


class NoRepair(RepairKind):
    declaration, fits = pruning.NO_REPAIR, False


class BiasRepair(RepairKind):
    declaration = pruning.BIAS


class RouterRowsRepair(RepairKind):
    declaration, tunes_gate = pruning.ROUTER, True


class CompensationKind:
    """What compensation re-fits (docs/reap.md, "Compensation" and "Learned compensation"):
    nothing (`refits` False), or the shared expert's down_proj, every kept expert's down_proj
    too (`kept_downs`), and then, `trains`, the kept experts' gate, up and down trained
    together. `ridges`: the ridges it tries (None: the repair settings')."""

    declaration: ClassVar[Declaration]
    refits: ClassVar[bool] = True
    kept_downs: ClassVar[bool] = False
    trains: ClassVar[bool] = False
    ridges: ClassVar[tuple[float, ...] | None] = None

    @classmethod
    def projs(cls) -> tuple[str, ...]:
        """The source linears whose re-fitted matrices it may write."""
        if not cls.refits:
            return ()
        return ("down_proj", "gate_proj", "up_proj") if cls.trains else ("down_proj",)

    @classmethod
    def rewrites(cls, proj: str | None, shared: bool) -> bool:
        """Whether it may write the linear `proj` of the shared expert (`shared`) or of a kept
        routed expert."""
        if proj not in cls.projs():
            return False
        if proj != "down_proj":
            return not shared
        return shared or cls.kept_downs


class NoCompensation(CompensationKind):
    declaration, refits = pruning.NO_COMPENSATION, False


class SharedDown(CompensationKind):
    declaration = pruning.SHARED


class EveryDown(CompensationKind):
    declaration, kept_downs = pruning.DOWN, True


class TrainedExperts(CompensationKind):
    declaration, kept_downs, trains = pruning.LEARNED, True, True
