"""SparseGPT with paired-4:8 masks and NVFP4 quantization in ONE loop (p48.md, "Mask selection" 3).

For a batch of matrices W [B, M, K] that share an input Hessian H = X^T X per batch entry
(an expert's gate and up rows see the same tokens), columns are visited left to right. At the
start of every NVFP4 scale block (16 or 32 columns) the p48 mask of its chunks is chosen on the
error-updated weights by the OBS score w^2 / [U]_jj^2 (U = chol(H^-1), upper), the block's FP8
scale is chosen AFTER that mask (the same rule the encoder uses), then each column is quantized
with that scale (pruned entries set to +0) and its error is propagated to the columns not yet
visited. Pruning and quantization are one loop: chaining SparseGPT then GPTQ does not preserve
zeros (llm-compressor PR #2860).

The propagation is blocked three ways (SparseGPT's lazy batch updates, one level deeper), so
that almost all of the arithmetic is large batched matrix products and the per-column work
touches only one scale block's columns:
  inside a scale block   rank-1 updates of the block's own later columns (G columns)
  end of a scale block   one batched product for the rest of its BLOCKSIZE-column lazy block
  end of a lazy block    one batched product for every later column
Every entry gets the same updates as in the plain per-column loop (each column's error times
its row of U), only summed in another order, so results agree up to fp32 rounding (tested
against the per-column loop kept in tests/oracles.py).

The result is W-hat already on the NVFP4 grid plus the block-scale codes to encode it with,
so the encoder writes exactly the values this loop optimised.

Calibration inputs come from `CalibrationHessians`, which runs `kconvert.calibrate`'s exact
layer-streamed forward on a thread beside the conversion and hands over one MoE layer at a
time (its captured inputs and decoded weights), so no Hessian is ever stored: a layer's are
built on demand from its routed tokens and freed after use. With `hessian="sequential"` the
compressed experts are written back into the handed-over layer and the layer is run again, so
every later layer's inputs are those of the already-compressed model (the SparseGPT paper's
order); with "source" they are the unpruned source's.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kconvert.errors import KconvertError
from kconvert.formats import nvfp4
from kconvert.sparsity import p48

BLOCKSIZE = 128  # columns per lazy-update block (else one NVFP4 block, for small K)
PERCDAMP = 0.1  # damping, as a fraction of the mean Hessian diagonal (p48.md)


# Matrix products of the error propagation: fp32 (the default), TF32 tensor cores (CUDA only;
# on a CPU the same as fp32) or bf16 operands with fp32 accumulation.
PRECISIONS = ("fp32", "tf32", "bf16")


# Experts per SparseGPT batch on a CPU (a GPU's batch is sized from its free memory).
CPU_BATCH = 8


def prepare_inverse(h: torch.Tensor, percdamp: float = PERCDAMP) -> torch.Tensor:
    """U = upper Cholesky factor of (H + damp I)^-1, for H [B, K, K] (fp32).

    A column no token touched (zero diagonal) gets a unit diagonal: it neither receives nor
    passes error and is pruned by magnitude, instead of being zeroed as SparseGPT does (an
    expert the calibration data never reached must still work).

    With J the order-reversing permutation and J H J = L L^T (lower Cholesky),
    (H)^-1 = (J L^-1 J)^T (J L^-1 J) and J L^-1 J is upper with a positive diagonal: so U is
    one Cholesky and one triangular solve, where SparseGPT's code (Cholesky, explicit inverse,
    Cholesky again) takes about three times the arithmetic.
    """
    h = h.float().clone()
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag += percdamp * diag.mean(-1, keepdim=True)
    lower = torch.linalg.cholesky(h.flip(-2, -1))
    del h
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    return torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False).flip(-2, -1)


def batch_bytes(rows: int, k: int, tokens: int = 0) -> int:
    """GPU bytes one Hessian-sharing matrix [rows, k] takes in a SparseGPT batch: Hessian, its
    factor and their temporaries, the weights, their copy and the result, and its routed
    inputs (`tokens` of them) in fp32."""
    return 4 * (4 * k * k + 4 * rows * k + tokens * k)


def experts_per_batch(rows: int, k: int, budget: int | None, tokens: int = 0) -> int:
    """How many Hessian-sharing matrices [rows, k] one SparseGPT batch takes: on a GPU as
    many as `budget` bytes hold (the OBS share of the command's GPU memory plan,
    kconvert.gpu_plan), at least one; on a CPU (`budget` None) `CPU_BATCH`."""
    if budget is None:
        return CPU_BATCH
    return max(1, budget // batch_bytes(rows, k, tokens))


@contextlib.contextmanager
def _matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if precision != "tf32" or device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
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


def prune_quantize(w: torch.Tensor, u: torch.Tensor, gs: torch.Tensor, group_size: int, rule: str,
                   local_dtype: torch.dtype = torch.float32,
                   arithmetic: str = "compressed-tensors",
                   precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Joint p48 prune + NVFP4 quantize of w [B, M, K] with U [B, K, K] (`prepare_inverse`).

    gs [B, M] is each row's NVFP4 global scale; `precision` that of the error propagation's
    matrix products (PRECISIONS). Returns (W-hat [B, M, K] on the NVFP4 grid with pruned
    pairs +0, FP8 block-scale codes uint8 [B, M, K/group_size]).
    """
    b, m, k = w.shape
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of the block size {group_size}")
    lazy = BLOCKSIZE if k % BLOCKSIZE == 0 else group_size
    w = w.float().clone()
    gs = gs.float()
    codes = torch.empty(b, m, k // group_size, dtype=torch.uint8, device=w.device)
    row_gs = gs.reshape(b * m, 1)
    cuts = nvfp4.cut_points(w.device)
    lut = torch.tensor(nvfp4.E2M1, dtype=torch.float32, device=w.device)
    err = torch.empty(b, m, lazy, dtype=torch.float32, device=w.device)
    with _matmul_precision(precision, w.device):
        for i1 in range(0, k, lazy):
            i2 = i1 + lazy
            for j0 in range(i1, i2, group_size):
                j1 = j0 + group_size
                wg = w[:, :, j0:j1]  # a view: updated in place
                ug = u[:, j0:j1, j0:j1]
                d = ug.diagonal(dim1=-2, dim2=-1)  # [B, G]
                obs = wg.square() / d[:, None].square()
                keep = p48.top2_pairs(obs[..., 0::2] + obs[..., 1::2]).repeat_interleave(2, -1)
                c = nvfp4.choose_block_codes(torch.where(keep, wg, 0.0).reshape(b * m, 1, -1),
                                             row_gs, rule, local_dtype, arithmetic).reshape(b, m)
                codes[:, :, j0 // group_size] = c
                step = nvfp4.block_step(c, gs, arithmetic)[..., 0]
                eg = err[:, :, j0 - i1:j1 - i1]
                for j in range(group_size):
                    col = wg[:, :, j]
                    q = torch.where(keep[:, :, j], _round_to_grid(col, step, cuts, lut), 0.0)
                    e = (col - q) / d[:, None, j]
                    if j + 1 < group_size:
                        wg[:, :, j + 1:] -= e.unsqueeze(-1) * ug[:, None, j, j + 1:]
                    wg[:, :, j] = q
                    eg[:, :, j] = e
                if j1 < i2:
                    _subtract_product(w[:, :, j1:i2], eg, u[:, j0:j1, j1:i2], precision)
            if i2 < k:
                _subtract_product(w[:, :, i2:], err, u[:, i1:i2, i2:], precision)
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

    With `sequential` (set before the first layer is asked for), `replace` writes compressed
    weights into the handed-over layer, and the pass runs that layer again before the next, so
    later layers see the compressed model's activations. Within a layer the inputs stay those
    of the layer as it came: a down_proj Hessian after its own expert's gate/up were replaced
    is refused (the engine hands a layer's down_proj batches over first).
    """

    def __init__(self, ckpt, input_ids: torch.Tensor, device: torch.device, batch_size: int,
                 dtype: torch.dtype = torch.bfloat16):
        self._args = (ckpt, input_ids, device, batch_size, dtype)
        self.input_ids, self.batch_size = input_ids, batch_size
        self.sequential = False
        # The command's GPU memory plan (kconvert.gpu_plan), set before the first layer is
        # asked for: the forward's micro-batch and the OBS batches' share.
        self.gpu_plan = None
        self._replaced: set[tuple[int, int]] = set()  # (layer, expert): gate/up replaced
        self._handoffs: queue.Queue = queue.Queue(maxsize=1)
        self._release = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: _Handoff | None = None
        self._done = False
        self._closed = False
        self.device = device

    def _run(self) -> None:
        from kconvert.calibrate.run import measure_stats

        ckpt, ids, device, batch_size, dtype = self._args

        def hand_over(layer: int, moe) -> None:
            self._handoffs.put(_Handoff(layer, moe))
            self._release.wait()
            self._release.clear()
            if self._closed:
                raise _Closed

        try:
            measure_stats(ckpt, ids, device, batch_size, dtype=dtype, on_moe=hand_over,
                          rerun_moe=self.sequential, gpu_plan=self.gpu_plan)
            self._handoffs.put(None)
        except _Closed:
            pass
        except BaseException as exc:  # surfaced to the engine's thread in `_layer`
            self._handoffs.put(exc)

    def moe_layer(self, layer: int):
        """The calibration pass's MoE block of `layer` (weights loaded, inputs captured)."""
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
        moe = self.moe_layer(layer)
        if proj == "down_proj" and (layer, expert) in self._replaced:
            raise KconvertError(f"SparseGPT asked for layer {layer} expert {expert}'s down_proj "
                                "Hessian after its gate/up were replaced")
        with torch.no_grad():  # gate/up need only the routed inputs, not down's
            x = (moe.expert_inputs(expert)[1] if proj == "down_proj"
                 else moe.routed_inputs(expert)).float().to(self.device)
            return x.T @ x

    def replace(self, layer: int, expert: int, proj: str, w: torch.Tensor) -> None:
        """Put the compressed weights w [out, in] of one expert linear into the layer the
        pass runs again (`sequential` only)."""
        moe = self.moe_layer(layer)
        if proj == "down_proj":
            target = moe.experts.down[expert]
        else:
            rows = slice(0, moe.inter) if proj == "gate_proj" else slice(moe.inter, None)
            target = moe.experts.gate_up[expert, rows]
            self._replaced.add((layer, expert))
        target.copy_(w)

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
