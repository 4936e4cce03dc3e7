"""eval.json (its pydantic model; the schema is manifests/eval.schema.json), the printed table
and the figure of per-layer errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import BaseModel, Field

from kconvert.evaluate.generation import GenerationReport
from kconvert.io.files import write_atomically, write_text

REPORT_FILE = "eval.json"


FIGURE_FILE = "eval.png"


class LayerError(BaseModel):
    rel_err: float = Field(description=(
        "Accumulated error: ||h_cand - h_src|| / ||h_src|| over every real position, h the "
        "hidden states after this decoder layer, each model running on its own stream"))
    rel_err_local: float = Field(description=(
        "Local error: the same ratio with the candidate's layer run on the source's input "
        "to this layer (what this layer alone adds)"))


class LogitMetrics(BaseModel):
    kl_mean: float = Field(description="KL(source || candidate) in nats, mean over real "
                                       "positions of the next-token distributions")
    kl_p99: float = Field(description="99th percentile of the per-position KL (linear "
                                      "interpolation, torch.quantile)")
    kl_high_entropy: float = Field(description=(
        "Mean KL over the 10% of real positions where the source's next-token entropy is "
        "highest (kconvert.evaluate.metrics.HIGH_ENTROPY_SHARE)"))
    top1_agreement: float = Field(description="Fraction of real positions where the two "
                                              "argmax tokens are equal")
    top5_overlap: float = Field(description="Mean over real positions of |top5(src) & "
                                            "top5(cand)| / 5")
    nll_source: float = Field(description="Source's mean next-token negative log-likelihood "
                                          "(nats/token) over positions with a real next token")
    nll_candidate: float = Field(description="The candidate's, over the same positions")
    ppl_source: float = Field(description="exp(nll_source)")
    ppl_candidate: float = Field(description="exp(nll_candidate)")


class ActivationBlocks(BaseModel):
    """A W4A4 NVFP4 candidate's quantized activation blocks on its own stream over the eval's
    real positions (kconvert.evaluate.activations.BlockClamps)."""

    blocks: int = Field(description="Blocks of 16 activations quantized (every W4A4 NVFP4 "
                                     "module's input, each routed expert's over its tokens)")
    clamped: int = Field(description="Blocks whose amax is above what the module's global "
                                     "input scale g can represent (448 x 6 / g): their FP8 "
                                     "block scale clamps to 448")
    clamped_share: float = Field(description="clamped / blocks")
    input_scale_policy: str | None = Field(description="The input-scale policy its config "
                                           "declares (kconvert.plugins.input_scales)")

    @classmethod
    def of(cls, blocks: int, clamped: int, policy: str | None) -> ActivationBlocks | None:
        """None for a candidate that quantizes no activation with a global scale."""
        if not blocks:
            return None
        return cls(blocks=blocks, clamped=clamped, clamped_share=clamped / blocks,
                   input_scale_policy=policy)


class CandidateResult(BaseModel):
    candidate: str = Field(description="The candidate as given on the command line")
    identity: dict = Field(description="Where it was read from (path, or Hub repo and "
                                       "revision)")
    n_routed_experts: int = Field(description="Routed experts per MoE layer of the candidate")
    logits: LogitMetrics
    layers: dict[str, LayerError] = Field(description="Decoder layer index -> errors")
    activation_blocks: ActivationBlocks | None = Field(default=None, description=(
        "W4A4 NVFP4: its activation blocks and the share that clamp (None: no activation "
        "quantized with a global input scale)"))


class EvalReport(BaseModel):
    producer: str
    source: str = Field(description="The source as given on the command line")
    source_identity: dict
    data: str | None = Field(description="The token data evaluated on")
    samples: int = Field(description="Sequences evaluated")
    seq_len: int
    tokens: int = Field(description="Real (non-padding) positions: where KL, top-1 and top-5 "
                                    "are measured")
    scored_tokens: int = Field(description="Positions with a real next token: where NLLs are "
                                           "measured")
    dtype: str
    device: str
    seconds: float
    layer_seconds: list[float] = Field(description="Wall seconds per decoder layer (the source "
                                                   "and every candidate)")
    timing: dict = Field(default_factory=dict, description="Per decoder layer of each model: "
                         "read, compute and overlap seconds (kconvert.calibrate.prefetch), and "
                         "the projection for the whole model")
    candidates: list[CandidateResult] = Field(description="One entry per candidate, in the "
                                                          "order given")
    generation: GenerationReport | None = Field(default=None, description=(
        "The degeneration probe (--generate): the source's and the candidate's continuations "
        "of held-out prompts compared (docs/eval-generation.md)"))


def save_report(report: EvalReport, out_dir: Path) -> None:
    """DIR/eval.json and DIR/eval.png, each written atomically."""
    write_text(out_dir / REPORT_FILE, report.model_dump_json(indent=1) + "\n")
    write_atomically(out_dir / FIGURE_FILE, lambda fh: draw_figure(report, fh))


def render_table(report: EvalReport) -> str:
    """One row per candidate: logits metrics and its worst layer by local error."""
    head = ("candidate", "KL mean", "KL p99", "KL hi-H", "top-1", "top-5", "NLL src", "NLL cand",
            "ppl cand", "final err", "worst local")
    clamping = any(c.activation_blocks is not None for c in report.candidates)
    if clamping:
        head = (*head, "clamped")
    rows = [head]
    for c in report.candidates:
        m = c.logits
        last = c.layers[str(len(c.layers) - 1)]
        worst = max(c.layers, key=lambda k: c.layers[k].rel_err_local)
        rows.append((c.candidate, f"{m.kl_mean:.4g}", f"{m.kl_p99:.4g}", f"{m.kl_high_entropy:.4g}",
                     f"{m.top1_agreement:.4f}", f"{m.top5_overlap:.4f}", f"{m.nll_source:.4f}",
                     f"{m.nll_candidate:.4f}", f"{m.ppl_candidate:.4g}", f"{last.rel_err:.4g}",
                     f"L{worst} {c.layers[worst].rel_err_local:.3g}")
                    + ((_share(c.activation_blocks),) if clamping else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                       for i, (v, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _share(blocks: ActivationBlocks | None) -> str:
    return "-" if blocks is None else f"{blocks.clamped_share:.3%}"


def draw_figure(report: EvalReport, fh) -> None:
    """Accumulated (left) and local (right) relative error per decoder layer, log scale, one
    line per candidate labelled with its mean KL."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    # Log scale shows errors that differ by orders of magnitude; an all-zero panel (a model
    # against itself) stays linear.
    log = [any(getattr(e, key) > 0 for c in report.candidates for e in c.layers.values())
           for key in ("rel_err", "rel_err_local")]
    for c in report.candidates:
        layers = sorted(int(k) for k in c.layers)
        label = f"{c.candidate} (KL {c.logits.kl_mean:.3g})"
        for ax, key, is_log in zip(axes, ("rel_err", "rel_err_local"), log, strict=True):
            ys = [getattr(c.layers[str(L)], key) for L in layers]
            ax.plot(layers, [math.nan if is_log and y <= 0 else y for y in ys], marker=".",
                    label=label)
    titles = ("accumulated: ||h_cand - h_src|| / ||h_src|| after layer L",
              "local: candidate layer L on the source's input")
    for ax, title, is_log in zip(axes, titles, log, strict=True):
        ax.set_yscale("log" if is_log else "linear")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("decoder layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
        ax.set_ylabel("relative L2 error")
        ax.grid(True, which="both", alpha=0.3)
    if any(is_log for is_log in log):
        fig.text(0.5, 0.01, "a layer whose error is exactly 0 (e.g. a dense layer the "
                 "candidate did not change) has no point on a log scale", ha="center",
                 fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"kconvert eval: candidates against {report.source} "
                 f"({report.tokens} tokens, {report.dtype})", fontsize=11)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    print(json.dumps(EvalReport.model_json_schema(), indent=2, sort_keys=True))
