"""NVFP4 and SparseGPT written out from their specifications alone, with no kconvert code: the
independent references the mse-search and SparseGPT tests compare kconvert against.

- NVFP4 (formats.md §2): FP8 e4m3 values from their bits, E2M1 rounding to the nearest value
  with ties to the even code, both flavours' scale arithmetic, each block's squared error summed
  as the fixed pairwise tree formats.md names (so two codes compare exactly as kconvert
  compares them), the amax rule's block code and the `mse` window commands.md documents (the
  amax code -2 .. +7, clamped to the positive finite codes).
- p48 (p48.md): in every chunk of 4 pairs the 2 highest scores are kept, ties to the lower pair.
- SparseGPT (Frantar & Alistarh 2023, Algorithm 1, with joint quantization as in its §3.5/GPTQ;
  without the mask, GPTQ's loop):
  U = chol((H + damp I)^-1) upper; columns left to right; at the start of every scale block
  the mask is chosen on the error-updated weights by w^2 / U_jj^2, then the block's FP8 scale
  on the masked weights; each column is quantized (pruned entries 0), its error
  (w_j - q_j) / U_jj is subtracted from every later column times U's row j. No lazy batching
  (the paper's batching changes only the order of the sums).
"""

from __future__ import annotations

import torch

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
CODES = torch.arange(1, 0x7F)  # every positive finite FP8 e4m3 code
WINDOW = tuple(range(-2, 8))  # commands.md: the amax rule's code -2 .. +7


def fp8_value(code: torch.Tensor) -> torch.Tensor:
    """Value of positive FP8 e4m3 codes (4 exponent bits, bias 7, 3 mantissa bits)."""
    exp, man = (code >> 3) & 0xF, (code & 7).float()
    normal = (1 + man / 8) * torch.pow(2.0, exp.float() - 7)
    return torch.where(exp == 0, man / 8 * 2.0 ** -6, normal)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """|y| to the nearest E2M1 value; on a tie the even code (the differences to the two
    neighbours are exact in fp32, so a tie is seen exactly)."""
    dist = (y.unsqueeze(-1) - E2M1_VALUES).abs()
    nearest = (dist == dist.amin(-1, keepdim=True)).float()
    even = (torch.arange(8) % 2 == 0).float()
    return E2M1_VALUES[(nearest * 2 + even * nearest).argmax(-1)]


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def step_of(codes: torch.Tensor, gs: torch.Tensor, arithmetic: str) -> torch.Tensor:
    """Element step of block codes [N, ...] with per-row scales gs [N]: compressed-tensors'
    fp32(d) / g, ModelOpt's fp32(d) * g."""
    d = fp8_value(codes)
    g = gs.reshape(-1, *([1] * (codes.dim() - 1)))
    return d * g if arithmetic == "modelopt" else d / g


def block_errors(mag: torch.Tensor, gs: torch.Tensor, codes: torch.Tensor,
                 arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """Squared error [N, nb, C] of |x| blocks [N, nb, B] under each of codes [N, nb, C]."""
    step = step_of(codes, gs, arithmetic)
    y = mag.unsqueeze(-2) / step.unsqueeze(-1)
    err = round_e2m1(y) * step.unsqueeze(-1) - mag.unsqueeze(-2)
    return pairwise_sum(err * err)


def amax_code(mag: torch.Tensor, gs: torch.Tensor, arithmetic: str = "compressed-tensors"
              ) -> torch.Tensor:
    """The amax rule's code [N, nb] of |x| blocks [N, nb, B] (formats.md §2)."""
    block_amax = mag.amax(-1)
    g = gs[:, None]
    if arithmetic == "modelopt":
        d = block_amax / (torch.tensor(6.0) * g)
        d = torch.where(d == 0, torch.ones_like(d), d).clamp(2.0 ** -9, 448.0)
        return d.to(torch.float8_e4m3fn).view(torch.uint8).long()
    d = (g * (block_amax / torch.tensor(6.0))).clamp(max=448.0)
    code = d.to(torch.float8_e4m3fn).view(torch.uint8).long()
    zero = torch.tensor(0.125).to(torch.float8_e4m3fn).view(torch.uint8).long()
    return torch.where(code == 0, zero, code)


def best_code(mag: torch.Tensor, gs: torch.Tensor, rule: str,
              arithmetic: str = "compressed-tensors") -> torch.Tensor:
    """Block codes [N, nb] by `rule`: the amax code, or the window's lowest-error code."""
    base = amax_code(mag, gs, arithmetic)
    if rule == "amax":
        return base
    window = (base.unsqueeze(-1) + torch.tensor(WINDOW)).clamp(1, 0x7E)
    errors = block_errors(mag, gs, window, arithmetic)
    return window.gather(-1, errors.argmin(-1, keepdim=True))[..., 0]


def output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """sum over matrices of tr((W - Q) H (W - Q)^T), for w, q [B, M, K] and h [B, K, K], in
    float64."""
    d = (w - q).double()
    return float(torch.einsum("bmk,bkl,bml->", d, h.double(), d))


def on_grid(w: torch.Tensor, codes: torch.Tensor, gs: torch.Tensor, group: int,
            arithmetic: str = "compressed-tensors") -> bool:
    """Whether every value of w [B, M, K] is an E2M1 value times its block's step (codes
    [B, M, K/group], row global scales gs [B, M]): rounding it to that grid gives it back."""
    b, m, k = w.shape
    step = step_of(codes.reshape(b * m, -1).long(), gs.reshape(b * m),
                   arithmetic).repeat_interleave(group, -1)
    flat = w.reshape(b * m, k)
    again = torch.where(flat < 0, -1.0, 1.0) * round_e2m1(flat.abs() / step) * step
    return bool(torch.equal(again, flat))


def p48_keep(pair: torch.Tensor) -> torch.Tensor:
    """Keep mask of pair scores [..., K/2]: per chunk of 4, the 2 highest, ties to the lower
    index (plain loops)."""
    flat = pair.reshape(-1, 4).tolist()
    keep = torch.zeros(len(flat), 4, dtype=torch.bool)
    for c, scores in enumerate(flat):
        for i in sorted(range(4), key=lambda i: (-scores[i], i))[:2]:
            keep[c, i] = True
    return keep.reshape(pair.shape)


def sparsegpt_inverse(h: torch.Tensor, percdamp: float = 0.1) -> torch.Tensor:
    """U = chol((H + damp I)^-1), upper, as SparseGPT's code computes it (Cholesky, explicit
    inverse, Cholesky again); a column no token touched gets a unit diagonal (p48.md)."""
    h = h.double().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag += percdamp * diag.mean(-1, keepdim=True)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def sparsegpt_p48_nvfp4(w: torch.Tensor, h: torch.Tensor, gs: torch.Tensor, group: int,
                        rule: str, arithmetic: str = "compressed-tensors", prune: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT's joint p48 prune + NVFP4 quantization of w [B, M, K] with Hessians
    h [B, K, K] and row global scales gs [B, M] (module docstring); without `prune`, GPTQ's
    loop (Frantar et al., Algorithm 1) on the NVFP4 grid: no mask. Returns (W-hat on the
    NVFP4 grid, block codes [B, M, K/group])."""
    b, m, k = w.shape
    u = sparsegpt_inverse(h).float()
    w = w.float().clone()
    rows_gs = gs.reshape(b * m)
    codes = torch.empty(b, m, k // group, dtype=torch.long)
    step = keep = None
    for j in range(k):
        if j % group == 0:
            cols = w[:, :, j:j + group]
            d = u[:, range(j, j + group), range(j, j + group)]  # [B, G]
            obs = cols.square() / d[:, None].square()
            keep = (p48_keep(obs[..., 0::2] + obs[..., 1::2]).repeat_interleave(2, -1) if prune
                    else torch.ones_like(obs, dtype=torch.bool))
            masked = torch.where(keep, cols, 0.0).abs().reshape(b * m, 1, group)
            code = best_code(masked, rows_gs, rule, arithmetic)  # [B*M, 1]
            codes[:, :, j // group] = code.reshape(b, m)
            step = step_of(code, rows_gs, arithmetic).reshape(b, m)
        col = w[:, :, j]
        y = col / step
        q = torch.where(y < 0, -1.0, 1.0) * round_e2m1(y.abs()) * step
        q = torch.where(keep[:, :, j % group], q, 0.0)
        err = (col - q) / u[:, None, j, j]
        w[:, :, j + 1:] -= err.unsqueeze(-1) * u[:, None, j, j + 1:]
        w[:, :, j] = q
    return w, codes
