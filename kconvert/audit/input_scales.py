"""The routed experts' W4A4 input scales, as engines read them (docs/input-scales.md):
in an MoE layer where one expert stores an input scale, every expert does (a missing one loads
as 0 in vLLM, then inf, then NaN output: vLLM #45212); and they follow the policy the run
recorded or the config declares (kconvert.common.options.INPUT_SCALES): "one" every scale 1.0,
"layer-max" one value for the layer's gates and ups and one for its downs. A zero, NaN or Inf
scale is the scales family's (`scales.check_scale_values`)."""

from __future__ import annotations

from collections import defaultdict

from kconvert.audit.context import AuditContext
from kconvert.checks.quant_config import quant_blocks
from kconvert.formats.base import INPUT_SCALE_POLICY
from kconvert.model.names import Role

S = "scales"


def declared_policy(ctx: AuditContext) -> str | None:
    """The input-scale policy the run recorded, else the one the config declares."""
    quantize = ctx.record.quantize if ctx.record is not None else None
    if quantize is not None and quantize.input_scale is not None:
        return quantize.input_scale
    return next((q[INPUT_SCALE_POLICY] for _, q in quant_blocks(ctx.ckpt.ckpt.config)
                 if INPUT_SCALE_POLICY in q), None)


def check_input_scales(ctx: AuditContext) -> None:
    r = ctx.report
    policy = declared_policy(ctx)
    layers: dict[int, dict[str, tuple]] = defaultdict(dict)
    for m in ctx.ckpt.modules.values():
        stored = ctx.fused.get(m.tn.fused_set, {}).get(m.module)
        if m.tn.role is Role.ROUTED_EXPERT and stored is not None:
            layers[m.tn.layer][m.module] = (m, stored.input_scale)
    for layer, experts in sorted(layers.items()):
        have = {k: v for k, v in experts.items() if v[1] is not None}
        if not have:
            continue
        for _, (m, scale) in sorted(experts.items()):
            if scale is None:
                r.add(S, "input-scale", "the layer's other experts store an input scale "
                      "(W4A4) and this one none: an engine loads it as 0 (vLLM #45212: "
                      "inf, then NaN output for every token routed to it)",
                      layer=layer, tensor=m.primary.name)
        values = {module: float(scale.float().reshape(-1)[0])
                  for module, (_, scale) in have.items()}
        if policy == "one":
            for module, v in sorted(values.items()):
                m = experts[module][0]
                r.check(S, v == 1.0, "input-scale", f"input scale {v!r}, but the input-scale "
                        "policy is one (1.0)", layer=layer,
                        tensor=m.params[m.codec.input_scale_param].name)
        elif policy == "layer-max":
            groups: dict[str, set[float]] = defaultdict(set)
            for module, v in values.items():
                groups["down" if experts[module][0].tn.part == "down" else "gate/up"].add(v)
            for part, seen in sorted(groups.items()):
                r.check(S, len(seen) == 1, "input-scale", f"the experts' {part} input scales "
                        f"take {len(seen)} values ({min(seen)!r}..{max(seen)!r}), but the "
                        "input-scale policy is layer-max (one per layer)", layer=layer)
