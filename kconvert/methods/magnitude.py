"""Paired-4:8 by magnitude (p48.md, "Mask selection" 1): in every chunk of 8 inputs keep the 2
pairs with the largest |w_2p| + |w_2p+1|."""

from __future__ import annotations

import torch

from kconvert.formats import p48
from kconvert.formats.linear import Transformed
from kconvert.methods.base import Method
from kconvert.plugins.methods import MAGNITUDE


class Magnitude(Method):
    declaration = MAGNITUDE

    def transforms(self, m) -> bool:
        return True

    def column_weights(self, modules, device: torch.device) -> torch.Tensor | None:
        """Per input column, what multiplies |W_ij| in a pair's score (None: nothing)."""
        return None

    def transform_batch(self, batch) -> Transformed:
        w = batch.weights
        keep = p48.top2_pairs(p48.pair_scores(w, self.column_weights(batch.modules, w.device)))
        return Transformed(p48.apply_pair_mask(w, keep))
