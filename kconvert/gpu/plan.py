"""The GPU memory plan of a command, from shapes (docs/gpu-memory.md; the budget it is made
for, and its enforcement: kconvert.gpu.budget).

A command's GPU work is split into what stays resident through a layer (the decoded weights of
one decoder layer, the hidden states of every calibration token when they are kept on the
device, SparseGPT's captured layer inputs) and phases that never overlap: the layer-streamed
forward of a micro-batch, the OBS batches (SparseGPT's Hessians, factors and weights), the
engine's encode of one work item, eval's logits. The plan is the largest forward micro-batch
and OBS batch whose peak, resident plus the largest phase, fits the budget: the forward
micro-batch (--batch-size) is halved, the hidden states move to pinned host memory and the
OBS batch shrinks to one expert before a plan is refused; a refusal says how much the least
plan needs and which option lowers it, before anything runs.

The figures are upper estimates of what torch's caching allocator reserves. The planner only
adds up and searches: each part's bytes come from the code that allocates them, declared there
and handed over as the parts of kconvert.gpu.parts (a layer's decode: kconvert.calibrate.load;
input Grams: kconvert.calibrate.forward; eval's logits: kconvert.evaluate.metrics; REAP's
repair stream: kconvert.pruning.repair; the OBS batches: kconvert.methods.obs; the engine's
encode: kconvert.engine.execute), on the model's shapes (kconvert.gpu.shapes). What is left
below is the planner's own model of one decoder layer's forward and its search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kconvert.errors import KconvertError
from kconvert.gpu.parts import OBS_BATCH, Encode, Forward, GpuWork
from kconvert.gpu.shapes import Shapes

# Bytes per token of one decoder layer's forward, in units of the compute dtype's element,
# beyond the terms counted exactly: residual stream copies (input, norm, attention output,
# residual sum, MLP output, the batch's copy from the host).
RESIDUAL_COPIES = 6

# Attention scores per (sequence, head, query, key): SDPA's math path holds the scores, the
# masked scores and the probabilities in the compute dtype (the fused kernels hold far less;
# which one runs depends on the head sizes, the mask and the build, so the plan assumes the
# largest).
SCORE_BYTES = 6

# A routed expert's share of the tokens is planned at HOT_EXPERT times the mean (the Hessian
# of the busiest expert is built from its routed inputs in fp32).
HOT_EXPERT = 8

# Small tensors a run keeps (rope tables, statistics accumulators, router scores, cuBLAS
# workspaces).
OVERHEAD = 512 << 20


class GpuMemoryError(KconvertError):
    """A GPU command that does not fit its GPU memory budget, or ran out of GPU memory."""


def gib(n: int) -> str:
    """Bytes in GiB (MiB below 1 GiB), the units of torch's and nvidia-smi's figures."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


@dataclass
class Footprint:
    """Bytes by part: `resident` through a layer, plus the largest of the `phases`."""

    resident: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.resident.values()) + max(
            (sum(p.values()) for p in self.phases.values()), default=0)

    def lines(self) -> list[str]:
        out = [f"  {name}: {gib(n)}" for name, n in self.resident.items() if n]
        for phase, parts in self.phases.items():
            detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v)
            out.append(f"  while {phase}: {gib(sum(parts.values()))} ({detail})")
        return out


@dataclass(frozen=True)
class GpuPlan:
    """What a command may hold on the GPU: its micro-batch, where the hidden states live, the
    OBS batch, the engine's item size, and the footprint they add up to."""

    budget: int
    batch_size: int = 0
    hidden_on_device: bool = True
    obs_bytes: int = 0  # the OBS batches' share (kconvert.methods's batch sizing reads it)
    obs_matrices: int = 0  # matrices of the largest shape per OBS batch
    work_elems: int | None = None
    footprint: Footprint = field(default_factory=Footprint)
    share: str = ""  # under torchrun: what each rank holds (Forward.share_line)

    @property
    def prefetch_bytes(self) -> int:
        """What the layer prefetcher may put on the device ahead of the loop
        (kconvert.calibrate.prefetch): the budget the plan leaves."""
        return max(0, self.budget - self.footprint.peak)

    def lines(self, what: str) -> list[str]:
        head = (f"GPU memory for {what}: {gib(self.footprint.peak)} planned of a "
                f"{gib(self.budget)} budget")
        knobs = []
        if self.batch_size:
            knobs.append(f"forward micro-batch {self.batch_size} sequence(s), hidden states "
                         f"{'on the GPU' if self.hidden_on_device else 'in host memory'}")
        if self.obs_matrices:
            knobs.append(f"{self.obs_matrices} expert matrices per OBS batch")
        if self.work_elems:
            knobs.append(f"work items of up to {self.work_elems / 1e6:.1f}M elements")
        return [head + (f" ({'; '.join(knobs)})" if knobs else ""),
                *([self.share] if self.share else []), *self.footprint.lines()]


def _activations(s: Shapes, fw: Forward, batch: int) -> int:
    """One micro-batch of `batch` sequences through one decoder layer (the largest kind)."""
    t, d = batch * fw.seq_len, fw.dtype_bytes
    per_token = (RESIDUAL_COPIES * s.hidden * d
                 + 2 * s.heads * (3 * s.qk + 2 * s.v_head + s.qk_nope) * d  # q, k, v + copies
                 + (s.q_lora + s.kv_lora + s.qk_rope) * d)
    if s.has_moe:
        per_token += (3 * 4 * s.experts  # router logits, scores, biased scores (fp32)
                      + s.top_k * (s.hidden * d + 4 * 8 + 4)  # gathered routed inputs, ids
                      + 4 * s.hidden  # routed output (fp32)
                      + 2 * 2 * s.moe_inter * max(s.shared, 1) * d  # shared expert
                      + (4 * s.moe_inter + s.hidden) * d)  # one expert's, worst case
    else:
        per_token += 3 * s.dense_inter * d
    if fw.models:  # eval: the local and accumulated outputs, their errors in fp32
        per_token += s.hidden * (2 * d + 3 * 4)
    if fw.ranks > 1 and s.has_moe:
        # the exchange (kconvert.calibrate.expert_ranks), per token of each rank's batch: its
        # row to every rank holding one of its experts and the rows received from the others,
        # and the expert outputs of its k slots back and of the others' slots out, with each
        # row's ids and weights
        rows = 2 * fw.ranks * fw.held_fraction(s) + 2 * s.top_k
        per_token += int(rows * s.hidden * d) + 2 * fw.ranks * (2 * s.top_k + 1) * 8
    scores = batch * s.heads * fw.seq_len * fw.seq_len * SCORE_BYTES
    return t * per_token + scores


def forward_footprint(s: Shapes, fw: Forward, batch: int, hidden_on_device: bool
                      ) -> Footprint:
    """The forward's footprint at micro-batch `batch` (kconvert.calibrate.forward's terms).

    The layer's weights stay resident (SparseGPT holds them through its OBS batches) except
    in eval, whose logits come after the last layer is freed."""
    d, tokens = fw.dtype_bytes, fw.tokens()
    weights = {"layer weights": s.layer_elems(fw.routed_held(s)) * d}
    sets = fw.models + 1 if fw.models else 1 + fw.rerun  # eval: + the source's next layer
    resident = {"overhead": OVERHEAD,
                "hidden states": tokens * s.hidden * d * sets if hidden_on_device else 0}
    if not fw.models:
        resident.update(weights)
    if fw.capture:
        # expert-parallel, a buffer for every token of the job: each token routed to one of
        # the rank's experts comes once (Forward.held_fraction of them)
        kept = fw.job_tokens() if fw.ranks > 1 else tokens
        # per (token, choice): its int64 expert id, and its slot and token in the rows sorted
        # by expert (MoEBlock.routed_rows)
        resident["captured layer inputs"] = kept * (s.hidden * d + s.top_k * 3 * 8)
    if fw.repair_bytes:
        resident["repair stream"] = fw.repair_bytes
    if fw.gram_bytes:
        resident["input Grams"] = fw.gram_bytes
    layer = weights if fw.models else {}
    phases = {"decoding a layer": {**layer, "decode": fw.decode_bytes},
              "running a micro-batch": {**layer, "activations": _activations(s, fw, batch)}}
    if fw.models:
        logits = 4 * 4 * min(fw.logit_elems, batch * fw.seq_len * s.vocab)
        phases["computing logits"] = {"lm_heads": fw.models * s.vocab * s.hidden * d,
                                      "logits": logits}
    return Footprint(resident, phases)


def _batches(asked: int) -> list[int]:
    """The micro-batches tried, largest first: asked, then halved down to 1."""
    out = [asked]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def plan_forward(s: Shapes, fw: Forward, budget: int, what: str) -> GpuPlan:
    """The largest micro-batch (hidden states on the GPU first) whose forward fits."""
    for batch in _batches(fw.batch_size):
        for on_device in (True, False):
            fp = forward_footprint(s, fw, batch, on_device)
            if fp.peak <= budget:
                return GpuPlan(budget, batch, on_device, footprint=fp, share=fw.share_line(s))
    least = forward_footprint(s, fw, 1, False)
    raise _too_small(what, least, budget, "--samples" if fw.capture else "")


def plan_conversion(s: Shapes, budget: int, what: str, min_item_elems: int,
                    work: GpuWork | None = None, *, encode: Encode) -> GpuPlan:
    """A conversion's plan: the engine's work items (at most `encode.item_elems` decoded
    elements, at least `min_item_elems`, the largest fused set) and, for a stage that solves
    OBS batches on calibration inputs (`work`: GPTQ, SparseGPT), the forward beside the engine
    and the OBS batch.

    The OBS engine's calibration hands over one MoE layer at a time, weights loaded and
    inputs captured, and waits while the engine solves it: the forward's micro-batch, the OBS
    batch and the encode never run at once, but the layer's weights, captured inputs and
    hidden states stay resident through all three, and the engine holds its current item
    while the next layer runs forward."""
    if work is None:
        fit = ((budget - OVERHEAD - encode.chunk_elems * encode.chunk_bytes_per_elem)
               // encode.bytes_per_elem)
        elems = max(min(encode.item_elems, s.layer_elems(), fit), min_item_elems)
        fp = Footprint({"overhead": OVERHEAD},
                       {"encoding a work item": {"work item": encode.bytes(elems)}})
        if fp.peak > budget:
            raise _too_small(what, fp, budget, "")
        return GpuPlan(budget, work_elems=elems, footprint=fp)
    forward, obs = work.forward, work.obs
    per_expert_elems = s.expert_elems()
    hot = forward.job_tokens() if obs.every_token else min(
        forward.job_tokens(), HOT_EXPERT * forward.job_tokens() * s.top_k // max(s.experts, 1))

    def footprint(batch: int, on_device: bool, n: int) -> Footprint:
        fp = forward_footprint(s, forward, batch, on_device)
        item = max(n * per_expert_elems, min_item_elems)
        held = item * (4 + 2)  # the item's fp32 decode and its source bytes
        fp.phases["decoding a layer"]["engine's current item"] = held
        fp.phases["running a micro-batch"]["engine's current item"] = held
        fp.phases["solving an OBS batch"] = {
            "OBS batch": obs.batch(n), "busiest expert's inputs": hot * obs.k * 6,
            "engine's item and result": held + 4 * item}
        fp.phases["encoding a work item"] = {"work item": encode.bytes(item)}
        return fp

    def most(batch: int, on_device: bool) -> int:
        """The most matrices per OBS batch that fit beside this forward (0: not one)."""
        if footprint(batch, on_device, 1).peak > budget:
            return 0
        lo, hi = 1, obs.per_batch
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if footprint(batch, on_device, mid).peak <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # largest micro-batch first, hidden states on the GPU before the host
    shapes = [(batch, on_device) for batch in _batches(forward.batch_size)
              for on_device in (True, False)]
    fits = {shape: most(*shape) for shape in shapes}
    # OBS_BATCH matrices at the largest micro-batch that leaves room for them, else the most
    # matrices at any micro-batch (the OBS batches, not the forward, take a small budget's time);
    # never more: a batch solves OBS_BATCH at a time
    batch, on_device = next((sh for sh in shapes if fits[sh] >= min(OBS_BATCH, obs.per_batch)),
                            max(shapes, key=lambda sh: fits[sh]))
    n = min(fits[(batch, on_device)], OBS_BATCH)
    if not n:
        raise _too_small(what, footprint(1, False, 1), budget, "--samples")
    return GpuPlan(budget, batch, on_device, obs_bytes=obs.batch(n),
                   obs_matrices=n, work_elems=max(n * per_expert_elems, min_item_elems),
                   footprint=footprint(batch, on_device, n), share=forward.share_line(s))


def plan_gpu(ckpt, stages: list, budget: int, what: str, largest_item: int | None = None, *,
             encode: Encode) -> GpuPlan:
    """The GPU memory plan of a conversion of `ckpt` by `stages` (handed to each stage) whose
    engine encodes as `encode` says; `largest_item`: the decoded elements of the largest work
    item once the items are built (a fused set larger than the plan's item size is an item of
    its own), else a routed expert's gate and up."""
    shapes = Shapes.from_config(ckpt.text_config)
    works = [w for s in stages if (w := s.gpu_work(shapes)) is not None]
    if len(works) > 1:
        raise KconvertError("a recipe may have one stage that runs a calibration forward "
                            "beside the conversion")
    plan = plan_conversion(shapes, budget, what, largest_item or shapes.expert_set(),
                           works[0] if works else None, encode=encode)
    for stage in stages:
        stage.use_gpu_plan(plan)
    return plan


def _too_small(what: str, least: Footprint, budget: int, lower: str) -> GpuMemoryError:
    """The refusal of a plan: what the least plan needs, its largest parts, what lowers it."""
    parts = {**least.resident, **max(least.phases.values(), key=lambda p: sum(p.values()),
                                     default={})}
    big = sorted(((n, k) for k, n in parts.items() if n), reverse=True)[:3]
    return GpuMemoryError(
        f"{what} needs at least {gib(least.peak)} of GPU memory ("
        + ", ".join(f"{k} {gib(n)}" for n, k in big)
        + f"), more than its {gib(budget)} budget; raise --gpu-memory"
        + (f", lower {lower}" if lower else "") + " or run on the CPU (--device cpu)")
