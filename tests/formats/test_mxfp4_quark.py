"""AMD Quark's MXFP4 layout against Quark itself (amd-quark, a test extra): its tensor
quantizer on edge values, and its file-to-file export of the INT4 fixture (the path AMD's
Kimi MXFP4 checkpoints come from) against `kconvert int4-to-mxfp4 --block-scale amax`:
the same tensors byte for byte and the same quantization_config."""

from __future__ import annotations

import json

import pytest
import quark.torch.kernel as quark_kernel  # the oracle, a test dependency: never skipped
import torch
from quark.torch.quantization.config.config import QConfig
from quark.torch.quantization.config.template import (
    MXFP4Scheme,
    MXFP4WeightOnlyScheme,
)
from quark.torch.quantization.file2file_quantization import (
    quantize_model_per_safetensor,
)
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark.torch.utils.numerics import to_e8m0_uint8
from quark.torch.utils.pack import create_pack_method

from conftest import BUNDLED
from helpers import assert_audit_passes, checkpoint_tensors
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.formats import mxfp4

# AMD's Kimi recipe as Quark's exclude patterns: everything but the routed experts and the
# routers (Quark's linear-weight rule takes `mlp.gate.weight` for a linear's).
AMD_EXCLUDE = ["lm_head", "*self_attn*", "*shared_experts*", "*mlp.gate_proj", "*mlp.up_proj",
               "*mlp.down_proj"]


def quark_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quark's MXFP4 bytes of w [M, K], through the calls its file-to-file export makes
    (observer, scaled_real_quantize, its FP4 packer, its E8M0 export)."""
    spec = MXFP4Scheme().config.weight
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    fq.enable_observer()
    fq.disable_fake_quant()
    fq(w)
    q = quark_kernel.scaled_real_quantize(spec.dtype.value, w, fq.scale, fq.zero_point,
                                          spec.ch_axis, spec.group_size, fq.quant_min,
                                          fq.quant_max, spec.round_method.value,
                                          spec.qscheme.value)
    packed = create_pack_method(qscheme=spec.qscheme.value, dtype=spec.dtype.value).pack(q, False)
    return packed, to_e8m0_uint8(fq.scale).reshape(w.shape[0], -1)


def test_amax_rule_is_quarks_bytes_on_edge_values():
    from test_mxfp4 import edge_rows

    g = torch.Generator().manual_seed(0)
    w = torch.cat([edge_rows(), torch.randn(56, 64, generator=g) * 0.05])
    # Row 3's amax ~2^-100 is normal; Quark stores a block below 2^-124 with a scale one
    # octave off the one it quantized with (docs/formats.md §6), so none is tested here.
    packed, scales = quark_tensor(w)
    q = mxfp4.quantize(w.unsqueeze(0), "amax", mxfp4.QUARK)
    assert torch.equal(q.scales[0], scales)
    assert torch.equal(q.packed[0], packed)


@pytest.mark.parametrize("scheme, activations, targets, exclude", [
    (MXFP4Scheme, "dynamic", "experts,routers", AMD_EXCLUDE),  # AMD's recipe
    (MXFP4WeightOnlyScheme, "none", "experts", [*AMD_EXCLUDE, "*mlp.gate"]),
])
def test_int4_to_mxfp4_is_quarks_file_to_file_export(tmp_path, scheme, activations, targets,
                                                     exclude):
    ref = tmp_path / "quark"
    quantize_model_per_safetensor(str(BUNDLED), QConfig(global_quant_config=scheme().config,
                                                        exclude=exclude), str(ref), device="cpu")
    out = tmp_path / "kconvert"
    convert(str(BUNDLED), str(out), load_recipe("int4-to-mxfp4"),
            {"block_scale": "amax", "activations": activations, "targets": targets},
            RunControl(device="cpu", quiet=True))
    a, b = checkpoint_tensors(out), checkpoint_tensors(ref)
    assert set(a) == set(b)
    experts = [n for n in a if ".mlp.experts." in n]
    assert len(experts) == 192
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert ours == theirs
    # Quark's own output passes kconvert's audit against the INT4 source: its routers, when
    # quantized, are checked row by row through their decode.
    assert_audit_passes(ref, "--source", BUNDLED)
