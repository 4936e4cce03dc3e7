"""The distribution of a linear's per-block input amax, as ModelOpt's `nvfp4_act_headroom`
calibration keeps it (docs/input-scales.md, "headroom"): the amax of every block of 16
consecutive input features of every row the linear sees, counted in a histogram of log2(amax)
with BINS equal bins over [LOG2_MIN, LOG2_MAX) (blocks whose amax is 0 are not counted; a
value outside the range falls in the first or last bin). Counts add over batches and ranks
exactly, so a histogram is the same however the calibration was split.

The two percentiles the headroom rule reads follow ModelOpt's `NVFP4ActHeadroomCalibrator.
_percentile` (modelopt/torch/quantization/calib/nvfp4_act_headroom.py): the first bin whose
cumulative count reaches p% of the total, read at its centre; the low one (`anchor`, p1)
leaves out the bins below the one holding upper / ANCHOR_FLOOR_RATIO, so a tail of near-zero
blocks cannot pull it down.
"""

from __future__ import annotations

import math

import torch

from kconvert.formats.nvfp4_grid import BLOCK

# The statistics key of a linear's histogram: `<key>.block_amax_hist` ([BINS] int64).
BLOCK_AMAX_STAT = "block_amax_hist"
BINS, LOG2_MIN, LOG2_MAX = 512, -40.0, 40.0  # ModelOpt's defaults: 0.156 octave per bin
ANCHOR_PERCENTILE, UPPER_PERCENTILE = 1.0, 99.99
ANCHOR_FLOOR_RATIO = 1e6


def new_histogram(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Empty counts [*shape, BINS] (int64)."""
    return torch.zeros(*shape, BINS, dtype=torch.int64, device=device)


def bin_index(log2_amax: torch.Tensor) -> torch.Tensor:
    """The bin of each log2(amax) (long), the ends clamped into the first and last bins."""
    frac = (log2_amax - LOG2_MIN) / (LOG2_MAX - LOG2_MIN)
    return (frac * BINS).floor().long().clamp_(0, BINS - 1)


def block_amax(rows: torch.Tensor) -> torch.Tensor:
    """[rows, K] -> the fp32 amax of each block of BLOCK features [rows, ceil(K / BLOCK)]; a
    ragged last block is padded with zeros, which change no amax (as ModelOpt pads it)."""
    pad = -rows.shape[-1] % BLOCK
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    # one reduction, no rows-sized |x| temporary
    return torch.linalg.vector_norm(rows.reshape(rows.shape[0], -1, BLOCK), ord=math.inf,
                                    dim=-1, dtype=torch.float32)


def add_rows(rows: torch.Tensor, hist: torch.Tensor) -> None:
    """hist [BINS] += the block amaxes of rows [n, K]."""
    _count(block_amax(rows), torch.zeros((), dtype=torch.long, device=rows.device), hist)


def add_grouped_rows(rows: torch.Tensor, lengths: torch.Tensor, hist: torch.Tensor) -> None:
    """hist [G, BINS] += for each group g its rows' block amaxes; `rows` [n, K] are the groups'
    rows one group after the other, lengths[g] of them."""
    which = torch.repeat_interleave(torch.arange(hist.shape[0], device=rows.device), lengths,
                                    output_size=rows.shape[0])
    _count(block_amax(rows), which[:, None], hist)


def _count(amax: torch.Tensor, group: torch.Tensor, hist: torch.Tensor) -> None:
    """hist[group] += the blocks of amax [n, blocks] (group: [n, 1] or a scalar); blocks of
    amax 0 add 0 (weights, not a mask: no host sync on a GPU)."""
    counted = amax > 0
    bins = bin_index(torch.where(counted, amax, 1.0).log2())
    hist.view(-1).index_add_(0, (group * BINS + bins).flatten(), counted.long().flatten())


def percentile(hist: torch.Tensor, p: float, floor: float | None = None) -> float | None:
    """The block amax at percentile p of a histogram [BINS], leaving out the bins below the
    one that holds `floor`; None when nothing is counted (module docstring)."""
    counts = hist.double().clone()
    if floor is not None and floor > 0:
        counts[:int(bin_index(torch.tensor(math.log2(floor))))] = 0
    total = float(counts.sum())
    if total <= 0:
        return None
    found = int(torch.searchsorted(counts.cumsum(0), torch.tensor(p / 100.0 * total,
                                                                  dtype=torch.float64)))
    found = min(found, BINS - 1)
    return 2.0 ** (LOG2_MIN + (found + 0.5) / BINS * (LOG2_MAX - LOG2_MIN))


def quantiles(hist: torch.Tensor) -> tuple[float, float] | None:
    """(anchor p1, upper p99.99) of a histogram [BINS], None when nothing is counted."""
    upper = percentile(hist, UPPER_PERCENTILE)
    if upper is None:
        return None
    anchor = percentile(hist, ANCHOR_PERCENTILE, upper / ANCHOR_FLOOR_RATIO)
    return (anchor, upper) if anchor is not None else None
