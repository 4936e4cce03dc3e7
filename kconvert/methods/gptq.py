"""GPTQ on NVFP4's grid by the OBS engine (docs/obs.md), kept per matrix only where its output
error on held-out calibration tokens is below round-to-nearest's (obs.HELDOUT_EVERY); the
choices go to the manifest (`obs`)."""

from __future__ import annotations

from dataclasses import asdict

from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.formats import nvfp4
from kconvert.formats.linear import Transformed
from kconvert.methods import obs
from kconvert.methods.obs_method import PRECISION, ObsMethod
from kconvert.model.names import Role
from kconvert.plugins.methods import GPTQ

# The roles GPTQ has Hessians for, all from the layer-streamed calibration: the experts' from
# the MoE block's captured inputs, attention's and the dense MLP's from the input Grams the
# forward collects (obs.EXPERT_ROLES and the rest). A targeted router is not among them; the
# manifest records them as `gptq_targets`.
ROLES = (Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.DENSE_MLP, Role.ATTENTION)


class Gptq(ObsMethod):
    declaration = GPTQ
    against_rtn = True
    across_ranks = True

    def __init__(self, inputs) -> None:
        super().__init__(inputs)
        self.roles = [r for r in ROLES if r in inputs.targets]
        whole = [r.value for r in self.roles if r is not Role.ROUTED_EXPERT]
        if whole and distributed.world() > 1:
            # their Hessians are every token's, which expert-parallel ranks do not gather
            raise KconvertError(f"gptq of {', '.join(whole)} runs in one process (their "
                                "Hessians come from every calibration token); run it without "
                                "torchrun, or quantize only the routed experts by GPTQ")
        self.shared_experts = Role.SHARED_EXPERT in self.roles
        self.calibration.hessians.gram_roles = frozenset(
            r for r in self.roles if r not in obs.EXPERT_ROLES)

    def transforms(self, m) -> bool:
        return m.tn.role in self.roles

    def record(self) -> dict[str, object]:
        return {**super().record(), "gptq_targets": sorted(r.value for r in self.roles),
                **self.sequential_record()}

    def transform_batch(self, batch) -> Transformed:
        modules, w, codec, spec, amax = batch
        hessians = self.calibration.hessians

        def split(mb: obs.Member) -> obs.HessianSplit:
            if mb.inputs is not None:
                return hessians.linear_hessians(mb.layer, mb.inputs)
            return hessians.split_hessians(mb.layer, mb.expert, mb.proj)

        out, codes, choices = obs.quantize_batches(
            w, nvfp4.tensor_scale(amax, codec.arithmetic), obs.members_of([m.tn for m in modules]),
            split, spec.group(codec), spec.rule, spec.local_dtype, codec.arithmetic,
            against_rtn=True, budget=hessians.obs_budget(w.device), precision=PRECISION)
        return Transformed(out, codes, [asdict(c) for c in choices])
