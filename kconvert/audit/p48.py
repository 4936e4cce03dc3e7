"""The p48 family: where the run's record declares paired-4:8 sparsity, every 8-element chunk
of the declared roles' NVFP4 modules (4 bytes of packed NVFP4) has at most 2 nonzero pairs
and stores its pruned pairs as 0x00 (docs/p48.md), checked by kconvert.formats.p48."""

from __future__ import annotations

import torch

from kconvert.audit.context import AuditContext
from kconvert.checks.findings import Checks
from kconvert.formats.linear import ModuleWork
from kconvert.formats.p48 import check_packed
from kconvert.records.manifest import MANIFEST

P = "p48"


def declared_for(ctx: AuditContext, m: ModuleWork) -> bool:
    """Whether module `m` is one the record says was made p48 (an NVFP4 module of a declared
    role)."""
    roles = ctx.p48_roles
    return roles is not None and m.codec.global_scale_param is not None and \
        m.tn.role.value in roles


def check_module(m: ModuleWork, tensors: dict[str, torch.Tensor]) -> Checks:
    """The module's packed NVFP4 bytes (a sparse layout unpacked first) against the pattern."""
    checks = Checks()
    try:  # a layout that stores every nibble (2 per byte) is checked as it is stored
        packed = (tensors[m.codec.packed_param] if m.codec.elements_per_byte == 2
                  else m.codec.unpack(tensors)[0])
    except ValueError as exc:  # a sparse layout's mask chunk without exactly 2 bits
        checks.add(P, "pattern", str(exc), tensor=m.primary.name)
        return checks
    res = check_packed(packed)
    checks.ran(P, res.chunks)
    if not res.ok:
        row, chunk, raw = res.first
        what = ("3 or more nonzero pairs" if res.first_kind == "nonzero"
                else "a pruned pair stored as -0 instead of 0x00")
        checks.add(P, "pattern", f"{res.over_two} chunk(s) with more than 2 nonzero pairs, "
                   f"{res.neg_zero} with pruned pairs not 0x00; first: row {row}, chunk {chunk} "
                   f"(elements {8 * chunk}..{8 * chunk + 7}) has {what}: bytes "
                   f"{' '.join(f'{b:02x}' for b in raw)}", tensor=m.primary.name)
    return checks


def check_declared(ctx: AuditContext) -> None:
    """A declaration with nothing to check it against fails: the data cannot back it."""
    if ctx.p48_roles is not None and not ctx.report.counts[P]:
        ctx.report.add(P, "pattern", f"the manifest declares p48 for {sorted(ctx.p48_roles)} "
                       "but no NVFP4 module of those roles was found to check", file=MANIFEST)
