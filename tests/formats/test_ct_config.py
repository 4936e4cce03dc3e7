"""kconvert writes compressed-tensors' quantization_config without importing compressed-tensors
(kconvert.formats.ct_config.CT_PRESETS): the block must equal what the installed library's own
models dump, for every preset kconvert writes and every layout of its config groups."""

from __future__ import annotations

import json

import compressed_tensors
import pytest
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

from kconvert.formats import Mxfp4Codec, Nvfp4Codec
from kconvert.formats.ct_config import CT_PRESETS, CT_TARGETS, QUANT_METHOD, config_block
from kconvert.model.names import Role

EXPERTS, SHARED, ATTENTION = (CT_TARGETS[r][0] for r in
                              (Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.ATTENTION))
# The config groups by weight group size: NVFP4's 16, p48's 32 for sparse kernels (both in one
# output when only the routed experts are p48), MXFP4's 32.
LAYOUTS = [(Nvfp4Codec, {16: [EXPERTS]}), (Nvfp4Codec, {32: [EXPERTS]}),
           (Nvfp4Codec, {16: [SHARED, ATTENTION], 32: [EXPERTS]}),
           (Mxfp4Codec, {32: [SHARED, ATTENTION, EXPERTS]})]
IGNORES = [["lm_head"], ["lm_head", "re:vision_tower.*", "re:mm_projector.*"]]


def library_block(preset: str, fmt: str, targets_by_group: dict[int, list[str]],
                  ignore: list[str]) -> dict:
    """The block as compressed-tensors' models make it (kconvert's code before CT_PRESETS)."""
    groups = {}
    for i, (group_size, targets) in enumerate(targets_by_group.items()):
        scheme = preset_name_to_scheme(preset, targets)
        scheme.weights.group_size = group_size
        scheme.format = fmt
        groups[f"group_{i}"] = scheme
    qc = QuantizationConfig(config_groups=groups, format=fmt, quantization_status="compressed",
                            ignore=ignore)
    return {"version": compressed_tensors.__version__, "quant_method": QUANT_METHOD,
            **qc.model_dump(mode="json", exclude={"quant_method"})}


def test_presets_are_those_kconvert_writes():
    written = {p for codec, _ in LAYOUTS for p in codec.ct_presets}
    assert set(CT_PRESETS) == written


@pytest.mark.parametrize(("codec", "layout"), LAYOUTS,
                         ids=["nvfp4-16", "nvfp4-32", "nvfp4-16+32", "mxfp4-32"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("ignore", IGNORES, ids=["text", "vision"])
def test_block_equals_the_library_dump(codec, w4a4, layout, ignore):
    preset = codec.ct_presets[w4a4]
    ours = config_block(preset, codec.ct_format, layout, ignore)
    theirs = library_block(preset, codec.ct_format, layout, ignore)
    # as finish_output writes config.json: sorted keys, so key order is not compared
    assert json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True)
