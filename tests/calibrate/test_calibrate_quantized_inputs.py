"""Layer-streamed calibration of quantized inputs: the INT4 and K2.5 fixtures against a
dense reference, and the act_stats.json that W4A4 quantization consumes.

References are independent of kconvert/calibrate.py: hidden states come from a whole-model
transformers DeepseekV3ForCausalLM forward; router decisions from that model's own
DeepseekV3TopkRouter (captured by a forward hook); expert outputs and activation statistics
from a per-token, per-expert loop over weights read straight from the safetensors files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from calibrate_support import BATCH, load_reference, reference_run, streamed, token_ids
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from safetensors.torch import save_file

from conftest import BUNDLED
from helpers import checkpoint_tensors
from kconvert.calibrate.run import measure_stats as calibrate
from kconvert.calibrate.stats import save_stats
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.io.checkpoint import open_checkpoint
from kconvert.testing.fixture_weights import ct_int4_scheme

# ------------------------------------------------------------------- 4. quantized inputs

def _int4_dense_dir(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """A dense fp32 copy of an INT4 fixture, decoded by compressed-tensors (exact q*scale)."""
    scheme, dense, packed = ct_int4_scheme(), {}, {}
    for name, t in checkpoint_tensors(src).items():
        module, _, param = name.rpartition(".")
        if param in ("weight_packed", "weight_scale", "weight_shape"):
            packed.setdefault(module, {})[param] = t
        else:
            dense[name] = t.float() if t.is_floating_point() else t
    for module, sd in packed.items():
        sd = {**sd, "weight_scale": sd["weight_scale"].float()}
        dense[f"{module}.weight"] = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    dst.mkdir()
    save_file(dense, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dense


def test_int4_and_k25_fixtures(fixture_dir, tmp_path):
    ids = token_ids(pad=False)
    k2 = fixture_dir("k2-int4-kimi")
    stats, outs = streamed(k2, ids)
    model = load_reference(tmp_path / "dense", _int4_dense_dir(k2, tmp_path / "dense"))
    ref, _ = reference_run(model, ids)
    for layer, (got, want) in enumerate(zip(outs, ref, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"layer {layer}")

    # K2.5: the same language model under language_model.model.*, next to a vision tower.
    k25_stats, k25_outs = streamed(fixture_dir("k25-int4"), ids)
    for got, want in zip(k25_outs, outs, strict=True):
        assert torch.equal(got, want)
    assert set(k25_stats.tensors) == set(stats.tensors)
    assert all(torch.equal(k25_stats.tensors[k], v) for k, v in stats.tensors.items())
    assert k25_stats.modules == {k: "language_model." + v for k, v in stats.modules.items()}
    assert all(m.startswith("language_model.model.layers.")
               for m in k25_stats.act_stats()["input_amax"])


def test_act_stats_feed_w4a4_quantize(tmp_path):
    """calibrate's act_stats.json is what `int4-to-nvfp4 --act-stats` consumes."""
    ckpt = open_checkpoint(str(BUNDLED))
    try:
        stats = calibrate(ckpt, token_ids(pad=True), "cpu", BATCH, dtype=torch.float32)
    finally:
        ckpt.close()
    save_stats(stats, tmp_path / "stats")
    convert(str(BUNDLED), str(tmp_path / "out"), load_recipe("int4-to-nvfp4"),
            {"act_stats": str(tmp_path / "stats" / "act_stats.json"), "block_scale": "amax",
             "input_scale": "expert"}, RunControl(quiet=True))
    out = checkpoint_tensors(tmp_path / "out")
    amax = stats.act_stats()["input_amax"]
    base = "model.layers.2.mlp.experts.5"
    want = max(amax[f"{base}.gate_proj"], amax[f"{base}.up_proj"])
    assert float(out[f"{base}.up_proj.input_global_scale"]) == pytest.approx(2688.0 / want)
