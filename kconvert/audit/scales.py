"""The scales family: no NaN/Inf in any floating tensor; scales of the right sign; the members
of a fused set (gate/up, q_a/kv_a) share one NVFP4 global scale and one input scale, since a
serving engine runs them as one GEMM with one scale.

The value tests work on the raw bits with numpy (kconvert.io.finite's bit table): they run in
the audit's reader threads, where torch's own thread pools would fight over the cores.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from kconvert.audit.bits import first_true, same_bits, short_float, where
from kconvert.audit.context import AuditContext
from kconvert.checks.findings import Checks
from kconvert.formats.base import is_linear
from kconvert.formats.linear import ModuleWork
from kconvert.io.finite import NONFINITE_BITS, find_nonfinite
from kconvert.io.shards import TensorInfo

S = "scales"
# A block (or group) scale is 0 for an all-zero block but never negative; every other scale a
# format has (per-tensor global and input scales, FP8-block's weight_scale_inv) divides or
# multiplies every value it covers and must be finite and > 0.
BLOCK_SCALE = "weight_scale"


def check_finite(checks: Checks, info: TensorInfo, raw: torch.Tensor, offset: int = 0) -> None:
    """No NaN/Inf in the uint8 bytes `raw` of `info`, from byte `offset` of the tensor."""
    if info.torch_dtype not in NONFINITE_BITS:
        return
    found = find_nonfinite(raw, info.torch_dtype)
    if found is None:
        checks.ran(S)
        return
    count, first = found
    element = offset // info.torch_dtype.itemsize + first
    checks.add(S, "finite", f"{count} NaN/Inf value(s), first at element {where(info, element)}",
               tensor=info.name)


def check_scale_values(checks: Checks, m: ModuleWork, tensors: dict[str, torch.Tensor]) -> None:
    """Every floating scale parameter of module `m` (the format's parameters after its
    weights) has the sign its kind needs."""
    for p, info in m.params.items():
        if p == m.codec.params[0] or info.torch_dtype not in NONFINITE_BITS:
            continue
        t = tensors[p].reshape(-1)
        problem = _negative(info, t) if p == BLOCK_SCALE else _not_positive(t)
        checks.check(S, problem is None, "scale-values", problem or "", tensor=info.name)


def _negative(info: TensorInfo, t: torch.Tensor) -> str | None:
    ones = NONFINITE_BITS[info.torch_dtype]
    bits = t.view(torch.uint8).numpy().view(ones.dtype)
    sign = ones.dtype.type(1 << (8 * ones.dtype.itemsize - 1))
    if not len(bits) or np.bitwise_and(bits, sign).max() == 0:
        return None
    if info.torch_dtype is torch.float8_e4m3fn:  # any sign bit, -0 and NaN codes included
        negative = np.bitwise_and(bits, sign) != 0
        what = "negative FP8 block scale(s), first at element"
    else:  # below zero: -0 and NaN are not
        magnitude = np.bitwise_and(bits, ~sign)
        negative = (np.bitwise_and(bits, sign) != 0) & (magnitude != 0) & (magnitude <= ones)
        what = "negative scale(s), first at"
    hits = np.flatnonzero(negative)
    if not len(hits):
        return None
    return f"{len(hits)} {what} {where(info, int(hits[0]))}"


def _not_positive(t: torch.Tensor) -> str | None:
    v = t.float()
    bad = ~(v > 0) | ~torch.isfinite(v)
    if not bool(bad.any()):
        return None
    return f"scale must be finite and > 0, found {float(t[first_true(bad)])!r}"


def check_fused_sets(ctx: AuditContext) -> None:
    """Members of a fused set are in one format and, in NVFP4, share their stored scales."""
    r = ctx.report
    sets: dict[str, list[ModuleWork]] = defaultdict(list)
    for m in ctx.ckpt.modules.values():
        if is_linear(m):
            sets[m.tn.fused_set].append(m)
    for fused_name, members in sorted(sets.items()):
        if len(members) < 2:
            continue
        members.sort(key=lambda m: m.module)
        codecs = {m.codec for m in members}
        if not r.check(S, len(codecs) == 1, "fused-scale",
                       f"members of fused set {fused_name} are in different formats: "
                       + ", ".join(f"{m.module.rsplit('.', 1)[-1]} {m.codec.name}"
                                   for m in members), tensor=fused_name):
            continue
        stored = ctx.fused.get(fused_name, {})
        if members[0].codec.global_scale_param is None or any(m.module not in stored
                                                               for m in members):
            continue  # no shared scale; or a member failed to read, reported where it did
        first = stored[members[0].module]
        short0 = members[0].module.rsplit(".", 1)[-1]
        for m in members[1:]:
            got = stored[m.module]
            r.check(S, same_bits(got.global_scale, first.global_scale), "fused-scale",
                    f"global scale {short_float(got.global_scale)} but {short0} has "
                    f"{short_float(first.global_scale)}: fused set {fused_name} must share one",
                    tensor=m.primary.name)
            if not same_bits(got.input_scale, first.input_scale):
                r.add(S, "fused-scale", f"input scale differs from {short0}'s: fused set "
                      f"{fused_name} must share one", tensor=m.primary.name)
