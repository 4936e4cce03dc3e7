"""The pruning plug-ins' declarations (kconvert.plugins.registry): how the prune stage ranks
experts (`--criterion`), how it repairs the kept experts' router (`--repair`) and how it
compensates what the dropped experts did (`--compensate`). Their behaviour is in
kconvert.pruning.kinds, one class each.

Adding one: its class there (or in a module of its own) whose `declaration` is its
Declaration, and one `register` call on its family's registry below.
"""

from __future__ import annotations

from kconvert.plugins.registry import Declaration, Registry

CRITERIA = Registry("criterion")
REPAIRS = Registry("repair kind")
COMPENSATIONS = Registry("compensation kind")

PRUNE = ("prune",)  # the stage kind that takes them
KINDS = "kconvert.pruning.kinds"

REAP = CRITERIA.register(Declaration(
    "reap", PRUNE, "mean over routed tokens of g_j(x) ||f_j(x)|| (REAP saliency)",
    f"{KINDS}:Reap", needs="stats", default=True))
FREQUENCY = CRITERIA.register(Declaration(
    "frequency", PRUNE, "routed-token count",
    f"{KINDS}:Frequency", needs="stats"))
EAN = CRITERIA.register(Declaration(
    "ean", PRUNE, "sum over routed tokens of ||f_j(x)||",
    f"{KINDS}:Ean", needs="stats"))
MAN = CRITERIA.register(Declaration(
    "man", PRUNE, "mean of ||f_j(x)|| (Mean Activation Norm)", f"{KINDS}:Man",
    needs="stats"))
MSAN = CRITERIA.register(Declaration(
    "msan", PRUNE, "mean of ||f_j(x)||^2 (Mean Squared Activation Norm)", f"{KINDS}:Msan",
    needs="stats"))

NO_REPAIR = REPAIRS.register(Declaration(
    "none", PRUNE, "the kept experts' router rows and bias as the source has them",
    f"{KINDS}:NoRepair", default=True))
BIAS = REPAIRS.register(Declaration(
    "bias", PRUNE, "e_score_correction_bias re-fitted",
    f"{KINDS}:BiasRepair", needs="data", gpu=True))
ROUTER = REPAIRS.register(Declaration(
    "router", PRUNE, "the kept gate rows and the bias re-fitted",
    f"{KINDS}:RouterRowsRepair", needs="data", gpu=True))

NO_COMPENSATION = COMPENSATIONS.register(Declaration(
    "none", PRUNE, "every kept matrix as the source has it", f"{KINDS}:NoCompensation",
    default=True))
SHARED = COMPENSATIONS.register(Declaration(
    "shared", PRUNE, "the shared expert's down_proj re-fitted by least squares",
    f"{KINDS}:SharedDown", needs="data", gpu=True))
DOWN = COMPENSATIONS.register(Declaration(
    "down", PRUNE, "the shared expert's and every kept expert's down_proj re-fitted by least "
    "squares", f"{KINDS}:EveryDown", needs="data", gpu=True))
LEARNED = COMPENSATIONS.register(Declaration(
    "learned", PRUNE, "down, then every kept expert's gate, up and down trained against the "
    "unpruned block, kept where the held-out error falls (docs/reap.md)",
    f"{KINDS}:TrainedExperts", needs="data", gpu=True))
