"""The input-scale policies' behaviour (their declarations: kconvert.plugins.input_scales): the
input amax each W4A4 module is written with, from the activation statistics, and the
quantization scales g an engine serving the policy runs a layer's modules with
(kconvert.evaluate.activations). docs/input-scales.md compares them."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kconvert.calibrate.stats import ActStats
from kconvert.model.names import Role, parse_name
from kconvert.plugins.input_scales import (
    EXPERT,
    INPUT_SCALE_POLICIES,
    LAYER_MAX,
    ONE,
    STAGE_KIND,
)
from kconvert.plugins.registry import Declaration

if TYPE_CHECKING:
    import torch

# The input amax whose scale is 1.0 in both NVFP4 flavours (2688 / amax, amax / 2688).
ONE_AMAX = 2688.0


def expert_group(module: str) -> tuple | None:
    """(prefix, layer, "w13" | "down") of a routed expert's linear: the experts' linears that
    a layer-wide value covers (gates and ups together, downs apart); None for any other
    module."""
    tn = parse_name(f"{module}.weight")
    if tn.role is not Role.ROUTED_EXPERT:
        return None
    return tn.prefix, tn.layer, "down" if tn.part == "down" else "w13"


class InputScalePolicy:
    """Each module's own measured amax (`own_amax`); a routed expert without one (never
    routed in calibration: 0) takes its group's largest, as ModelOpt's export fills it (a
    zero scale gives inf, then NaN, in the engines: vLLM #45212)."""

    declaration: ClassVar[Declaration]
    # Every target's input amax whatever the statistics (None: from them).
    uniform_amax: ClassVar[float | None] = None
    # Whether every routed expert of a layer group stores one value (the audit checks it).
    one_per_layer: ClassVar[bool] = False

    def own_amax(self, act: ActStats) -> dict[str, float]:
        return dict(act.input_amax)

    def amax(self, act: ActStats) -> tuple[dict[str, float], list[str]]:
        """(input amax per module, the routed experts without a measured amax that took their
        group's largest)."""
        own = self.own_amax(act)
        largest = _largest(own)
        out, filled = dict(own), []
        for module, amax in own.items():
            key = expert_group(module)
            if key is not None and amax == 0.0 and largest[key] > 0.0:
                out[module], filled = largest[key], [*filled, module]
        return out, sorted(filled)

    def served(self, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The quantization scales g (module -> fp32 scalar) an engine serving the policy runs
        modules with, from the stored ones: each module's own."""
        return scales


def _largest(amax: dict[str, float]) -> dict[tuple, float]:
    """Each expert group's largest amax."""
    out: dict[tuple, float] = {}
    for module, value in amax.items():
        key = expert_group(module)
        if key is not None:
            out[key] = max(out.get(key, 0.0), value)
    return out


class Expert(InputScalePolicy):
    declaration = EXPERT


class LayerMax(InputScalePolicy):
    """Every routed expert's gate and up the largest amax over the layer's experts' gates and
    ups, its down the largest of their downs; other modules keep theirs. Served as vLLM's
    FlashInfer backends take it: the layer group's smallest g (largest amax)."""

    declaration = LAYER_MAX
    one_per_layer = True

    def amax(self, act: ActStats) -> tuple[dict[str, float], list[str]]:
        largest = _largest(act.input_amax)
        return {m: largest.get(expert_group(m), a)  # type: ignore[arg-type]
                for m, a in act.input_amax.items()}, []

    def served(self, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch

        groups: dict[tuple, list[str]] = {}
        for module in scales:
            key = expert_group(module)
            if key is not None:
                groups.setdefault(key, []).append(module)
        out = dict(scales)
        for members in groups.values():
            g = torch.stack([scales[m] for m in members]).min()
            out.update(dict.fromkeys(members, g))
        return out


class One(InputScalePolicy):
    """1.0 for every target without statistics; served with g = 1 for every module."""

    declaration = ONE
    uniform_amax = ONE_AMAX

    def amax(self, act: ActStats) -> tuple[dict[str, float], list[str]]:
        return {}, []

    def served(self, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch

        return {m: torch.ones((), dtype=torch.float32) for m in scales}


def input_scale_policy(name: str | None) -> InputScalePolicy:
    """The policy named `name` (None: the default) as an instance."""
    return INPUT_SCALE_POLICIES.named(STAGE_KIND, name, "input-scale").load()()


def served_policy(name: str | None) -> InputScalePolicy:
    """The policy a checkpoint's config declares, as an engine serves it: a name no
    declaration knows, or none, is each module's own scale."""
    found = INPUT_SCALE_POLICIES.get(STAGE_KIND, name) if name is not None else None
    return found.load()() if found is not None else InputScalePolicy()
