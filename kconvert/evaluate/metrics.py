"""What eval measures, accumulated batch by batch: hidden-state errors per layer and the
next-token distributions' agreement. Only per-position scalars are kept; logits live for one
chunk of positions at a time."""

from __future__ import annotations

import math

import torch

from kconvert.evaluate.report import LayerError, LogitMetrics

# Logit elements (positions x vocabulary) of one chunk: 2^28 fp32 is 1 GiB on a GPU (the GPU
# memory plan's term, kconvert.gpu_plan.Forward.logit_elems).
LOGIT_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 24}


class LayerErrors:
    """Per decoder layer: sums of squares of (candidate - source) on the candidate's own
    stream and on the source's input, and of the source's output, over real positions."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}  # [3] float64, on the device

    def add(self, layer: int, reference: torch.Tensor, own: torch.Tensor, local: torch.Tensor
            ) -> None:
        """Rows [n, hidden] of real positions: the source's output, the candidate's output on
        its own stream and on the source's input (summed on their device: no host sync)."""
        ref = reference.float()
        sums = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) ** 2
                            for t in (own.float() - ref, local.float() - ref, ref)])
        if layer in self.sums:
            self.sums[layer] += sums
        else:
            self.sums[layer] = sums

    def result(self) -> dict[str, LayerError]:
        out = {}
        for layer, sums in sorted(self.sums.items()):
            own, local, ref = sums.tolist()
            ref = ref if ref > 0 else 1.0  # an all-zero source output: report absolute errors
            out[str(layer)] = LayerError(rel_err=math.sqrt(own / ref),
                                         rel_err_local=math.sqrt(local / ref))
        return out


class NextToken:
    """One model's next-token log-probabilities at a chunk of positions."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logp = torch.log_softmax(logits.float(), dim=-1)
        self.top5 = self.logp.topk(5, dim=-1).indices

    def nll_sum(self, targets: torch.Tensor, scored: torch.Tensor) -> float:
        """Sum of -log p(target) over the `scored` positions."""
        picked = self.logp[scored].gather(-1, targets[scored, None])
        return -float(picked.sum(dtype=torch.float64))


class LogitsComparison:
    """KL(source || candidate), top-1 agreement, top-5 overlap and the candidate's NLL."""

    def __init__(self) -> None:
        self.kl: list[torch.Tensor] = []  # per position, float64 on the CPU
        self.top1 = 0
        self.top5 = 0
        self.nll = 0.0

    def add(self, source: NextToken, candidate: NextToken, targets: torch.Tensor,
            scored: torch.Tensor) -> None:
        kl = torch.nn.functional.kl_div(candidate.logp, source.logp, reduction="none",
                                        log_target=True).sum(-1, dtype=torch.float64)
        self.kl.append(kl.cpu())
        self.top1 += int((source.logp.argmax(-1) == candidate.logp.argmax(-1)).sum())
        self.top5 += int((source.top5[:, :, None] == candidate.top5[:, None, :]).sum())
        self.nll += candidate.nll_sum(targets, scored)

    def result(self, nll_source: float, scored: int) -> LogitMetrics:
        kl = torch.cat(self.kl)
        n = kl.numel()
        nll = self.nll / scored
        return LogitMetrics(kl_mean=float(kl.mean()), kl_p99=float(torch.quantile(kl, 0.99)),
                            top1_agreement=self.top1 / n, top5_overlap=self.top5 / (5 * n),
                            nll_source=nll_source, nll_candidate=nll,
                            ppl_source=math.exp(nll_source), ppl_candidate=math.exp(nll))
