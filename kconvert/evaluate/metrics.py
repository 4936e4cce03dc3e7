"""What eval measures, accumulated batch by batch: hidden-state errors per layer and the
next-token distributions' agreement. Only per-position scalars are kept; logits live for one
chunk of positions at a time.

Every sum is kept per batch (the batch's index in the whole run) and folded in batch order when
the result is asked for, so that a run whose batches were spread over ranks (torchrun:
kconvert.common.distributed.own_batches) gives the same numbers as one process, bit for bit: `merge`
joins the ranks' parts, and the fold does the same additions in the same order. Counts are
integers; the per-position KL values are joined in batch order, so their mean and quantile are
those of one process too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from kconvert.evaluate.report import LayerError, LogitMetrics

# The share of positions, those where the source's next-token entropy is highest, that the
# high-entropy KL is taken over: token-level damage concentrates where the source is unsure
# (arXiv 2606.00206), and a mean over every position dilutes it.
HIGH_ENTROPY_SHARE = 0.1

# Logit elements (positions x vocabulary) of one chunk: 2^28 fp32 is 1 GiB on a GPU (the GPU
# memory plan's term, kconvert.gpu.parts.Forward.logit_elems).
LOGIT_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 24}


class LayerErrors:
    """Per decoder layer: sums of squares of (candidate - source) on the candidate's own
    stream and on the source's input, and of the source's output, over real positions; per
    batch, folded in batch order."""

    def __init__(self) -> None:
        # layer -> batch -> [3] float64, on the device until the result is asked for
        self.sums: dict[int, dict[int, torch.Tensor]] = {}

    def add(self, layer: int, batch: int, reference: torch.Tensor, own: torch.Tensor,
            local: torch.Tensor) -> None:
        """Rows [n, hidden] of real positions of batch `batch`: the source's output, the
        candidate's output on its own stream and on the source's input (summed on their
        device: no host sync)."""
        ref = reference.float()
        sums = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) ** 2
                            for t in (own.float() - ref, local.float() - ref, ref)])
        by_batch = self.sums.setdefault(layer, {})
        if batch in by_batch:
            by_batch[batch] += sums
        else:
            by_batch[batch] = sums

    def merge(self, others: Iterable[LayerErrors]) -> LayerErrors:
        """One LayerErrors of this one's batches and `others`' (other ranks' batches)."""
        out = LayerErrors()
        for part in (self, *others):
            for layer, by_batch in part.sums.items():
                out.sums.setdefault(layer, {}).update(
                    {b: t.cpu() for b, t in by_batch.items()})
        return out

    def result(self) -> dict[str, LayerError]:
        out = {}
        for layer, by_batch in sorted(self.sums.items()):
            own, local, ref = fold(by_batch[b] for b in sorted(by_batch)).tolist()
            ref = ref if ref > 0 else 1.0  # an all-zero source output: report absolute errors
            out[str(layer)] = LayerError(rel_err=math.sqrt(own / ref),
                                         rel_err_local=math.sqrt(local / ref))
        return out


def fold(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of `parts` added one after another, in the order given, in float64 on the CPU
    (float64 additions give the same bits on any device)."""
    total = None
    for t in parts:
        t = t.to("cpu", torch.float64)
        total = t.clone() if total is None else total.add_(t)
    if total is None:
        raise ValueError("nothing to fold")
    return total


class NextToken:
    """One model's next-token log-probabilities at a chunk of positions."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logp = torch.log_softmax(logits.float(), dim=-1)
        self.top5 = self.logp.topk(5, dim=-1).indices

    def entropy(self) -> torch.Tensor:
        """The entropy in nats of each position's next-token distribution."""
        return -(self.logp.exp() * self.logp).sum(-1, dtype=torch.float64)

    def nll_sum(self, targets: torch.Tensor, scored: torch.Tensor) -> float:
        """Sum of -log p(target) over the `scored` positions."""
        picked = self.logp[scored].gather(-1, targets[scored, None])
        return -float(picked.sum(dtype=torch.float64))


class LogitsComparison:
    """KL(source || candidate), on every position and on the source's highest-entropy ones,
    top-1 agreement, top-5 overlap and the candidate's NLL."""

    def __init__(self) -> None:
        # batch -> per chunk of its positions: the KL and the source's entropy per position
        # (float64 on the CPU) and the candidate's NLL sum
        self.kl: dict[int, list[torch.Tensor]] = {}
        self.entropy: dict[int, list[torch.Tensor]] = {}
        self.nll: dict[int, list[float]] = {}
        self.top1 = 0
        self.top5 = 0

    def add(self, batch: int, source: NextToken, candidate: NextToken, targets: torch.Tensor,
            scored: torch.Tensor) -> None:
        kl = torch.nn.functional.kl_div(candidate.logp, source.logp, reduction="none",
                                        log_target=True).sum(-1, dtype=torch.float64)
        self.kl.setdefault(batch, []).append(kl.cpu())
        self.entropy.setdefault(batch, []).append(source.entropy().cpu())
        self.top1 += int((source.logp.argmax(-1) == candidate.logp.argmax(-1)).sum())
        self.top5 += int((source.top5[:, :, None] == candidate.top5[:, None, :]).sum())
        self.nll.setdefault(batch, []).append(candidate.nll_sum(targets, scored))

    def merge(self, others: Iterable[LogitsComparison]) -> LogitsComparison:
        """One LogitsComparison of this one's batches and `others`' (other ranks' batches)."""
        out = LogitsComparison()
        for part in (self, *others):
            out.kl.update(part.kl)
            out.entropy.update(part.entropy)
            out.nll.update(part.nll)
            out.top1 += part.top1
            out.top5 += part.top5
        return out

    def result(self, nll_source: float, scored: int) -> LogitMetrics:
        kl = torch.cat([t for b in sorted(self.kl) for t in self.kl[b]])
        entropy = torch.cat([t for b in sorted(self.entropy) for t in self.entropy[b]])
        n = kl.numel()
        nll = in_batch_order(self.nll) / scored
        return LogitMetrics(kl_mean=float(kl.mean()), kl_p99=float(torch.quantile(kl, 0.99)),
                            kl_high_entropy=high_entropy_mean(kl, entropy),
                            top1_agreement=self.top1 / n, top5_overlap=self.top5 / (5 * n),
                            nll_source=nll_source, nll_candidate=nll,
                            ppl_source=math.exp(nll_source), ppl_candidate=math.exp(nll))


def high_entropy_mean(values: torch.Tensor, entropy: torch.Tensor,
                      share: float = HIGH_ENTROPY_SHARE) -> float:
    """The mean of `values` over the ceil(share x n) positions of highest `entropy` (ties taken
    in position order: a stable sort)."""
    k = max(1, math.ceil(share * entropy.numel()))
    top = torch.sort(entropy, descending=True, stable=True).indices[:k]
    return float(values[top].mean())


def in_batch_order(sums: dict[int, list[float]]) -> float:
    """Per-chunk sums (batch -> its chunks' sums) added one after another in batch order."""
    total = 0.0
    for b in sorted(sums):
        for value in sums[b]:
            total += value
    return total


def compare_logits(heads: list, hidden: list[torch.Tensor], batches: list[tuple[int, slice]],
                   valid: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor,
                   device: torch.device, vocab: int
                   ) -> tuple[list[LogitsComparison], dict[int, list[float]]]:
    """Each model's final norm + lm_head (`heads`, the source's first) over the real positions
    of its hidden states, a chunk of positions at a time: the comparisons of each candidate
    with the source and the source's NLL sums (per batch, per chunk)."""
    rows_per_chunk = max(1, LOGIT_ELEMS.get(device.type, LOGIT_ELEMS["cpu"]) // vocab)
    results = [LogitsComparison() for _ in heads[1:]]
    nll_source: dict[int, list[float]] = {}
    for b, rows in batches:
        v = valid[rows]
        states = [h[rows][v.to(h.device)] for h in hidden]
        t, sc = targets[rows][v].to(device), scored[rows][v].to(device)
        for start in range(0, t.shape[0], rows_per_chunk):
            chunk = slice(start, start + rows_per_chunk)
            ref = NextToken(heads[0](states[0][chunk].to(device)))
            nll_source.setdefault(b, []).append(ref.nll_sum(t[chunk], sc[chunk]))
            for head, h, result in zip(heads[1:], states[1:], results, strict=True):
                result.add(b, ref, NextToken(head(h[chunk].to(device))), t[chunk], sc[chunk])
    return results, nll_source
