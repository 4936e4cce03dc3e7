"""SparseGPT with paired-4:8 masks and NVFP4 quantization in ONE loop (p48.md, "Mask selection" 3).

For a batch of matrices W [B, M, K] that share an input Hessian H = X^T X per batch entry
(an expert's gate and up rows see the same tokens), columns are visited left to right in
blocks of BLOCKSIZE. At the start of every NVFP4 scale block (16 or 32 columns) the p48 mask
of its chunks is chosen on the error-updated weights by the OBS score w^2 / [U]_jj^2
(U = chol(H^-1), upper), the block's FP8 scale is chosen AFTER that mask (the same rule the
encoder uses), then each column is quantized with that scale (pruned entries set to +0) and
its error is propagated to the columns not yet visited. Pruning and quantization are one
loop: chaining SparseGPT then GPTQ does not preserve zeros (llm-compressor PR #2860).

The result is W-hat already on the NVFP4 grid plus the block-scale codes to encode it with,
so the encoder writes exactly the values this loop optimised.

Calibration inputs come from `CalibrationHessians`, which runs `kconvert.calibrate`'s exact
layer-streamed forward on a thread beside the conversion and hands over one MoE layer at a
time (its captured inputs and decoded weights), so no Hessian is ever stored: a layer's are
built on demand from its routed tokens and freed after use.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass

import torch

from kconvert.errors import KconvertError
from kconvert.formats import nvfp4
from kconvert.sparsity import p48

BLOCKSIZE = 128  # columns per lazy-update block (else one NVFP4 block, for small K)
PERCDAMP = 0.1  # damping, as a fraction of the mean Hessian diagonal (p48.md)


def prepare_inverse(h: torch.Tensor, percdamp: float = PERCDAMP) -> torch.Tensor:
    """U = upper Cholesky factor of (H + damp I)^-1, for H [B, K, K] (fp32).

    A column no token touched (zero diagonal) gets a unit diagonal: it neither receives nor
    passes error and is pruned by magnitude, instead of being zeroed as SparseGPT does (an
    expert the calibration data never reached must still work).
    """
    h = h.float().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag += percdamp * diag.mean(-1, keepdim=True)
    chol = torch.linalg.cholesky(h)
    inverse = torch.cholesky_inverse(chol)
    return torch.linalg.cholesky(inverse, upper=True)


def prune_quantize(w: torch.Tensor, u: torch.Tensor, gs: torch.Tensor, group_size: int, rule: str,
                   local_dtype: torch.dtype = torch.float32,
                   arithmetic: str = "compressed-tensors") -> tuple[torch.Tensor, torch.Tensor]:
    """Joint p48 prune + NVFP4 quantize of w [B, M, K] with U [B, K, K] (`prepare_inverse`).

    gs [B, M] is each row's NVFP4 global scale. Returns (W-hat [B, M, K] on the NVFP4 grid
    with pruned pairs +0, FP8 block-scale codes uint8 [B, M, K/group_size]).
    """
    b, m, k = w.shape
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {group_size}")
    step = BLOCKSIZE if k % BLOCKSIZE == 0 else group_size  # lazy-update width
    w = w.float().clone()
    codes = torch.empty(b, m, k // group_size, dtype=torch.uint8, device=w.device)
    row_gs = gs.reshape(b * m, 1)
    for i1 in range(0, k, step):
        i2 = i1 + step
        w1 = w[:, :, i1:i2].clone()
        err1 = torch.empty_like(w1)
        u1 = u[:, i1:i2, i1:i2]
        d = u1.diagonal(dim1=-2, dim2=-1)  # [B, step]
        for j0 in range(0, step, group_size):
            cols = slice(j0, j0 + group_size)
            obs = w1[:, :, cols].square() / d[:, None, cols].square()
            keep = p48.top2_pairs(obs[..., 0::2] + obs[..., 1::2]).repeat_interleave(2, -1)
            masked = torch.where(keep, w1[:, :, cols], 0.0)
            c = nvfp4.choose_block_codes(masked.reshape(b * m, 1, group_size), row_gs, rule,
                                         local_dtype, arithmetic)  # [B*M, 1]
            codes[:, :, (i1 + j0) // group_size] = c.reshape(b, m)
            for j in range(j0, j0 + group_size):
                col = w1[:, :, j]
                q = nvfp4.fake_quantize(col.reshape(b * m, 1, 1), c, row_gs,
                                        arithmetic).reshape(b, m)
                q = torch.where(keep[:, :, j - j0], q, 0.0)
                err = (col - q) / d[:, None, j]
                w1[:, :, j:] -= err.unsqueeze(-1) * u1[:, None, j, j:]
                w1[:, :, j] = q
                err1[:, :, j] = err
        w[:, :, i1:i2] = w1
        w[:, :, i2:] -= torch.bmm(err1, u[:, i1:i2, i2:])
    return w, codes


class _Closed(Exception):
    """Raised inside the calibration thread to end it early."""


@dataclass
class _Handoff:
    layer: int
    moe: object  # calibrate.MoEBlock, weights loaded and inputs captured


class CalibrationHessians:
    """Per-expert input Hessians from a layer-streamed calibration pass run beside the engine.

    The pass (kconvert.calibrate.calibrate with `on_moe`) runs on its own thread and stops
    after each MoE layer until the engine has asked for a later layer, so only one layer's
    weights and inputs are held at a time. Layers must be asked for in ascending order (the
    engine orders transform items by layer when this source is used).
    """

    def __init__(self, ckpt, input_ids: torch.Tensor, device: torch.device, batch_size: int,
                 dtype: torch.dtype = torch.bfloat16):
        self._args = (ckpt, input_ids, device, batch_size, dtype)
        self._handoffs: queue.Queue = queue.Queue(maxsize=1)
        self._release = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: _Handoff | None = None
        self._done = False
        self._closed = False
        self.device = device

    def _run(self) -> None:
        from kconvert.calibrate.run import calibrate

        ckpt, ids, device, batch_size, dtype = self._args

        def hand_over(layer: int, moe) -> None:
            self._handoffs.put(_Handoff(layer, moe))
            self._release.wait()
            self._release.clear()
            if self._closed:
                raise _Closed

        try:
            calibrate(ckpt, ids, device, batch_size, dtype=dtype, on_moe=hand_over)
            self._handoffs.put(None)
        except _Closed:
            pass
        except BaseException as exc:  # surfaced to the engine's thread in `_layer`
            self._handoffs.put(exc)

    def _layer(self, layer: int):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kconvert-calibrate",
                                            daemon=True)
            self._thread.start()
        while self._current is None or self._current.layer < layer:
            if self._done:
                raise KconvertError(f"calibration produced no MoE layer {layer}")
            if self._current is not None:
                self._current = None
                self._release.set()  # calibration may free this layer and go on
            got = self._handoffs.get()
            if isinstance(got, BaseException):
                self._done = True
                raise got
            if got is None:
                self._done = True
                continue
            self._current = got
        if self._current.layer != layer:
            raise KconvertError(f"SparseGPT needs MoE layers in ascending order; layer {layer} "
                                f"was asked for after layer {self._current.layer}")
        return self._current.moe

    def hessian(self, layer: int, expert: int, proj: str) -> torch.Tensor:
        """X^T X [in, in] (fp32, on the device) over the tokens routed to the source expert;
        X is the input of gate/up, or act(gate x) * up x for down."""
        moe = self._layer(layer)
        with torch.no_grad():
            x_in, x_down = moe.expert_inputs(expert)
            x = (x_down if proj == "down_proj" else x_in).float().to(self.device)
            return x.T @ x

    def close(self) -> None:
        """Stop the calibration pass (the layers after the last one asked for are not needed)
        and wait for its thread; safe to call more than once, and after an error."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._current = None
        while self._thread.is_alive():
            self._release.set()
            with contextlib.suppress(queue.Empty):  # unblock a pending hand-over
                self._handoffs.get(timeout=0.1)
        self._thread.join()
