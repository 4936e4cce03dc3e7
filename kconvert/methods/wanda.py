"""Paired-4:8 by Wanda's score (p48.md, "Mask selection" 2): |W_ij| * ||X_j||_2, the input
column norms from `kconvert calibrate`'s statistics (`input_sq_sum`)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch

from kconvert.calibrate.stats import META_FILE, STATS_FILE, stats_key
from kconvert.errors import KconvertError
from kconvert.formats.linear import ModuleWork
from kconvert.io.files import hash_file
from kconvert.methods.magnitude import Magnitude
from kconvert.plugins.methods import WANDA


class WandaNorms:
    """||X_j||_2 per input column of each routed linear, read lazily from calibrate's
    `stats.safetensors` (`<key>.input_sq_sum`), so a 61-layer model's statistics never sit
    in memory at once."""

    def __init__(self, stats_dir: str):
        from safetensors import safe_open

        path = Path(stats_dir)
        if not (path / META_FILE).is_file():
            raise KconvertError("not a `kconvert calibrate` output (no stats.json)",
                                file=str(path))
        self._file = safe_open(str(path / STATS_FILE), framework="pt")
        self._names = set(self._file.keys())
        self.where = str(path / STATS_FILE)

    def column_norms(self, m: ModuleWork) -> torch.Tensor:
        name = f"{stats_key(m.module)}.input_sq_sum"
        if name not in self._names:
            raise KconvertError("the statistics have no input column norms for this module",
                                file=self.where, tensor=m.module)
        return self._file.get_tensor(name).float().sqrt()


class Wanda(Magnitude):
    declaration = WANDA

    @cached_property
    def norms(self) -> WandaNorms:
        return WandaNorms(self.inputs.stats)

    def column_weights(self, modules, device):
        return torch.stack([self.norms.column_norms(m) for m in modules]).to(device)

    def record(self) -> dict[str, object]:
        return {"method": self.name, "stats": hash_file(Path(self.inputs.stats) / STATS_FILE)}
