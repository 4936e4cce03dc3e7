"""The input-scale policies' declarations (kconvert.plugins.registry): how `quantize
--act-stats FILE --input-scale NAME` sets the per-tensor input scale of NVFP4 W4A4 routed
experts, and how an engine serving a checkpoint that declares the policy runs it
(docs/input-scales.md). Their behaviour is in kconvert.calibrate.input_scales, one class each
(headroom's in kconvert.calibrate.headroom).

Adding one: its class (a kconvert.calibrate.input_scales.InputScalePolicy) and one
`INPUT_SCALE_POLICIES.register` call below; the command line, recipes, the manifest, eval,
the audit and docs/methods.md take it from there.
"""

from __future__ import annotations

from kconvert.plugins.registry import Declaration, Registry

INPUT_SCALE_POLICIES = Registry("input-scale policy")

STAGE_KIND = "quantize"  # the stage kind that takes them
QUANTIZE = (STAGE_KIND,)
POLICIES = "kconvert.calibrate.input_scales"

EXPERT = INPUT_SCALE_POLICIES.register(Declaration(
    "expert", QUANTIZE, "each routed expert's own calibrated input amax (gate/up the larger; an "
    "expert never routed: its layer's largest); vLLM's CUTLASS MoE runs it",
    f"{POLICIES}:Expert", needs="stats"))
LAYER_MAX = INPUT_SCALE_POLICIES.register(Declaration(
    "layer-max", QUANTIZE, "the layer's largest calibrated input amax over its experts, gate/up "
    "and down apart: what FlashInfer backends run, ModelOpt 0.45's export",
    f"{POLICIES}:LayerMax", needs="stats", default=True))
ONE = INPUT_SCALE_POLICIES.register(Declaration(
    "one", QUANTIZE, "1.0 everywhere, without --act-stats: Kimi-K3 NVFP4, FlashInfer's unified "
    "MoE API", f"{POLICIES}:One"))
HEADROOM = INPUT_SCALE_POLICIES.register(Declaration(
    "headroom", QUANTIZE, "each expert's max(16384 x p1, p99.99) of its calibrated per-block "
    "input amax: ModelOpt's nvfp4_act_headroom, room above calibration for larger activations",
    "kconvert.calibrate.headroom:Headroom", needs="stats"))
