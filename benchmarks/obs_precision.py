"""Part precision of `python -m benchmarks obs`: GPTQ's inverse and column loop in fp32, TF32
and bf16 (obs.PRECISIONS), the time each saves against the output error it adds on tokens the
fit did not see (docs/obs.md, "TF32")."""

from __future__ import annotations

import statistics

import torch

from benchmarks.harness import Timer
from benchmarks.obs_stage import hessians, problem
from kconvert.formats import nvfp4
from kconvert.methods import obs

# Held-out tokens per expert beside --tokens fitted ones: one in eight, as GPTQ holds out
# (obs.HELDOUT_EVERY).
HELD_OUT_SHARE = 1 / 8
# The outlier inputs: this share of the input channels, this many times larger (real
# activations have a few such channels).
OUTLIER_SHARE, OUTLIER_SCALE = 0.01, 30.0


def _with_outliers(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """bf16 inputs [e, tokens, k] with OUTLIER_SHARE of their channels OUTLIER_SCALE times
    larger."""
    k = x.shape[-1]
    scale = torch.ones(k, device=x.device)
    scale[torch.randperm(k, generator=gen, device=x.device)[:max(1, int(k * OUTLIER_SHARE))]] = (
        OUTLIER_SCALE)
    return (x.float() * scale).to(torch.bfloat16)


def precision_part(dev: torch.device, dims, tokens: int, e: int) -> dict:
    """For Gaussian and outlier inputs and each expert matrix kind (gate+up [2 inter, hidden],
    down [hidden, inter]), `e` experts: for each inverse precision (fp32, tf32) and loop
    precision (fp32, tf32, bf16), the median of three synchronised times of `prepare_inverse`
    and of `obs_quantize`, the held-out output error summed over the batch relative to fp32's
    and to RTN's, and the share of block codes that differ from fp32's."""
    hidden, inter = dims
    held = max(1, int(tokens * HELD_OUT_SHARE))
    timer = Timer(dev)
    rows = []
    for kind in ("gaussian", "outliers"):
        for name, (m, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            gen = torch.Generator(device=dev).manual_seed(1)
            w, x = problem(dev, e, m, k, tokens + held, gen)
            if kind == "outliers":
                x = _with_outliers(x, gen)
            h_fit, h_held = hessians(x[:, :tokens]), hessians(x[:, tokens:])
            del x
            gs = nvfp4.tensor_scale(w.abs().amax((1, 2))).repeat_interleave(m).reshape(e, m)
            blocks = w.reshape(e * m, -1, 16)
            rtn_codes = nvfp4.choose_block_codes(blocks, gs.reshape(-1, 1), "mse",
                                                 torch.float32, "compressed-tensors")
            rtn = nvfp4.fake_quantize(blocks, rtn_codes, gs.reshape(-1, 1),
                                      "compressed-tensors").reshape(e, m, k)
            rtn_err = float(obs.output_error(w, rtn, h_held).sum())
            ref = None
            for inverse_p in ("fp32", "tf32"):
                for loop_p in obs.PRECISIONS:
                    obs.prepare_inverse(h_fit, precision=inverse_p)  # the allocator's growth
                    inv_s, u = timer.each(3, obs.prepare_inverse, h_fit, precision=inverse_p)
                    loop_s, (w_hat, codes) = timer.each(3, obs.obs_quantize, w, u, gs, 16,
                                                        "mse", precision=loop_p)
                    err = float(obs.output_error(w, w_hat, h_held).sum())
                    if ref is None:
                        ref = (err, codes.clone())
                    rows.append({"x": kind, "matrix": name, "inverse": inverse_p,
                                 "loop": loop_p,
                                 "inverse_s": round(statistics.median(inv_s), 4),
                                 "loop_s": round(statistics.median(loop_s), 4),
                                 "held_err_vs_fp32": round(err / ref[0], 6),
                                 "held_err_vs_rtn": round(err / rtn_err, 5),
                                 "codes_differ": round(float((codes != ref[1]).float().mean()),
                                                       6),
                                 "u_finite": bool(torch.isfinite(u).all())})
                    del u, w_hat, codes
    return {"experts": e, "fit_tokens": tokens, "held_out_tokens": held, "runs": rows}
