"""Decode comparisons: a module of CKPT that was re-encoded (or is in another format than its
source module) must decode to its source module's decode, within the error the run recorded
(or a default), or to BF16 rounding when it was decoded to a plain float format.

Both sides are decoded by their formats' own codecs on the audit's device, B same-shaped
modules at a time and in row blocks (so memory stays bounded whatever the module's size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kconvert.audit.context import AuditContext
from kconvert.checks.findings import Checks
from kconvert.formats.base import Codec
from kconvert.formats.linear import ModuleWork

SRC = "source"
# Without a manifest that records the error, a re-encoded module must decode within this
# relative MSE of the source decode. 4-bit formats give 0.005-0.02 on real weights; any mix-up
# of experts gives ~2 (two independent weights of equal norm).
DEFAULT_REL_MSE = 0.05
# A module decoded to BF16 must equal the source decode to BF16 rounding (2^-9 relative).
DENSE_REL_TOL = 2.0**-8
# The most a manifest's rel_mse_max can allow: a decode at relative MSE 1 is no closer to its
# source than zeros, which no compression writes (p48 with NVFP4 gives ~0.25 on the fixtures).
# A manifest recorded by a run that wrote rows into the wrong matrix (an expert's gate and up
# swapped: ~2) would otherwise allow its own mistake.
MANIFEST_REL_MSE_CAP = 1.0
# Decoded elements per row block: small on the CPU (its temporaries stay in cache-sized
# pieces), large on an accelerator (fewer, larger kernels).
BLOCK_ELEMS = {"cpu": 1 << 21}
DEVICE_BLOCK_ELEMS = 1 << 25


@dataclass(frozen=True)
class Bound:
    elementwise: bool  # every element within BF16 rounding, else a relative MSE
    rel_mse: float
    why: str


@dataclass
class DecodeJob:
    """One module of CKPT and its source module, with both sides' parameters as read."""

    module: ModuleWork
    source: ModuleWork
    out: dict[str, torch.Tensor]
    src: dict[str, torch.Tensor]
    bound: Bound

    @property
    def key(self) -> tuple:
        """Jobs with equal keys decode as one batch."""
        return (self.module.codec, self.source.codec, self.module.shape,
                tuple((p, t.dtype, t.shape) for p, t in sorted(self.out.items())),
                tuple((p, t.dtype, t.shape) for p, t in sorted(self.src.items())), self.bound)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.out.values(), *self.src.values()))


@dataclass
class Compared:
    rel_mse: float
    max_abs: float
    bad_elems: int  # elements off by more than BF16 rounding (elementwise bounds only)


def bound(ctx: AuditContext, m: ModuleWork) -> Bound:
    if ctx.max_rel_mse is not None:
        return Bound(False, ctx.max_rel_mse, "--max-rel-mse")
    if not m.codec.quantized:
        return Bound(True, DENSE_REL_TOL, "BF16 rounding")
    man = ctx.manifest
    if man is not None and m.primary.name in man.tensors:
        entry = man.layers.get(str(m.tn.layer))
        if entry is not None and entry.rel_mse_max < MANIFEST_REL_MSE_CAP:
            return Bound(False, entry.rel_mse_max * (1 + 1e-3) + 1e-9,
                         f"the manifest's rel_mse_max for layer {m.tn.layer}")
        if entry is not None:
            return Bound(False, MANIFEST_REL_MSE_CAP, f"the manifest's rel_mse_max for layer "
                         f"{m.tn.layer}, {entry.rel_mse_max:.3g}, is no bound: a decode that "
                         "far is no closer to its source than zeros")
    return Bound(False, DEFAULT_REL_MSE, "default bound for a re-encoded module")


def judge(job: DecodeJob, res: Compared) -> Checks:
    checks = Checks()
    m, s = job.module, job.source
    if job.bound.elementwise:
        checks.check(SRC, res.bad_elems == 0, "decode", f"{res.bad_elems} element(s) differ from "
                     f"the source decode of {s.module} by more than BF16 rounding (max abs err "
                     f"{res.max_abs:.3g})", tensor=m.primary.name)
    else:
        checks.check(SRC, res.rel_mse <= job.bound.rel_mse, "decode", f"decode differs from the "
                     f"source decode of {s.module}: relative MSE {res.rel_mse:.3g} > "
                     f"{job.bound.rel_mse:.3g} ({job.bound.why})", tensor=m.primary.name)
    return checks


def compare(jobs: list[DecodeJob], device: torch.device) -> list[Compared]:
    """Decode both sides of same-keyed jobs as one batch, in row blocks; per job the relative
    MSE against the source decode, the largest absolute error and (for an elementwise bound)
    the elements off by more than BF16 rounding."""
    first = jobs[0]
    rows, cols = first.module.shape
    step = BLOCK_ELEMS.get(device.type, DEVICE_BLOCK_ELEMS) // max(len(jobs) * cols, 1)
    step = max(128, step // 128 * 128)
    out_cuts = _row_cuts(first.module.codec, first.module.shape, step)
    src_cuts = _row_cuts(first.source.codec, first.source.shape, step)
    if step >= rows or out_cuts is None or src_cuts is None:
        # One block: the module is small, or blocks of `step` rows would split a scale's row.
        step, out_cuts, src_cuts = rows, {}, {}
    out = _batch(first.module.codec, [j.out for j in jobs], device)
    src = _batch(first.source.codec, [j.src for j in jobs], device)
    n = len(jobs)
    err = torch.zeros(n, dtype=torch.float64, device=device)
    ref = torch.zeros(n, dtype=torch.float64, device=device)
    max_abs = torch.zeros(n, dtype=torch.float32, device=device)
    bad = torch.zeros(n, dtype=torch.int64, device=device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        a = first.source.codec.decode(_rows(src, rows, src_cuts, r0, r1), (r1 - r0, cols))
        b = first.module.codec.decode(_rows(out, rows, out_cuts, r0, r1), (r1 - r0, cols))
        a, d = a.float(), b.float() - a.float()
        err += torch.linalg.vector_norm(d, dim=(1, 2), dtype=torch.float64).square()
        ref += torch.linalg.vector_norm(a, dim=(1, 2), dtype=torch.float64).square()
        max_abs = torch.maximum(max_abs, d.abs().amax(dim=(1, 2)))
        if first.bound.elementwise:
            bad += (d.abs() > DENSE_REL_TOL * a.abs()).sum(dim=(1, 2))
    results = []
    for e, rf, mx, nb in zip(err.tolist(), ref.tolist(), max_abs.tolist(), bad.tolist(),
                             strict=True):
        rel = e / rf if rf else (0.0 if e == 0 else math.inf)
        results.append(Compared(rel, mx, int(nb)))
    return results


def _batch(codec: type[Codec], tensors: list[dict[str, torch.Tensor]], device: torch.device
           ) -> dict[str, torch.Tensor]:
    """The parameters a decode needs, stacked on a leading batch dimension on `device`."""
    if len(tensors) == 1:
        return {p: tensors[0][p].unsqueeze(0).to(device) for p in codec.params}
    return {p: torch.stack([t[p].to(device) for t in tensors]) for p in codec.params}


def _row_cuts(codec: type[Codec], shape: tuple[int, ...], step: int) -> dict[str, int] | None:
    """Per parameter cut with the module's rows: how many module rows one of its rows covers
    (1 for per-row parameters, FP8-block's 128 for its scales), read off the format's own
    parameter rules. None when a block of `step` rows would end inside a parameter's row."""
    cols = shape[1]
    group = codec.default_group_size or 1
    at, past = codec.param_rules((step, cols), group), codec.param_rules((step + 1, cols), group)
    cuts = {}
    for p, (_, exact) in at.items():
        if exact is None or len(exact) < 2:
            continue  # a per-tensor scale, INT4's weight_shape, or no exact rule: see _rows
        if past[p][1][0] != exact[0] + 1 or step % exact[0]:
            return None
        cuts[p] = step // exact[0]
    return cuts


def _rows(t: dict[str, torch.Tensor], rows: int, cuts: dict[str, int], r0: int, r1: int
          ) -> dict[str, torch.Tensor]:
    """Rows r0..r1 of a batch of modules: each parameter cut as `cuts` says; one without a
    rule but with the module's rows (a plain weight) per row; anything else whole."""
    out = {}
    for p, v in t.items():
        per = cuts.get(p, 1 if v.dim() >= 3 and v.shape[1] == rows else None)
        out[p] = v if per is None else v[:, r0 // per: -(-r1 // per)]
    return out
