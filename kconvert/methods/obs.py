"""The OBS engine: blocked error-compensated NVFP4 quantization (GPTQ), optionally with a mask
chosen per scale block (SparseGPT's p48, kconvert.methods.sparsegpt). docs/obs.md.

For a batch of matrices W [B, M, K] that share an input Hessian H = X^T X per batch entry
(an expert's gate and up rows see the same tokens), columns are visited left to right. At the
start of every NVFP4 scale block (16 or 32 columns) the block's mask is chosen, if any, on the
error-updated weights, then the block's FP8 scale by the `--block-scale` rule on those same
weights (after the mask: the rule the encoder uses), then each column is quantized with that
scale (masked entries +0) and its error is propagated to the columns not yet visited.

The propagation is blocked three ways (GPTQ's lazy batch updates, one level deeper), so that
almost all of the arithmetic is large batched matrix products and the per-column work touches
only one scale block's columns:
  inside a scale block   rank-1 updates of the block's own later columns (G columns): the
                         column loop, in one fused Triton kernel with the block's mask and
                         scale choice on a GPU (obs_kernel), torch on a CPU and as the
                         kernel's oracle
  end of a scale block   one batched product for the rest of its BLOCKSIZE-column lazy block
  end of a lazy block    one batched product for every later column
Every entry gets the same updates as in the plain per-column loop (each column's error times
its row of U), only summed in another order, so results agree up to fp32 rounding (tested
against the per-column loop kept in tests/oracles.py).

The result is W-hat already on the NVFP4 grid plus the block-scale codes to encode it with,
so the encoder writes exactly the values this loop optimised.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kconvert.formats import nvfp4
from kconvert.methods import obs_memory, triangular
from kconvert.model.names import Role, TensorName

BLOCKSIZE = 128  # columns per lazy-update block (else one NVFP4 block, for small K)

# GPTQ is judged against RTN on tokens its fit did not see: every HELDOUT_EVERY-th token routed
# to a matrix is held out of its Hessian, where that leaves at least HELDOUT_MIN of them (else
# both are judged on the calibration tokens, and the manifest says so). On the calibration
# tokens alone GPTQ always looks better; held out, an expert with fewer routed tokens than
# inputs can be worse (docs/obs.md).
HELDOUT_EVERY = 8
HELDOUT_MIN = 128
PERCDAMP = 0.1  # damping, as a fraction of the mean Hessian diagonal (p48.md)


# Matrix products of the error propagation: fp32 (the default), TF32 tensor cores (CUDA only;
# on a CPU the same as fp32) or bf16 operands with fp32 accumulation.
PRECISIONS = ("fp32", "tf32", "bf16")


# Decoded elements per OBS transform item on a CPU (batches are OBS_BATCH matrices, so items
# are large; on a GPU the command's memory plan sizes items, kconvert.gpu.plan).
CPU_WORK_ELEMS = 1 << 26


# The work on one scale block (mask, block scale, column loop): "torch" (any device), "triton"
# (CUDA, or Triton's interpreter with TRITON_INTERPRET=1), or "auto" (triton on CUDA when it
# imports and does the run's mask, block-scale local dtype and block size, else torch).
KERNELS = ("auto", "torch", "triton")


# (error-updated weights of one scale block [B, M, G], diagonal of its U [B, G]) -> entries
# kept [B, M, G] (bool), chosen before the block's scale; None: no mask (GPTQ). A rule the
# Triton kernel also implements carries its name there in an attribute `fused`
# (obs_kernel.FUSED_MASKS; sparsegpt.p48_mask: "p48").
MaskRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def prepare_inverse(h: torch.Tensor, percdamp: float = PERCDAMP, leaf: int | None = None,
                    precision: str = "fp32") -> torch.Tensor:
    """U = upper Cholesky factor of (H + damp I)^-1, for H [B, K, K] (fp32).

    A column no token touched (zero diagonal) gets a unit diagonal: it neither receives nor
    passes error and is quantized on its own (pruned by magnitude under a mask), instead of
    being zeroed as SparseGPT does (an expert the calibration data never reached must still
    work).

    With J the order-reversing permutation and J H J = L L^T (lower Cholesky),
    (H)^-1 = (J L^-1 J)^T (J L^-1 J) and J L^-1 J is upper with a positive diagonal: so U is
    L^-1 of the flipped H, where SparseGPT's code (Cholesky, explicit inverse, Cholesky again)
    takes about three times the arithmetic. L^-1 comes from one recursion of batched fp32
    GEMMs (`triangular.inverse_cholesky_factor_`), with torch's Cholesky and
    triangular solve only on diagonal blocks of `leaf` to 2 `leaf` - 1 columns (default
    triangular.LEAF; K < 2 `leaf`: exactly one Cholesky and one solve_triangular against I).
    `precision` is that of the recursion's GEMMs, whatever the process set: "fp32" (TF32 off)
    or "tf32" (TF32 tensor cores on a GPU; on a CPU the same as fp32). bf16 operands would lose
    the factor's small entries, and are refused.
    """
    if precision not in ("fp32", "tf32"):
        raise ValueError(f"the inverse runs in fp32 or tf32, not {precision!r}")
    h = h.float().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag += percdamp * diag.mean(-1, keepdim=True)
    del diag  # a view: the damped copy goes as soon as its flip is made
    h = h.flip(-2, -1)
    with _matmul_precision(precision, h.device):
        return triangular.inverse_cholesky_factor_(h, leaf or triangular.LEAF).flip(-2, -1)


@contextlib.contextmanager
def _matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """CUDA fp32 matrix products on TF32 tensor cores for "tf32", in full fp32 otherwise,
    whatever the process had set (restored after)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _subtract_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, precision: str
                      ) -> None:
    """out -= a @ b (batched), in place on a view of the weights."""
    if precision == "bf16":
        out -= torch.bmm(a.bfloat16(), b.bfloat16()).float()
    else:
        out.baddbmm_(a, b, alpha=-1.0)


def _round_to_grid(x: torch.Tensor, step: torch.Tensor, cuts: torch.Tensor, lut: torch.Tensor
                   ) -> torch.Tensor:
    """nvfp4.fake_quantize of single columns x on per-row steps, in a few elementwise ops (the
    same division, rounding boundaries and sign rule, so the same bits)."""
    y = x / step
    v = lut[torch.bucketize(y.abs(), cuts)]
    return torch.where(y < 0, -v, v) * step


def column_loop(wg: torch.Tensor, ug: torch.Tensor, keep: torch.Tensor | None,
                step: torch.Tensor, eg: torch.Tensor) -> None:
    """The in-block loop in torch, in place: for each column j of the scale block wg
    [B, M, G] (a view of the weights), quantize it on the rows' steps [B, M] (entries not in
    `keep` +0), write its scaled error (w - q) / U_jj to eg[..., j] and subtract error x U's
    row j from the block's later columns. ug [B, G, G] is the block's part of U."""
    cuts = nvfp4.cut_points(wg.device)
    lut = torch.tensor(nvfp4.E2M1, dtype=torch.float32, device=wg.device)
    d = ug.diagonal(dim1=-2, dim2=-1)
    g = wg.shape[-1]
    for j in range(g):
        col = wg[:, :, j]
        q = _round_to_grid(col, step, cuts, lut)
        if keep is not None:
            q = torch.where(keep[:, :, j], q, 0.0)
        e = (col - q) / d[:, None, j]
        if j + 1 < g:
            wg[:, :, j + 1:] -= e.unsqueeze(-1) * ug[:, None, j, j + 1:]
        wg[:, :, j] = q
        eg[:, :, j] = e


def scale_block(wg: torch.Tensor, ug: torch.Tensor, gs: torch.Tensor, mask: MaskRule | None,
                rule: str, local_dtype: torch.dtype, arithmetic: str, eg: torch.Tensor
                ) -> torch.Tensor:
    """One scale block wg [B, M, G] (a view of the weights, updated in place) in torch: its
    mask, if any, on the error-updated weights; its FP8 block-scale codes by `rule` on them
    (after the mask: the rule the encoder uses) and the rows' global scales gs [B, M]; then
    `column_loop`. ug [B, G, G] is the block's part of U, eg [B, M, G] takes the scaled
    errors. Returns the codes uint8 [B, M]."""
    b, m, _ = wg.shape
    keep = None if mask is None else mask(wg, ug.diagonal(dim1=-2, dim2=-1))
    blocks = wg if keep is None else torch.where(keep, wg, 0.0)
    codes = nvfp4.choose_block_codes(blocks.reshape(b * m, 1, -1), gs.reshape(b * m, 1), rule,
                                     local_dtype, arithmetic, kernel="torch").reshape(b, m)
    column_loop(wg, ug, keep, nvfp4.block_step(codes, gs, arithmetic)[..., 0], eg)
    return codes


def _scale_block_for(kernel: str, device: torch.device, mask: MaskRule | None,
                     local_dtype: torch.dtype, group_size: int):
    """The scale-block step `kernel` names: (wg, ug, gs, rule, local_dtype, arithmetic, eg) ->
    codes, as `scale_block` with the run's mask bound."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")

    def torch_block(wg, ug, gs, rule, local_dtype, arithmetic, eg):
        return scale_block(wg, ug, gs, mask, rule, local_dtype, arithmetic, eg)

    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return torch_block
    if kernel == "auto" and importlib.util.find_spec("triton") is None:
        return torch_block
    from kconvert.methods import obs_kernel

    fused = None if mask is None else getattr(mask, "fused", "")
    if kernel == "auto" and not obs_kernel.supports(fused, local_dtype, group_size):
        return torch_block

    def triton_block(wg, ug, gs, rule, local_dtype, arithmetic, eg):
        return obs_kernel.scale_block(wg, ug, gs, fused, rule, local_dtype, arithmetic, eg)

    return triton_block


def obs_quantize(w: torch.Tensor, u: torch.Tensor, gs: torch.Tensor, group_size: int,
                 rule: str, local_dtype: torch.dtype = torch.float32,
                 arithmetic: str = "compressed-tensors", precision: str = "fp32",
                 mask: MaskRule | None = None, kernel: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-compensated NVFP4 quantization of w [B, M, K] with U [B, K, K]
    (`prepare_inverse`), with `mask` chosen per scale block if given.

    gs [B, M] is each row's NVFP4 global scale; `rule` the block-scale rule ("amax" | "mse");
    `precision` that of the error propagation's matrix products (PRECISIONS); `kernel` the
    in-block loop (KERNELS). Returns (W-hat [B, M, K] on the NVFP4 grid, masked entries +0,
    FP8 block-scale codes uint8 [B, M, K/group_size]).
    """
    b, m, k = w.shape
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {group_size}")
    block = _scale_block_for(kernel, w.device, mask, local_dtype, group_size)
    lazy = BLOCKSIZE if k % BLOCKSIZE == 0 else group_size
    w = w.float().clone()
    gs = gs.float()
    codes = torch.empty(b, m, k // group_size, dtype=torch.uint8, device=w.device)
    err = torch.empty(b, m, lazy, dtype=torch.float32, device=w.device)
    with _matmul_precision(precision, w.device):
        for i1 in range(0, k, lazy):
            i2 = i1 + lazy
            for j0 in range(i1, i2, group_size):
                j1 = j0 + group_size
                eg = err[:, :, j0 - i1:j1 - i1]
                codes[:, :, j0 // group_size] = block(w[:, :, j0:j1], u[:, j0:j1, j0:j1], gs,
                                                      rule, local_dtype, arithmetic, eg)
                if j1 < i2:
                    _subtract_product(w[:, :, j1:i2], eg, u[:, j0:j1, j1:i2], precision)
            if i2 < k:
                _subtract_product(w[:, :, i2:], err, u[:, i1:i2, i2:], precision)
    return w, codes


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """tr(dW H dW^T) per row, dW = W-hat - W: the squared output error on the calibration
    tokens (w, w_hat [B, M, K], h [B, K, K]) -> float64 [B, M]. On a GPU the product runs on
    TF32 tensor cores (fp32 would cost a full-size layer about 6 s on an H100; the errors
    compared differ by far more than TF32's rounding wherever GPTQ helps)."""
    d = (w_hat - w).float()
    with _matmul_precision("tf32", d.device):
        return (torch.bmm(d, h.float()) * d).sum(-1, dtype=torch.float64)


class HessianSplit(NamedTuple):
    """A matrix's Hessian from the tokens its fit sees, and from those held out of it (None
    where none are: then both the fit and the comparison with RTN use `fit`)."""

    fit: torch.Tensor
    held_out: torch.Tensor | None


@dataclass(frozen=True)
class Member:
    """One matrix of a transform item and the Hessian it is quantized under (`expert` None: the
    shared expert's, or a linear's input Gram where `inputs` names its fused set: attention,
    dense MLP). Matrices with the same `key` (an expert's gate and up, or a fused set's
    members, see the same inputs) run as one [rows, in] matrix: one Hessian, one factor, one
    loop."""

    layer: int
    expert: int | None
    proj: str  # gate_proj | up_proj | down_proj, or an attention projection
    inputs: str | None = None  # the fused set of a linear whose Hessian is its input Gram

    @property
    def key(self) -> tuple:
        if self.inputs is not None:
            return (self.inputs,)
        return self.layer, self.expert, self.proj == "down_proj"


# Roles whose Hessians come from the MoE block's captured inputs (a routed expert's tokens,
# every token for the shared expert); every other targeted linear's is its input Gram.
EXPERT_ROLES = (Role.ROUTED_EXPERT, Role.SHARED_EXPERT)


def members_of(names: Sequence[TensorName]) -> list[Member]:
    """The Members of the linears named `names` (parsed names of their weights)."""
    return [Member(tn.layer, tn.expert, tn.proj,
                   None if tn.role in EXPERT_ROLES else tn.fused_set) for tn in names]


@dataclass(frozen=True)
class Choice:
    """GPTQ against RTN for one matrix: both output errors on the same Hessian (that of the
    held-out tokens where the matrix has HELDOUT_MIN of them, else the calibration tokens'),
    and which was written ("gptq" only when strictly better)."""

    method: str
    gptq_error: float
    rtn_error: float
    judged_on: str = "calibration"  # "held-out": tokens the GPTQ fit did not see


def quantize_batches(w: torch.Tensor, gs: torch.Tensor, members: Sequence[Member],
                     hessian: Callable[[Member], HessianSplit], group_size: int, rule: str,
                     local_dtype: torch.dtype, arithmetic: str, *, mask: MaskRule | None = None,
                     against_rtn: bool = False, budget: int | None = None,
                     precision: str = "fp32"
                     ) -> tuple[torch.Tensor, torch.Tensor, list[Choice] | None]:
    """OBS-quantize w [B, M, K] (B matrices, per-matrix global scales gs [B]), batching the
    Hessian-sharing groups of `members` (one per matrix) `experts_per_batch(budget)` at a time.

    With `against_rtn`, each matrix's result is compared with round-to-nearest and the better
    is kept (RTN's values and codes are the encoder's own, so an RTN choice gives exactly the
    bytes of a run without OBS); the choices come back per matrix. The comparison is on the
    held-out tokens' Hessian where `hessian` gives one, else on the fitted one.
    `precision` is that of the inverse's and the error propagation's matrix products ("fp32"
    or "tf32").
    Returns (weights [B, M, K], block codes uint8 [B, M, K/group_size],
    choices or None).
    """
    keys = [mb.key for mb in members]
    order = list(dict.fromkeys(keys))
    groups = [[i for i, key in enumerate(keys) if key == o] for o in order]
    if len({len(g) for g in groups}) != 1:
        raise ValueError("an OBS batch mixes Hessian groups of different sizes")
    b, m, k = w.shape
    per = len(groups[0])
    gs = gs.to(w.device)
    out = torch.empty_like(w)
    out_codes = torch.empty(b, m, k // group_size, dtype=torch.uint8, device=w.device)
    choices: list[Choice | None] = [None] * b
    step = obs_memory.experts_per_batch(per * m, k, budget, against_rtn=against_rtn)
    for start in range(0, len(order), step):
        real = list(range(start, min(start + step, len(order))))
        fits, held = [], []
        for i in real:
            split = hessian(members[groups[i][0]])
            fits.append(split.fit.to(w.device))
            held.append(split.held_out)
        batch, fits, held = (obs_memory.padded(v, step, w.device) for v in (real, fits, held))
        h = torch.stack(fits)
        del fits, split
        u = prepare_inverse(h, precision=precision)
        rows = [j for i in batch for j in groups[i]]
        idx = torch.tensor(rows, device=w.device)
        row_gs = gs[idx].repeat_interleave(m).reshape(len(batch), per * m)
        target = w[idx].reshape(len(batch), per * m, k)
        w_hat, codes = obs_quantize(target, u, row_gs, group_size, rule, local_dtype,
                                    arithmetic, precision, mask=mask)
        del u
        if against_rtn:
            judged = torch.stack([h[n] if o is None else o.to(w.device)
                                  for n, o in enumerate(held)])
            w_hat, codes = keep_better_than_rtn(target, w_hat, codes, judged, row_gs, per,
                                                group_size, rule, local_dtype, arithmetic, rows,
                                                choices, [o is not None for o in held])
            del judged
        del h, held
        solved = len(real) * per  # the padding's repeats are dropped
        out[idx[:solved]] = w_hat.reshape(-1, m, k)[:solved]
        out_codes[idx[:solved]] = codes.reshape(-1, m, k // group_size)[:solved]
        del w_hat
    return out, out_codes, (choices if against_rtn else None)  # type: ignore[return-value]


def keep_better_than_rtn(target: torch.Tensor, w_hat: torch.Tensor, codes: torch.Tensor,
                         h: torch.Tensor, row_gs: torch.Tensor, per: int, group_size: int,
                         rule: str, local_dtype: torch.dtype, arithmetic: str, rows: list[int],
                         choices: list[Choice | None], held_out: list[bool] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per matrix (`per` matrices of equal rows share each batch entry of target [nb, r, k]),
    the OBS result (w_hat, codes) or RTN's, whichever has the smaller output error on h; each
    matrix's Choice goes to choices[rows[...]], saying whether entry's h was of held-out
    tokens (`held_out`, per batch entry)."""
    nb, r, k = target.shape
    blocks = target.reshape(nb * r, -1, group_size)
    rtn_codes = nvfp4.choose_block_codes(blocks, row_gs.reshape(-1, 1), rule, local_dtype,
                                         arithmetic)
    rtn = nvfp4.fake_quantize(blocks, rtn_codes, row_gs.reshape(-1, 1), arithmetic)
    rtn, rtn_codes = rtn.reshape(nb, r, k), rtn_codes.reshape(nb, r, -1)
    m = r // per
    obs_err = output_error(target, w_hat, h).reshape(nb, per, m).sum(-1)
    rtn_err = output_error(target, rtn, h).reshape(nb, per, m).sum(-1)
    better = (obs_err < rtn_err).repeat_interleave(m, dim=1)  # [nb, r]
    on = [("held-out" if held_out and held_out[n] else "calibration")
          for n in range(nb) for _ in range(per)]
    for j, o, e, where in zip(rows, obs_err.reshape(-1).tolist(), rtn_err.reshape(-1).tolist(),
                              on, strict=True):
        choices[j] = Choice("gptq" if o < e else "rtn", o, e, where)
    # RTN's matrices go to the encoder as the target itself with RTN's codes: the encoder
    # rounds them exactly as an RTN run does (same nibbles, negative zeros included).
    return (torch.where(better[..., None], w_hat, target),
            torch.where(better[..., None], codes, rtn_codes))
