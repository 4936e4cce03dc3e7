"""The routed experts' W4A4 input scales, as engines read them (docs/input-scales.md):
in an MoE layer where one expert stores an input scale, every expert does (a missing one loads
as 0 in vLLM, then inf, then NaN output: vLLM #45212); and they follow the policy the run
recorded or the config declares (kconvert.plugins.input_scales): a policy with one value for
every target ("one": 1.0) stores it everywhere, one with a value per layer ("layer-max") one
for the layer's gates and ups and one for its downs, and where the run's activation
statistics file is still at the path it recorded, every expert's stored scale is the one its
policy computes from them ("headroom": ModelOpt's rule, kconvert.calibrate.headroom), recomputed
here. A zero, NaN or Inf scale is the scales family's (`scales.check_scale_values`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from kconvert.audit.context import AuditContext
from kconvert.calibrate.input_scales import InputScalePolicy, served_policy
from kconvert.calibrate.stats import read_act_stats
from kconvert.checks.quant_config import quant_blocks
from kconvert.errors import KconvertError
from kconvert.formats.base import INPUT_SCALE_POLICY
from kconvert.model.names import Role, parse_name

S = "scales"


def declared_policy(ctx: AuditContext) -> str | None:
    """The input-scale policy the run recorded, else the one the config declares."""
    quantize = ctx.record.quantize if ctx.record is not None else None
    if quantize is not None and quantize.input_scale is not None:
        return quantize.input_scale
    return next((q[INPUT_SCALE_POLICY] for _, q in quant_blocks(ctx.ckpt.ckpt.config)
                 if INPUT_SCALE_POLICY in q), None)


def _value(t: torch.Tensor) -> float:
    return float(t.float().reshape(-1)[0])


def check_input_scales(ctx: AuditContext) -> None:
    r = ctx.report
    name = declared_policy(ctx)
    policy = served_policy(name)
    recomputed = _recomputed(ctx, policy)
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
        values = {module: _value(scale) for module, (_, scale) in have.items()}
        for module, v in sorted(values.items()):
            m = experts[module][0]
            tensor = m.params[m.codec.input_scale_param].name
            if policy.uniform_amax is not None:
                want = _value(m.codec.input_scale(policy.uniform_amax)[m.codec.input_scale_param])
                r.check(S, v == want, "input-scale", f"input scale {v!r}, but the input-scale "
                        f"policy is {name} ({want!r})", layer=layer, tensor=tensor)
            elif module in recomputed:
                want = _value(m.codec.input_scale(recomputed[module])[m.codec.input_scale_param])
                r.check(S, v == want, "input-scale", f"input scale {v!r}, but the {name} "
                        f"policy gives {want!r} (input amax {recomputed[module]!r}) from the "
                        "run's activation statistics", layer=layer, tensor=tensor)
        if policy.one_per_layer:
            groups: dict[str, set[float]] = defaultdict(set)
            for module, v in values.items():
                groups["down" if experts[module][0].tn.part == "down" else "gate/up"].add(v)
            for part, seen in sorted(groups.items()):
                r.check(S, len(seen) == 1, "input-scale", f"the experts' {part} input scales "
                        f"take {len(seen)} values ({min(seen)!r}..{max(seen)!r}), but the "
                        f"input-scale policy is {name} (one per layer)", layer=layer)


def _recomputed(ctx: AuditContext, policy: InputScalePolicy) -> dict[str, float]:
    """The input amax of every routed expert of CKPT under `policy`, from the activation
    statistics the run recorded (a fused set's members sharing the largest, as the engine's
    one quantized input), when that file is still there and the experts kept their source
    numbers (no prune stage); empty otherwise, with a note saying why."""
    quantize = ctx.record.quantize if ctx.record is not None else None
    path = quantize.act_stats if quantize is not None else None
    if path is None or policy.uniform_amax is not None:
        return {}
    if ctx.record.prune is not None:
        return {}
    if not Path(path).is_file():
        ctx.report.notes.append(f"input scales not recomputed: the run's activation "
                                f"statistics {path} are not there")
        return {}
    try:
        amax, _ = policy.amax(read_act_stats(path))
    except KconvertError as exc:
        ctx.report.add(S, "input-scale", f"the run's activation statistics: {exc}", file=path)
        return {}
    shared: dict[str, float] = defaultdict(float)
    for module, value in amax.items():
        fused = parse_name(f"{module}.weight").fused_set
        shared[fused] = max(shared[fused], value)
    return {m.module: shared[m.tn.fused_set] for m in ctx.ckpt.modules.values()
            if m.tn.role is Role.ROUTED_EXPERT and m.module in amax}

