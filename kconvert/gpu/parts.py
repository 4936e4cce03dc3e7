"""The parts of a command's GPU work that their owners declare and the GPU memory plan
(kconvert.gpu.plan) adds up: a layer-streamed forward (`Forward`), the OBS batches (`Obs`), the
engine's encode of a work item (`Encode`), and what a stage runs beside the engine (`GpuWork`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kconvert.gpu.shapes import Shapes

# Matrices an OBS batch solves (and the learned methods train) at once wherever the budget
# holds that many, else as many as it holds; a plan never gives a batch more. On a GPU a batched
# product's rounding depends on its batch count (cuBLAS picks its kernel by it: docs/obs.md,
# "A batch's size changes its experts' bits on a GPU"), so every batch a GPU solves has the
# plan's count, the last one padded: budgets that hold this many write the same bytes, whatever
# the card's free memory or the rank count. 16, not 8: learned p48's full-size layer ran 2.5 s
# faster in batches of 16 (benchmarks/results/README.md, session 24).
OBS_BATCH = 16


@dataclass(frozen=True)
class Forward:
    """A layer-streamed forward (kconvert.calibrate, kconvert.evaluate, REAP's repair), built by
    kconvert.calibrate.plan.forward with the forward's own terms; the other terms are their
    owners'."""

    sequences: int
    seq_len: int
    batch_size: int  # the micro-batch asked for (--batch-size)
    dtype_bytes: int = 2
    models: int = 0  # eval: source and candidates (hidden states each, outputs compared)
    capture: bool = False  # SparseGPT/GPTQ keep the MoE layer's inputs for the Hessians
    rerun: bool = False  # "sequential" Hessians: the layer input is kept to run it again
    repair_bytes: int = 0  # REAP router repair's second stream (kconvert.pruning.repair)
    gram_bytes: int = 0  # input Grams of a layer's targeted linears (calibrate.forward)
    # eval: logits per chunk (kconvert.evaluate.metrics), the source's and a candidate's and
    # their log-softmaxes in fp32
    logit_elems: int = 0
    # decoding one layer's weights beside it (kconvert.calibrate.load)
    decode_bytes: int = field(kw_only=True)
    # Under torchrun (docs/many-gpus.md): `sequences` are this rank's (its batches' hidden
    # states), `job_sequences` the whole job's; with `ranks` > 1 a MoE layer is
    # expert-parallel: the rank holds its block of routed experts, exchanges the routed rows
    # with the others each micro-batch and, capturing, keeps the rows routed to its experts
    # from every rank (in a buffer for all the job's tokens); `gathered`: it also holds every
    # routed expert (REAP's repair on rank 0).
    ranks: int = field(default=1, kw_only=True)
    job_sequences: int = field(default=0, kw_only=True)
    gathered: bool = field(default=False, kw_only=True)

    def tokens(self) -> int:
        return self.sequences * self.seq_len

    def job_tokens(self) -> int:
        """The whole job's tokens (a routed expert sees its share of every rank's)."""
        return (self.job_sequences or self.sequences) * self.seq_len

    def routed_held(self, s: Shapes) -> int:
        """The routed experts of a MoE layer this rank holds."""
        held = -(-s.experts // self.ranks)
        return held + s.experts if self.gathered else held

    def held_fraction(self, s: Shapes) -> float:
        """Of the job's tokens, those with one of their top-k experts among this rank's
        (routing spread evenly over the experts): all of them on one rank."""
        return 1.0 - (1.0 - 1.0 / self.ranks) ** s.top_k if self.ranks > 1 else 1.0

    def share_line(self, s: Shapes) -> str:
        """What this rank holds under torchrun, for the plan's lines ('' on one process)."""
        if self.ranks == 1 and self.job_sequences in (0, self.sequences):
            return ""
        parts = [f"the hidden states of {self.sequences} of {self.job_sequences} sequences"]
        if self.ranks > 1:
            parts.insert(0, f"{-(-s.experts // self.ranks)} of {s.experts} routed experts per "
                            "MoE layer (expert-parallel)")
        if self.gathered:
            parts.append("every routed expert of the layer while it repairs (rank 0)")
        return "  per rank: " + ", ".join(parts)


@dataclass(frozen=True)
class Obs:
    """Batches of Hessian-sharing matrices solved together (SparseGPT, GPTQ): the bytes of
    one matrix of the largest shape (`bytes_per_matrix`: Hessian, factor and temporaries,
    weights and result, kconvert.methods.obs_memory.batch_bytes), and the most matrices one
    batch solves (`per_batch`)."""

    bytes_per_matrix: int
    per_batch: int
    k: int  # input dimension of that matrix (its routed inputs are taken in fp32)
    every_token: bool = False  # a matrix's Hessian is built from every token (shared expert)
    least_bytes: int = 0  # one matrix of the largest targeted shape: a batch holds at least it

    def batch(self, n: int) -> int:
        """Bytes of an OBS batch of `n` matrices of `bytes_per_matrix` (at least one of the
        largest targeted shape)."""
        return max(n * self.bytes_per_matrix, self.least_bytes)


@dataclass(frozen=True)
class Encode:
    """The engine's encode of a work item on a GPU, as the engine declares it
    (kconvert.engine.execute.gpu_encode): the most decoded elements per item, the bytes per
    decoded element an item holds, and the encoder's chunk (its elements, and the bytes per
    element of its temporaries)."""

    item_elems: int
    bytes_per_elem: int
    chunk_elems: int
    chunk_bytes_per_elem: int

    def bytes(self, elems: int) -> int:
        """What the encode of an item of `elems` decoded elements holds."""
        return elems * self.bytes_per_elem + self.chunk_bytes_per_elem * min(self.chunk_elems,
                                                                            elems)


@dataclass(frozen=True)
class GpuWork:
    """What a stage runs on the GPU beside the engine's encode (Stage.gpu_work)."""

    forward: Forward
    obs: Obs
