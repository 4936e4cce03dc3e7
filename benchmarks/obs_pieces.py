"""Parts inverse and encode of `python -m benchmarks obs`: the stage's inverse, encode and
RTN comparison timed piece by piece, each against its alternatives, on one batch."""

from __future__ import annotations

import os

import torch

from benchmarks.harness import Timer
from benchmarks.obs_stage import METHODS, encode_chunk, hessians, problem
from kconvert.formats import nvfp4
from kconvert.methods import obs, triangular


def timed(dev: torch.device, fn, *args, **kw) -> tuple[float, object]:
    """(seconds, result) of one call, the device synchronised before and after."""
    (seconds,), out = Timer(dev).each(1, fn, *args, **kw)
    return round(seconds, 3), out


def best_of_two(dev: torch.device, fn, *args, **kw) -> tuple[float, object]:
    """(the smaller seconds of two calls, the second's result): the first pays for the
    allocator's growth and any one-time set-up."""
    times, out = Timer(dev).each(2, fn, *args, **kw)
    return round(min(times), 3), out


def fp32_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr(dW H dW^T) summed over the batch, fp32 products (TF32 off)."""
    d = w_hat - w
    return float((torch.bmm(d, h) * d).sum(dtype=torch.float64))


def inverse_part(dev: torch.device, dims, tokens: int, e: int, leaves: list[int]) -> dict:
    """The blocked triangular inverse against one solve_triangular, same run, same batches."""
    hidden, inter = dims
    out: dict = {"experts": e, "default_leaf": triangular.LEAF,
                 "product_leaf": triangular.PRODUCT_LEAF}
    obs.prepare_inverse(torch.eye(256, device=dev)[None].repeat(2, 1, 1) * 2)  # handles
    for name, rows, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        w, x = problem(dev, e, rows, k, tokens, torch.Generator(device=dev).manual_seed(2))
        h = hessians(x)
        del x
        got: dict = {"k": k}
        damped = h.clone()
        diag = damped.diagonal(dim1=-2, dim2=-1)
        diag.masked_fill_(diag == 0, 1.0)
        diag += obs.PERCDAMP * diag.mean(-1, keepdim=True)
        damped = damped.flip(-2, -1)
        got["cholesky_s"], lower = best_of_two(dev, lambda d: torch.linalg.cholesky_ex(d)[0],
                                               damped)
        got["cholesky_looped_s"] = best_of_two(
            dev, lambda d: [torch.linalg.cholesky_ex(di)[0] for di in d], damped)[0]
        del damped
        triangular.invert_lower_(lower.clone())  # in place: the warm-up call on a copy
        got["invert_lower_s"], lower = timed(dev, triangular.invert_lower_, lower)
        u_split = lower.flip(-2, -1)
        del lower
        got["solve_s"], u_old = best_of_two(dev, obs.prepare_inverse, h, leaf=k)
        for leaf in leaves:
            got[f"gemm_leaf{leaf}_s"], u = best_of_two(dev, obs.prepare_inverse, h, leaf=leaf)
            if leaf == triangular.LEAF:
                u_new = u
            del u
        got["cholesky_then_invert_lower_u_rel_diff"] = float(
            ((u_split - u_old).norm(dim=(1, 2)) / u_old.norm(dim=(1, 2))).max())
        del u_split
        got["u_rel_diff"] = float(((u_new - u_old).norm(dim=(1, 2))
                                   / u_old.norm(dim=(1, 2))).max())
        got["u_new_upper"] = bool(torch.equal(u_new, u_new.triu())
                                  and (u_new.diagonal(dim1=-2, dim2=-1) > 0).all())
        if name == "gate_up":
            amax = w.abs().amax((1, 2))
            gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
            for method, mask in METHODS.items():
                old = obs.obs_quantize(w, u_old, gs, 16, "mse", mask=mask)
                new = obs.obs_quantize(w, u_new, gs, 16, "mse", mask=mask)
                got[method] = {"codes_differing": int((old[1] != new[1]).sum()),
                               "codes": old[1].numel(),
                               "values_differing": int((old[0] != new[0]).sum()),
                               "error_solve": fp32_error(w, old[0], h),
                               "error_blocked": fp32_error(w, new[0], h)}
                del old, new
        out[name] = got
        del w, h, u_old, u_new
    return out


def encode_part(dev: torch.device, dims, tokens: int, e: int) -> dict:
    """Where stage's encode and rtn_compare go, on one gate+up batch."""
    hidden, inter = dims
    rows = 2 * inter
    w, x = problem(dev, e, rows, hidden, tokens, torch.Generator(device=dev).manual_seed(3))
    h = hessians(x)
    del x
    amax = w.abs().amax((1, 2))
    gs = nvfp4.tensor_scale(amax).repeat_interleave(rows).reshape(e, rows)
    blocks = w.reshape(e * rows, -1, 16)
    out: dict = {"experts": e}
    out["choose_codes_s"], codes = timed(dev, nvfp4.choose_block_codes, blocks,
                                         gs.reshape(-1, 1), "mse")
    codes = codes.reshape(e, rows, -1)
    got = {}
    runs = {"torch_chunk4M": ("torch", 1 << 22), "torch": ("torch", encode_chunk(dev)),
            "triton": ("triton", encode_chunk(dev))}
    for name, (kernel, chunk) in runs.items():
        if kernel == "triton" and not (dev.type == "cuda"
                                       or os.environ.get("TRITON_INTERPRET") == "1"):
            continue
        out[f"encode_{name}_s"], got[name] = timed(
            dev, nvfp4.quantize, w, amax, "mse", chunk, group_size=16, block_codes=codes,
            kernel=kernel)
    first, *rest = got.values()
    out["encode_bytes_equal"] = all(
        torch.equal(first.packed, q.packed) and torch.equal(first.err_sq, q.err_sq)
        and torch.equal(first.ref_sq, q.ref_sq) for q in rest)
    del got, first, rest
    out["fake_quantize_s"], rtn = timed(dev, nvfp4.fake_quantize, blocks,
                                        codes.reshape(e * rows, -1), gs.reshape(-1, 1))
    out["output_error_s"] = timed(dev, obs.output_error, w, rtn.reshape(w.shape), h)[0]
    out["rtn_compare_s"] = timed(dev, obs.keep_better_than_rtn, w, w.clone(), codes, h, gs, 1,
                                 16, "mse", torch.float32, "compressed-tensors",
                                 list(range(e)), [None] * e)[0]
    return out
