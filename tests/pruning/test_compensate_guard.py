"""REAP compensation's ridge choice and guard inside the calibration pass (RouterRepair, as
`reap --compensate down` runs it), on the trained tiny MoE with settings crafted so that the
re-fit overfits: half of 8 short sequences held out, and ridges down to 1e-9 (on a few fit
tokens the re-fit then interpolates them, and its held-out error explodes).

Oracles: the recorded errors of one run per single ridge, against which the ridge a run with
several records must be the argmin (in either order of the ridges); and the guard's own rule
written here: a re-fit that raises the held-out error is never written."""

from __future__ import annotations

from conftest import ROOT
from helpers import compensated_on_trained
from kconvert.pruning.repair import RepairSettings

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
KEEP = 12


def _compensated(ridges: tuple[float, ...]):
    """(the repair, its plan, its stage) of `reap --compensate down` with `ridges`."""
    return compensated_on_trained(RepairSettings("none", KEEP, "reap", compensate="down",
                                                 ridges=ridges, heldout=0.5), SRC)


def test_a_refit_that_raises_the_heldout_error_is_never_written():
    """Every layer's refusal is clear by far (held-out MSE, measured): 0.343 -> 16008,
    0.186 -> 17.5, 0.268 -> 39.5."""
    fixer, plan, stage = _compensated((1e-9,))
    assert set(fixer.compensations) == {1, 2, 3}
    for layer, rec in fixer.compensations.items():
        assert rec.heldout_mse_after > rec.heldout_mse_before, layer  # crafted to overfit
        assert rec.applied is False and rec.matrices_xxh3 == {}, layer
        assert plan.layers[str(layer)].compensation == rec
    # nothing re-fitted reaches the output: every down_proj is the source's, copied
    assert fixer.matrices == {} and stage.replaced == ()


def test_each_layer_records_the_ridge_with_the_lowest_heldout_error():
    """Both ridges overfit here, so every layer refuses and every run streams the same inputs
    through every layer: each single-ridge run's errors are those of the ridge in a run that
    tries both. Margins (held-out MSE, measured): ridge 0.1 refused by 27% or more (0.343 ->
    0.443, 0.186 -> 0.237, 0.268 -> 0.454), ridge 1e-9's errors 70 times 0.1's or more."""
    single = {r: _compensated((r,))[0].compensations for r in (1e-9, 0.1)}
    lowest = {layer: min(single, key=lambda r, layer=layer: single[r][layer].heldout_mse_after)
              for layer in single[0.1]}
    assert set(lowest.values()) == {0.1}  # the tiny ridge's interpolation is far worse
    for ridges in ((0.1, 1e-9), (1e-9, 0.1)):
        got = _compensated(ridges)[0].compensations
        assert {layer: rec.ridge for layer, rec in got.items()} == lowest, ridges
        for layer, rec in got.items():
            assert rec.heldout_mse_after == single[rec.ridge][layer].heldout_mse_after
