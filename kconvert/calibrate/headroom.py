"""`--input-scale headroom`: ModelOpt's NVFP4 activation global-scale rule
(`nvfp4_act_headroom`; NVIDIA/Model-Optimizer, modelopt/torch/quantization/calib/
nvfp4_act_headroom.py, `NVFP4ActHeadroomCalibrator.compute_amax`, with the defaults of
`NVFP4ActHeadroomCalibConfig` in modelopt/torch/quantization/config.py):

    amax = max(RHO x p1, p99.99)

of the module's per-block input amax distribution (kconvert.calibrate.block_amax: p1 is the
anchor, p99.99 the top of the calibrated range). Plain max calibration puts the largest
calibrated block at the top of FP8's block-scale range, so a larger activation clamps; with
RHO = 16384 the p1 block's FP8 scale is 448 / 16384 = 2^-5.2, just above FP8's smallest normal
2^-6, and the calibrated blocks sit in the lower part of the range with up to 16384 x p1 /
p99.99 of room above them. Where the calibrated range is too wide for that (RHO x p1 <=
p99.99), the rule is the p99.99 itself, as ModelOpt falls back to it (with a warning there).
"""

from __future__ import annotations

from kconvert.calibrate.input_scales import InputScalePolicy
from kconvert.calibrate.stats import ACT_BLOCK_P1, ACT_BLOCK_P9999, ActStats
from kconvert.errors import KconvertError
from kconvert.plugins.input_scales import HEADROOM

RHO = 16384.0  # ModelOpt's default headroom factor; below FP8's normal range 448 / 2^-6


def headroom_amax(p1: float, p9999: float) -> float:
    """The rule: max(RHO x p1, p99.99)."""
    return max(RHO * p1, p9999)


class Headroom(InputScalePolicy):
    """Each module's headroom amax; a routed expert whose inputs had no non-zero block (never
    routed) takes its group's largest, as the other per-expert policies fill it."""

    declaration = HEADROOM

    def own_amax(self, act: ActStats) -> dict[str, float]:
        if not act.block_amax_p1:
            raise KconvertError("--input-scale headroom reads each module's per-block amax "
                                f"percentiles ({ACT_BLOCK_P1}, {ACT_BLOCK_P9999}), which these "
                                "statistics (an older kconvert calibrate's) do not have: "
                                "calibrate again", file=act.path)
        return {m: headroom_amax(act.block_amax_p1[m], act.block_amax_p9999[m])
                if m in act.block_amax_p1 else 0.0 for m in act.input_amax}
