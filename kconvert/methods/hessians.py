"""Per-matrix input Hessians H = X^T X from kconvert.calibrate's layer-streamed forward, for
the OBS engine (kconvert.methods.obs: GPTQ and SparseGPT).

`CalibrationHessians` runs the calibration forward on a thread beside the conversion and hands
over one layer at a time (its captured MoE inputs and decoded weights, and the input Grams of
its targeted attention and dense MLP linears), so no expert Hessian is ever stored: a layer's
are built on demand from its tokens and freed after use: a routed expert's from the tokens
routed to it, the shared expert's from every token of the layer. The attention and dense MLP
linears' Hessians are their input Grams X^T X, accumulated by forward pre-hooks on
transformers' modules during the forward (kconvert.calibrate.forward.InputGram: in_features^2
fp32 per fused set, however many tokens), and freed with the layer. With
`sequential` the compressed experts are written back into the handed-over layer and the layer
is run again, so every later layer's inputs are those of the already-compressed model (the
SparseGPT paper's order); otherwise they are the unchanged source's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kconvert.calibrate.data import PAD_ID, load_calibration_data, real_tokens
from kconvert.calibrate.forward import model_config
from kconvert.calibrate.held_out import split_rows
from kconvert.calibrate.plan import forward
from kconvert.calibrate.prefetch import project_full_model
from kconvert.common import distributed
from kconvert.errors import KconvertError
from kconvert.gpu.parts import GpuWork
from kconvert.gpu.plan import GpuPlan
from kconvert.gpu.shapes import Shapes
from kconvert.io.checkpoint import Checkpoint
from kconvert.methods.obs import HELDOUT_EVERY, HELDOUT_MIN, HessianSplit
from kconvert.methods.obs_memory import gpu_work
from kconvert.model.names import Role

log = logging.getLogger(__name__)


class _Closed(Exception):
    """Raised inside the calibration thread to end it early."""


@dataclass
class _Handoff:
    layer: int
    moe: object | None  # calibrate.MoEBlock, weights loaded and inputs captured; None: dense
    grams: dict  # fused set -> calibrate.forward.InputGram of the `gram_roles` linears


def gram(x: torch.Tensor) -> torch.Tensor:
    """X^T X in fp32. On a GPU, bf16 or fp16 inputs (the forward's activations) multiply on
    tensor cores, accumulating in fp32: every product of two such values is exact in fp32, so
    the result agrees with the fp32 product within fp32 rounding of the sums, in a tenth of
    its time (a full-size MoE layer's Hessians: docs/performance.md, session 18)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x.T, x, out_dtype=torch.float32)
    x = x.float()
    return x.T @ x


class CalibrationHessians:
    """Per-matrix input Hessians from a layer-streamed calibration pass run beside the engine.

    The pass (kconvert.calibrate.calibrate with `on_captured`) runs on its own thread and stops
    after each MoE layer (and each layer with `gram_roles` linears) until the engine has asked
    for a later layer, so only one layer's weights, inputs and Grams are held at a time.
    Layers must be asked for in ascending order (the engine orders transform items by layer
    when this source is used).

    With `sequential` (set before the first layer is asked for), `replace` writes compressed
    weights into the handed-over layer, and the pass runs that layer again before the next, so
    later layers see the compressed model's activations. Within a layer the inputs stay those
    of the layer as it came: a down_proj Hessian after its own expert's gate/up were replaced
    is refused (the engine hands a layer's down_proj batches over first).
    """

    def __init__(self, ckpt: Checkpoint, input_ids: torch.Tensor, device: torch.device,
                 batch_size: int, dtype: torch.dtype = torch.bfloat16):
        if device.type == "cuda" and device.index is None:
            # the pass runs on a thread of its own, whose current device would be GPU 0: it
            # takes this (main) thread's, a torchrun rank's own GPU (distributed.init)
            distributed.init()
            device = torch.device("cuda", torch.cuda.current_device())
        self._args = (ckpt, input_ids, device, batch_size, dtype)
        self.input_ids, self.batch_size, self.dtype = input_ids, batch_size, dtype
        self.sequential = False
        # Roles whose linears' Hessians are input Grams collected during the forward
        # (attention, dense MLP), set before the first layer is asked for.
        self.gram_roles: frozenset[Role] = frozenset()
        # The command's GPU memory plan (kconvert.gpu.plan), set before the first layer is
        # asked for: the forward's micro-batch, where its hidden states live, the OBS share.
        self.gpu_plan: GpuPlan | None = None
        self._replaced: set[tuple[int, int | None]] = set()  # (layer, expert): gate/up replaced
        self._handoffs: queue.Queue = queue.Queue(maxsize=1)
        self._release = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: _Handoff | None = None
        self._times = (0.0, 0.0)  # the current layer: seconds waited for it, when it came
        self._layer_seconds: list[tuple[bool, float]] = []  # per layer let go: MoE?, seconds
        self._done = False
        self._closed = False
        self.device = device

    def _run(self) -> None:
        from kconvert.calibrate.run import measure_stats

        ckpt, ids, device, batch_size, dtype = self._args
        if device.type == "cuda":  # this thread's collectives and "cuda" tensors go there
            torch.cuda.set_device(device)

        def hand_over(layer: int, moe, grams: dict) -> None:
            self._handoffs.put(_Handoff(layer, moe, grams))
            self._release.wait()
            self._release.clear()
            if self._closed:
                raise _Closed

        try:
            measure_stats(ckpt, ids, device, batch_size, dtype=dtype, on_captured=hand_over,
                          grams=self.gram_roles, held_every=self.held_every,
                          rerun_moe=self.sequential, gpu_plan=self.gpu_plan)
            self._handoffs.put(None)
        except _Closed:
            pass
        except BaseException as exc:  # surfaced to the engine's thread in `_layer`
            self._handoffs.put(exc)

    def gpu_work(self, shapes: Shapes, *, shared: bool, against_rtn: bool) -> GpuWork:
        """This calibration forward (its inputs captured for the Hessians) and the OBS batches
        beside it, for the command's GPU memory plan (obs_memory.gpu_work)."""
        return gpu_work(shapes, forward(shapes, *self.input_ids.shape, self.batch_size,
                                        self.dtype.itemsize, capture=True,
                                        rerun=self.sequential),
                        shared=shared, against_rtn=against_rtn, linears=self.gram_roles,
                        held_out=self.held_every > 0)

    def obs_budget(self, device: torch.device) -> int | None:
        """Bytes one OBS batch may take on `device`: the plan's OBS share on a GPU (a plan is
        made for every GPU run, kconvert.driver.convert), None on a CPU
        (obs_memory.experts_per_batch gives OBS_BATCH matrices)."""
        if device.type != "cuda":
            return None
        if self.gpu_plan is None:
            raise KconvertError("the OBS engine ran on a GPU without a GPU memory plan")
        return self.gpu_plan.obs_bytes

    @property
    def held_every(self) -> int:
        """HELDOUT_EVERY where the pass's real tokens leave HELDOUT_MIN held out of a matrix
        that sees every token (the Grams' split, as `split_hessians`'), else 0."""
        tokens = int((self.input_ids != PAD_ID).sum())
        return HELDOUT_EVERY if tokens // HELDOUT_EVERY >= HELDOUT_MIN else 0

    def moe_layer(self, layer: int):
        """The calibration pass's MoE block of `layer` (weights loaded, inputs captured)."""
        moe = self._layer(layer).moe
        if moe is None:
            raise KconvertError(f"the OBS engine asked for layer {layer}'s experts; it is dense")
        return moe

    def linear_hessians(self, layer: int, fused_set: str) -> HessianSplit:
        """The input Gram of the linears of `fused_set` in `layer` (a `gram_roles` role), split
        as `split_hessians`' (fit, held-out rows; held-out None where too few are held out)."""
        gram = self._layer(layer).grams.get(fused_set)
        if gram is None or gram.fit is None:
            raise KconvertError(f"the calibration pass collected no input Hessian for "
                                f"{fused_set}")
        return HessianSplit(gram.fit, gram.held)

    def _layer(self, layer: int) -> _Handoff:
        """The calibration pass's hand-over of `layer`, after its forward."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kconvert-calibrate",
                                            daemon=True)
            self._thread.start()
        while self._current is None or self._current.layer < layer:
            if self._done:
                raise KconvertError(f"calibration handed over no layer {layer}")
            if self._current is not None:
                self._let_go()
                self._release.set()  # calibration may free this layer and go on
            asked = time.perf_counter()
            got = self._handoffs.get()
            if isinstance(got, BaseException):
                self._done = True
                raise got
            if got is None:
                self._done = True
                continue
            self._current = got
            self._times = (time.perf_counter() - asked, time.perf_counter())
        if self._current.layer != layer:
            raise KconvertError(f"the OBS engine needs layers in ascending order; layer "
                                f"{layer} was asked for after layer {self._current.layer}")
        return self._current

    def _let_go(self) -> None:
        """The engine is done with the layer it holds: -v logs where that layer's seconds
        went (the forward the engine waited for, then its own work on the layer: the OBS
        solve of this rank's matrices of it)."""
        if self._current is not None:
            waited, handed = self._times
            solving = time.perf_counter() - handed
            log.info("OBS layer %d: %.2f s waiting for its calibration forward, %.2f s "
                     "solving it", self._current.layer, waited, solving)
            self._layer_seconds.append((self._current.moe is not None, waited + solving))
        self._current = None

    def _project(self) -> None:
        """-v logs the whole model's projection from the layers' seconds (waited + solved).
        A layer the engine never asked for (a dense layer under the default targets) has its
        forward inside the next layer's wait, so it counts as nothing apart."""
        moe = [seconds for is_moe, seconds in self._layer_seconds if is_moe]
        dense = [seconds for is_moe, seconds in self._layer_seconds if not is_moe]
        if moe:
            project_full_model("OBS engine: ", moe, sum(dense) / len(dense) if dense else 0.0,
                               model_config(self._args[0]).first_k_dense_replace)

    def hessian(self, layer: int, expert: int | None, proj: str) -> torch.Tensor:
        """X^T X [in, in] (fp32, on the device) over the tokens routed to the source expert
        (`expert` None: the shared expert, every token); X is the input of gate/up, or
        act(gate x) * up x for down."""
        return gram(self.inputs(layer, expert, proj))

    def split_hessians(self, layer: int, expert: int | None, proj: str) -> HessianSplit:
        """`hessian`'s X^T X split in two: the fit's, without every HELDOUT_EVERY-th token, and
        the held-out tokens' (None, and the fit's over every token, where fewer than
        HELDOUT_MIN would be held out)."""
        x = self.inputs(layer, expert, proj)
        if x.shape[0] // HELDOUT_EVERY < HELDOUT_MIN:
            return HessianSplit(gram(x), None)
        kept, held = split_rows(x.shape[0], HELDOUT_EVERY, x.device)
        return HessianSplit(gram(x.index_select(0, kept)), gram(x.index_select(0, held)))

    def inputs(self, layer: int, expert: int | None, proj: str) -> torch.Tensor:
        """X [tokens, in] (on the device, in the calibration forward's dtype) of `hessian`."""
        moe = self.moe_layer(layer)
        if proj == "down_proj" and (layer, expert) in self._replaced:
            raise KconvertError(f"the OBS engine asked for layer {layer} expert {expert}'s "
                                "down_proj Hessian after its gate/up were replaced")
        with torch.no_grad():  # gate/up need only the routed inputs, not down's
            if expert is None and moe.ranks is not None:
                raise KconvertError("the shared expert's Hessian comes from every token, which "
                                    "an expert-parallel layer does not gather (torchrun)")
            if expert is None:
                x = moe.captured()[0]
                if proj == "down_proj":
                    mlp = moe.shared_experts
                    x = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            else:
                x = (moe.expert_inputs(expert)[1] if proj == "down_proj"
                     else moe.routed_inputs(expert))
            return x.to(self.device)

    def replace(self, layer: int, expert: int | None, proj: str, w: torch.Tensor) -> None:
        """Put the compressed weights w [out, in] of one expert linear (`expert` None: the
        shared expert's) into the layer the pass runs again (`sequential` only)."""
        moe = self.moe_layer(layer)
        if expert is None:
            target = getattr(moe.shared_experts, proj).weight
        elif proj == "down_proj":
            target = moe.experts.down[moe.experts.index(expert)]
        else:
            rows = slice(0, moe.inter) if proj == "gate_proj" else slice(moe.inter, None)
            target = moe.experts.gate_up[moe.experts.index(expert), rows]
        if proj != "down_proj":
            self._replaced.add((layer, expert))
        with torch.no_grad():
            target.copy_(w)

    def close(self) -> None:
        """Stop the calibration pass (the layers after the last one asked for are not needed)
        and wait for its thread; safe to call more than once, and after an error. Under
        torchrun the pass runs to its end instead, handing its layers over to no one: every
        rank's pass runs the same collectives (the expert-parallel exchange, the sums of the
        statistics), so no rank may stop before the others (an error on this rank is reported
        to the others after it, kconvert.common.distributed.agree)."""
        if self._thread is None or self._closed:
            return
        if distributed.world() > 1:
            self._let_go()
            self._project()
            while not self._done:
                self._release.set()
                got = self._handoffs.get()
                self._done = got is None or isinstance(got, BaseException)
            self._thread.join()
            self._closed = True
            return
        self._closed = True
        self._let_go()
        self._project()
        while self._thread.is_alive():
            self._release.set()
            with contextlib.suppress(queue.Empty):  # unblock a pending hand-over
                self._handoffs.get(timeout=0.1)
        self._thread.join()


@dataclass(frozen=True)
class Calibration:
    """What a command prepares for the OBS engine from the opened source: the calibration pass
    that yields each matrix's Hessian, and what identifies its data in the manifest and the
    resume fingerprint (None when the inputs came from memory, not from a file)."""

    hessians: CalibrationHessians
    data: dict | None = None

    @classmethod
    def from_file(cls, ckpt: Checkpoint, path: str, samples: int, seq_len: int,
                  batch_size: int, seed: int, device: torch.device,
                  short: Callable[[str], None] | None = None) -> Calibration:
        """Calibration on `samples` sequences of `seq_len` tokens from the JSONL `path`, its
        ids checked against the vocabulary when read (data that cannot fill them: `short`,
        kconvert.calibrate.data.load_calibration_data); the record says what was used."""
        ids = load_calibration_data(path, ckpt.root, samples, seq_len, seed,
                                    vocab=ckpt.text_config["vocab_size"], short=short)
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        return cls(CalibrationHessians(ckpt, ids, device, batch_size),
                   {"sha256": digest, "samples": ids.shape[0], "seq_len": seq_len, "seed": seed,
                    "tokens": real_tokens(ids)})
