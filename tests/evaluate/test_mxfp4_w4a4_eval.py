"""`kconvert eval` runs an MXFP4 W4A4 candidate as it is served: the inputs of exactly the
modules its config declares W4A4 (Quark's `input_tensors`, compressed-tensors'
`input_activations`: dynamic, per 32, E8M0 scales) are MXFP4-quantized at run time.

The oracles: AMD Quark's own fake quantizer for MXFP4Scheme's `input_tensors` spec and
compressed-tensors' `forward_quantize` with its MXFP4 preset's `input_activations` (both on
CPU); the module sets against the configs Quark's own file-to-file export writes (W4A4 and
weight-only); the W4A4 candidates' MoE blocks against their W4A16 twins (same weight bytes)
whose routed-expert and router inputs go through the oracle.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationStatus, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from quark.torch.quantization.config.config import QConfig
from quark.torch.quantization.config.template import MXFP4Scheme, MXFP4WeightOnlyScheme
from quark.torch.quantization.file2file_quantization import quantize_model_per_safetensor
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

from conftest import BUNDLED, ROOT
from helpers import built_layer, eval_logits
from kconvert.calibrate.forward import model_config
from kconvert.calibrate.load import tensors_by_layer
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError
from kconvert.evaluate import activations
from kconvert.formats import Mxfp4Codec, QuarkMxfp4Codec, mxfp4
from kconvert.io.checkpoint import open_checkpoint
from kconvert.testing.tiny_moe import heldout_ids

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
QUIET = RunControl(device="cpu", quiet=True)
# AMD's Kimi recipe as Quark's exclude patterns (as tests/formats/test_mxfp4_quark.py).
AMD_EXCLUDE = ["lm_head", "*self_attn*", "*shared_experts*", "*mlp.gate_proj", "*mlp.up_proj",
               "*mlp.down_proj"]


def quark_qdq(x: torch.Tensor) -> torch.Tensor:
    """Quark's fake quantization of activations under MXFP4Scheme's input_tensors spec (its
    CPU path, which runs in fp32; for bf16 it calls a GPU-only kernel of the same rule)."""
    fq = FakeQuantizeBase.get_fake_quantize(MXFP4Scheme().config.input_tensors)
    return fq(x.float()).to(x.dtype)


def ct_qdq(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic quantization of a module's input under its MXFP4 (W4A4)
    preset, in x's dtype."""
    module = torch.nn.Linear(x.shape[-1], 1)
    module.quantization_status = QuantizationStatus.FROZEN
    args = preset_name_to_scheme("MXFP4", ["Linear"]).input_activations
    return forward_quantize(module, x, "input", args)


def activation_rows() -> torch.Tensor:
    """Every E2M1 tie point and its float neighbours on several block exponents, signed
    zeros, values that round to 0 or saturate, block amaxes on both sides of the 1.75
    round-up, a block of zeros, and activation-like rows with outliers."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    up, down = ties.nextafter(torch.tensor(9.0)), ties.nextafter(torch.tensor(0.0))
    block = torch.cat([ties, -ties, up, -down])  # amax 6.0...: step 1
    rows = [torch.cat([block * 2.0**e, block * 2.0**-e]) for e in (0, 3, 9)]
    rows.append(torch.cat([torch.tensor([-0.0, -0.1, 0.1, -0.24, 4.0, 6.99, -7.0, 1.0]),
                           torch.zeros(24), torch.linspace(-1.75, 1.75, 32)]))
    rows.append(torch.cat([torch.linspace(-1.7499, 1.7, 32), torch.zeros(32)]))
    g = torch.Generator().manual_seed(0)
    acts = torch.randn(27, 64, generator=g) * torch.rand(27, 1, generator=g) * 4
    acts[::5, 7] = 300.0  # an outlier channel
    return torch.cat([torch.stack(rows), acts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_is_quarks_and_compressed_tensors_dynamic_quantizer(dtype):
    x = activation_rows().to(dtype)
    got = mxfp4.fake_quantize(x)
    assert got.dtype == dtype
    assert torch.equal(got, quark_qdq(x))
    assert torch.equal(got, ct_qdq(x))
    three = x.reshape(4, 8, 64)  # [batch, tokens, features]: blocks along the last dim only
    assert torch.equal(mxfp4.fake_quantize(three), ct_qdq(three))
    assert not torch.equal(got, x)
    with pytest.raises(ValueError, match="32-element"):
        mxfp4.fake_quantize(torch.ones(2, 48))


def _layer_sets(ckpt_dir) -> dict[int, set[str]]:
    ckpt = open_checkpoint(str(ckpt_dir))
    try:
        layers = tensors_by_layer(ckpt, model_config(ckpt).num_hidden_layers)
        return {layer: activations.dynamic_inputs(ckpt, t) for layer, t in layers.items()}
    finally:
        ckpt.close()


def _quantized_modules(ckpt_dir) -> dict[int, set[str]]:
    """Per layer, the modules whose weights are stored MXFP4 (a `weight_scale` next to them)."""
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[int, set[str]] = {}
    for name in index:
        if name.endswith(".weight_scale"):
            module = name.rsplit(".", 1)[0]
            out.setdefault(int(module.split(".")[2]), set()).add(module)
    return out


@pytest.mark.parametrize("scheme", [MXFP4Scheme, MXFP4WeightOnlyScheme])
def test_the_modules_run_w4a4_are_those_quarks_own_export_declares(tmp_path, scheme):
    """Quark's file-to-file export of the INT4 fixture with AMD's recipe (routed experts and
    routers): under MXFP4Scheme every quantized module, routers included, runs W4A4; under
    the weight-only scheme none does."""
    ref = tmp_path / "quark"
    quantize_model_per_safetensor(str(BUNDLED), QConfig(global_quant_config=scheme().config,
                                                        exclude=AMD_EXCLUDE), str(ref),
                                  device="cpu")
    quantized = _quantized_modules(ref)
    assert any(m.endswith("mlp.gate") for mods in quantized.values() for m in mods)
    sets = _layer_sets(ref)
    for layer, declared in sets.items():
        want = quantized.get(layer, set()) if scheme is MXFP4Scheme else set()
        assert declared == want, layer


def test_a_declared_activation_form_it_cannot_run_is_an_error(tmp_path):
    ref = tmp_path / "quark"
    quantize_model_per_safetensor(str(BUNDLED), QConfig(global_quant_config=MXFP4Scheme().config,
                                                        exclude=AMD_EXCLUDE), str(ref),
                                  device="cpu")
    qconfig = json.loads((ref / "config.json").read_text())["quantization_config"]
    name = "model.layers.1.mlp.experts.0.up_proj"
    assert QuarkMxfp4Codec.declares_dynamic_input(qconfig, name)
    assert not QuarkMxfp4Codec.declares_dynamic_input(qconfig, "model.layers.1.self_attn.o_proj")
    static = copy.deepcopy(qconfig)
    static["global_quant_config"]["input_tensors"]["is_dynamic"] = False
    with pytest.raises(KconvertError, match="is_dynamic"):
        QuarkMxfp4Codec.declares_dynamic_input(static, name)
    # compressed-tensors: the MXFP4 preset's activations run; an 8-bit form does not.
    group = preset_name_to_scheme("MXFP4", ["Linear"]).model_dump(mode="json")
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}
    assert Mxfp4Codec.declares_dynamic_input(ct, name)
    group["input_activations"]["num_bits"] = 8
    with pytest.raises(KconvertError, match="num_bits"):
        Mxfp4Codec.declares_dynamic_input(ct, name)
    assert not Mxfp4Codec.declares_dynamic_input(
        {"config_groups": {"g": preset_name_to_scheme("MXFP4A16", ["Linear"]).model_dump(
            mode="json")}}, name)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The trained tiny MoE as MXFP4 W4A4 and W4A16 (same weight bytes) in both layouts;
    Quark's with AMD's targets (routed experts and routers)."""
    tmp = tmp_path_factory.mktemp("mx-w4a4")
    out = {}
    for fmt, targets in (("quark-mxfp4", "experts,routers"), ("mxfp4-pack-quantized", None)):
        for acts in ("dynamic", "none"):
            dst = tmp / f"{fmt}-{acts}"
            settings = {"format": fmt, "activations": acts, "block_scale": "amax"}
            convert(str(SRC), str(dst), load_recipe("quantize"),
                    {**settings, **({"targets": targets} if targets else {})}, QUIET)
            out[fmt, acts] = dst
    return out


@pytest.mark.parametrize("fmt,oracle", [("quark-mxfp4", quark_qdq),
                                        ("mxfp4-pack-quantized", ct_qdq)])
def test_declared_inputs_are_quantized_as_the_oracle_does(twins, fmt, oracle):
    layer = 2
    w4a4, w4a16 = twins[fmt, "dynamic"], twins[fmt, "none"]
    hidden = json.loads((w4a4 / "config.json").read_text())["hidden_size"]
    x = torch.randn(1, 40, hidden, generator=torch.Generator().manual_seed(1))

    def moe_output(ckpt_dir, oracle_inputs: bool | None):
        """The layer's MoE block on x: as `kconvert eval` builds it (None), with the routed
        experts' and router's inputs through the oracle (True), or unquantized (False)."""
        with built_layer(ckpt_dir, layer, torch.float32) as (ckpt, tensors, raw, loaded):
            dynamic = activations.dynamic_inputs(ckpt, tensors)
            if oracle_inputs is None:
                activations.emulate(loaded.module, loaded.moe, raw.prefix, {}, dynamic)
            else:
                assert not dynamic
                q = oracle if oracle_inputs else (lambda h: h)
                loaded.moe.quantize_input = lambda _which, h, _experts: q(h)
                if fmt == "quark-mxfp4":  # the routers are quantized, W4A4 like the experts
                    loaded.moe.gate.register_forward_pre_hook(lambda _m, args: (q(args[0]),))
            with torch.no_grad():
                return loaded.moe(x)

    got = moe_output(w4a4, None)
    assert torch.equal(got, moe_output(w4a16, True))
    assert (got - moe_output(w4a16, False)).abs().max() > 1e-3  # the quantization is visible


def test_w4a4_eval_differs_from_its_w4a16_twin(twins):
    ids = heldout_ids(2 * 64, seed=5, window=64).reshape(2, 64)
    w4a16, w4a4 = eval_logits(SRC, [twins["mxfp4-pack-quantized", "none"],
                                     twins["mxfp4-pack-quantized", "dynamic"]], ids)
    assert w4a4.kl_mean > w4a16.kl_mean > 0
