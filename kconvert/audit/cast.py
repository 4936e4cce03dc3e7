"""The exact cast's check (with --source): where the run's record says MXFP4 was cast to NVFP4
exactly (quantize --cast exact), every block the cast holds exactly decodes to the source's
values bit for bit, and their count is the manifest's.

Which blocks those are follows from the source alone and the output's per-tensor scale
(docs/formats.md §7): 2^m with k_j - m in E4M3's [-9, 8], or a block of zero codes. The check
compares the fp32 decodes' bit patterns (a flipped code, a -0 written +0 and a changed block
scale are all caught), not the error, so one wrong nibble in a block that must be exact fails
however small its error."""

from __future__ import annotations

from collections import Counter

import torch

from kconvert.audit.context import AuditContext
from kconvert.checks.findings import Checks
from kconvert.formats import mxfp4
from kconvert.formats.linear import ModuleWork
from kconvert.formats.nvfp4_cast import CAST_CODECS, exact_blocks, stored_exponent
from kconvert.records.manifest import MANIFEST

SRC = "source"


def declared_for(ctx: AuditContext, m: ModuleWork, s: ModuleWork | None) -> bool:
    """Whether module `m` is an exact cast of source module `s`, per the run's record."""
    cast = CAST_CODECS.get(m.codec)
    return s is not None and _exact_cast_run(ctx) and cast is not None and cast.casts(s.codec)


def _exact_cast_run(ctx: AuditContext) -> bool:
    quantize = ctx.record.quantize if ctx.record is not None else None
    return quantize is not None and quantize.cast == "exact"


def check_module(ctx: AuditContext, m: ModuleWork, s: ModuleWork, out: dict[str, torch.Tensor],
                 src: dict[str, torch.Tensor], tally: Counter) -> Checks:
    """The blocks of `m` the cast holds exactly against source module `s`'s bytes."""
    checks = Checks()
    where = {"tensor": m.primary.name}
    scale = out[m.codec.global_scale_param]
    m_exp = stored_exponent(scale, m.codec.arithmetic)
    if not checks.check(SRC, m_exp is not None, "cast", f"per-tensor scale "
                        f"{float(scale.reshape(()))!r} is not a power of two: not an exact "
                        "cast", **where):
        tally.update(uncounted=1)  # already a failure: the totals cannot be recounted
        return checks
    packed, scales = (src[p] for p in s.codec.params)
    exact = exact_blocks(packed[None], scales[None], torch.tensor([m_exp]))[0]
    rows, cols = m.shape
    want = s.codec.decode({p: t.unsqueeze(0) for p, t in src.items()}, (rows, cols))[0]
    got = m.codec.decode({p: out[p].unsqueeze(0) for p in m.codec.params}, (rows, cols))[0]
    same = (want.view(torch.int32) == got.view(torch.int32)).view(*scales.shape,
                                                                  mxfp4.BLOCK).all(-1)
    bad = (exact & ~same).nonzero()
    # counted from the source's blocks before the bytes are judged: a wrong byte is reported
    # once, by the check below, not again as a total that no longer adds up
    n, total = int(exact.sum()), exact.numel()
    tally.update(exact=n, blocks=total)
    if not checks.check(SRC, len(bad) == 0, "cast", f"{len(bad)} of the {int(exact.sum())} "
                        "blocks the exact cast holds do not decode to the source's values bit "
                        f"for bit; first: row {int(bad[0, 0])}, elements "
                        f"{int(bad[0, 1]) * mxfp4.BLOCK}..{int(bad[0, 1]) * mxfp4.BLOCK + 31}"
                        if len(bad) else "", **where):
        return checks
    if ctx.manifest is not None:
        recorded = ctx.manifest.cast.get(m.module)
        said = ("no count" if recorded is None else
                f"{recorded.exact_blocks} of {recorded.blocks} blocks cast exactly")
        checks.check(SRC, recorded is not None
                     and (recorded.exact_blocks, recorded.blocks) == (n, total), "cast",
                     f"the manifest records {said}, the bytes hold {n} of {total}", **where)
    return checks


def note(ctx: AuditContext, tally: Counter) -> None:
    """The report's line on the exact cast, once every module is checked; where a manifest
    records the cast, its module counts and its summary's totals against the recount (a count
    for a module that is no exact cast makes the manifest's sum larger than the recount)."""
    if ctx.source is not None and ctx.manifest is not None and not tally["uncounted"] and (
            _exact_cast_run(ctx) or ctx.manifest.cast):
        entries = ctx.manifest.cast.values()
        summary = ctx.manifest.summary
        want = (tally["exact"], tally["blocks"])
        for what, got in (("module counts add up to", (sum(e.exact_blocks for e in entries),
                                                       sum(e.blocks for e in entries))),
                          ("summary says", (summary.get("cast_exact_blocks"),
                                            summary.get("cast_blocks")))):
            ctx.report.check(SRC, got == want, "cast", f"the manifest's {what} {got[0]} of "
                             f"{got[1]} blocks cast exactly, the bytes hold {want[0]} of "
                             f"{want[1]}", file=MANIFEST)
    if tally["blocks"]:
        ctx.report.notes.append(f"exact MXFP4 cast: {tally['exact']} of {tally['blocks']} "
                                "blocks decode to the source's values bit for bit; the rest "
                                "follow the block-scale rule")
