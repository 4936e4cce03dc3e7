"""W4A4: calibrated activation amax -> input scales, shared by a fused set, config says NVFP4."""

from __future__ import annotations

import json

import torch
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.utils import generate_gparam

from conftest import BUNDLED
from helpers import checkpoint_tensors
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe


def test_input_scales_from_activation_stats(tmp_path):
    g = torch.Generator().manual_seed(1)
    amax = {}
    for layer in (1, 2):
        for e in range(16):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                amax[f"model.layers.{layer}.mlp.experts.{e}.{proj}"] = float(
                    torch.rand((), generator=g) * 10 + 0.5)
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"input_amax": amax}))
    for fmt in ("compressed-tensors", "modelopt"):
        dst = tmp_path / fmt
        convert(str(BUNDLED), str(dst), load_recipe("int4-to-nvfp4"),
                {"act_stats": str(stats), "format": fmt, "input_scale": "expert"},
                RunControl(quiet=True))
        t = checkpoint_tensors(dst)
        for layer in (1, 2):
            for e in range(16):
                base = f"model.layers.{layer}.mlp.experts.{e}"
                shared = max(amax[f"{base}.gate_proj"], amax[f"{base}.up_proj"])
                for proj, want in (("gate_proj", shared), ("up_proj", shared),
                                   ("down_proj", amax[f"{base}.down_proj"])):
                    want32 = torch.tensor([want], dtype=torch.float32)
                    if fmt == "compressed-tensors":
                        got = t[f"{base}.{proj}.input_global_scale"]
                        assert torch.equal(got, generate_gparam(-want32, want32))
                    else:
                        got = t[f"{base}.{proj}.input_scale"]
                        assert got.shape == ()
                        assert torch.equal(got, want32[0] / 2688.0)
    modelopt = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    assert modelopt["quantization"]["quant_algo"] == "NVFP4"  # W4A4 in ModelOpt's naming
    qc = json.loads((tmp_path / "compressed-tensors" / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(qc["quantization_config"])
    acts = parsed.config_groups["group_0"].input_activations
    assert acts is not None and acts.num_bits == 4 and acts.group_size == 16
