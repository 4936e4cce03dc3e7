"""`kconvert eval` runs a W4A4 candidate as it is served: the activations entering every module
with a stored input scale are NVFP4-quantized (16-element blocks, FP8 block scales from the
stored global input scale, E2M1 values), as vLLM's reference emulation of its kernels does.

The quantize-dequantize is written here from that description (tests/nvfp4_reference.py for
the FP8 and E2M1 grids); the W4A4 candidates' MoE layers are compared with their W4A16 twins
(same weight bytes) whose routed-expert inputs go through the quantize-dequantize written here
with the scales read here from the files; attention's linears likewise, on a candidate
quantized with the statistics `kconvert calibrate` measures (which store attention's input
scales too); and the eval of a W4A4 candidate differs from its W4A16 twin's.
"""

from __future__ import annotations

import json

import pytest
import torch
from nvfp4_reference import fp8_value, round_e2m1
from safetensors import safe_open

from conftest import ROOT
from helpers import built_layer, cli_inproc, eval_logits
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.evaluate import activations
from kconvert.testing.tiny_moe import heldout_ids

SRC = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


def qdq(x: torch.Tensor, g: float) -> torch.Tensor:
    """NVFP4 activation quantize-dequantize with global scale g, written from the kernels'
    description: per 16 elements s = fp8(g * (amax * fp32(1/6))) (at most 448); elements
    x * (1 / (s * (1 / g))) clamped to +-6, rounded to E2M1 (ties to even); value * s / g."""
    g32 = torch.tensor(g, dtype=torch.float32)
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (g32 * (amax * torch.tensor(1 / 6, dtype=torch.float32))).clamp(max=448.0)
    code = d.to(torch.float8_e4m3fn).view(torch.uint8).long()
    s = fp8_value(code)
    inv = torch.where(s == 0, 0.0, 1 / (s * (1 / g32)))
    y = (blocks * inv).clamp(-6.0, 6.0)
    q = torch.where(y < 0, -1.0, 1.0) * round_e2m1(y.abs())
    return (q * (s / g32)).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_is_the_written_out_quantize_dequantize(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 9, 64, generator=g) * torch.rand(7, 9, 1, generator=g) * 5
    x[0, 0, :16] = 0.0  # a block of zeros
    x[0, 1, :16] = 1e-9  # a block below FP8's smallest scale
    x[1, 0, :16] = 100.0  # a block clipped at the largest scale
    x = x.to(dtype)
    for amax in (3.0, 0.7, 40.0):
        gs = 2688.0 / amax
        got = activations.fake_quantize(x, torch.tensor(gs))
        assert got.dtype == dtype
        assert torch.equal(got, qdq(x, gs)), amax
    # ModelOpt stores amax / 2688 and the kernels quantize with its reciprocal
    stored = torch.tensor(3.0 / 2688.0)
    assert float(activations.global_input_scale(stored, "input_scale")) == pytest.approx(
        2688.0 / 3.0, rel=1e-6)
    assert float(activations.global_input_scale(torch.tensor(5.0), "input_global_scale")) == 5.0
    with pytest.raises(ValueError, match="16-element"):
        activations.fake_quantize(torch.ones(2, 24), torch.tensor(1.0))


def _stats(path, layers: range, experts: int) -> None:
    """Activation amaxes (as `kconvert calibrate` writes them) for every routed expert."""
    g = torch.Generator().manual_seed(4)
    amax = {f"model.layers.{layer}.mlp.experts.{e}.{proj}": float(torch.rand((), generator=g)
                                                                    * 4 + 0.5)
            for layer in layers for e in range(experts)
            for proj in ("gate_proj", "up_proj", "down_proj")}
    path.write_text(json.dumps({"input_amax": amax}))


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w4a4")
    cfg = json.loads((SRC / "config.json").read_text())
    stats = tmp / "act_stats.json"
    _stats(stats, range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]),
           cfg["n_routed_experts"])
    out = {}
    for fmt in ("compressed-tensors", "modelopt"):
        for name, extra in (("w4a16", {}), ("w4a4", {"act_stats": str(stats)})):
            dst = tmp / f"{fmt}-{name}"
            convert(str(SRC), str(dst), load_recipe("quantize"), {"format": fmt, **extra},
                    RunControl(quiet=True))
            out[fmt, name] = dst
    return out


def _read(ckpt_dir, name: str) -> torch.Tensor:
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(ckpt_dir / index[name]), "pt") as fh:
        return fh.get_tensor(name)


@pytest.mark.parametrize("fmt,param", [("compressed-tensors", "input_global_scale"),
                                       ("modelopt", "input_scale")])
def test_routed_experts_see_their_inputs_quantized_with_the_stored_scales(twins, fmt, param):
    layer = 2
    w4a4, w4a16 = twins[fmt, "w4a4"], twins[fmt, "w4a16"]
    hidden = json.loads((w4a4 / "config.json").read_text())["hidden_size"]
    x = torch.randn(1, 40, hidden, generator=torch.Generator().manual_seed(1))

    def moe_output(ckpt_dir, quantize_input=None):
        with built_layer(ckpt_dir, layer, torch.float32) as (ckpt, tensors, raw, loaded):
            scales = activations.input_scales(ckpt, tensors)
            if quantize_input is None:
                activations.emulate(loaded.module, loaded.moe, raw.prefix, scales)
            else:
                assert not scales
                loaded.moe.quantize_input = quantize_input
            with torch.no_grad():
                return loaded.moe(x)

    def written_here(which: int, h: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        proj = "down_proj" if which else "gate_proj"
        out = torch.empty_like(h)
        for row, expert in enumerate(experts.tolist()):
            stored = float(_read(w4a4, f"model.layers.{layer}.mlp.experts.{expert}.{proj}."
                                       f"{param}"))
            out[row] = qdq(h[row], 1 / stored if param == "input_scale" else stored)
        return out

    got = moe_output(w4a4)
    want = moe_output(w4a16, written_here)
    plain = moe_output(w4a16, lambda _w, h, _e: h)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - plain).abs().max() > 1e-3  # the activation quantization is visible


def test_w4a4_eval_differs_from_its_w4a16_twin(twins):
    ids = heldout_ids(2 * 64, seed=5, window=64).reshape(2, 64)
    w4a16, w4a4 = eval_logits(SRC, [twins["compressed-tensors", "w4a16"],
                                     twins["compressed-tensors", "w4a4"]], ids)
    assert w4a4.kl_mean > w4a16.kl_mean > 0


ATTENTION = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")


@pytest.fixture(scope="module")
def attention_twins(tmp_path_factory):
    """W4A4 and W4A16 twins quantized on experts and attention, with the input statistics
    `kconvert calibrate` measures (its act_stats.json: every linear, attention included)."""
    tmp = tmp_path_factory.mktemp("w4a4-attention")
    ids = heldout_ids(4 * 32, seed=3, window=32).reshape(4, 32)
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in ids))
    stats = tmp / "stats"
    res = cli_inproc("calibrate", SRC, "--data", data, "-o", stats, "--samples", 4, "--seq-len",
                     32, "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    out = {}
    for name, extra in (("w4a16", []), ("w4a4", ["--act-stats", stats / "act_stats.json"])):
        out[name] = tmp / name
        res = cli_inproc("quantize", SRC, out[name], "--targets", "experts,attention",
                         "--device", "cpu", "--quiet", *extra)
        assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("layer", [0, 2])  # a dense layer's attention, an MoE layer's
def test_attention_sees_its_inputs_quantized_with_its_stored_scales(attention_twins, layer):
    """Each attention linear of the W4A4 output as eval builds it (evaluate.activations) equals
    its W4A16 twin (same weight bytes) on inputs quantized here with the scale read here from
    the files; and differs from the twin on plain inputs."""
    w4a4, w4a16 = attention_twins["w4a4"], attention_twins["w4a16"]
    g = torch.Generator().manual_seed(layer)
    prefix = f"model.layers.{layer}.self_attn."
    with built_layer(w4a4, layer, torch.float32) as (ckpt, tensors, raw, a4), \
            built_layer(w4a16, layer, torch.float32) as (_, _, _, a16):
        scales = activations.input_scales(ckpt, tensors)
        assert {prefix + n for n in ATTENTION} <= set(scales)
        activations.emulate(a4.module, a4.moe, raw.prefix, scales)
        for name in ATTENTION:
            stored = float(_read(w4a4, f"{prefix}{name}.input_global_scale"))
            quantized, plain = a4.module.self_attn.get_submodule(name), \
                a16.module.self_attn.get_submodule(name)
            x = torch.randn(3, 5, quantized.in_features, generator=g) * 2
            with torch.no_grad():
                got, want, unquantized = quantized(x), plain(qdq(x, stored)), plain(x)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
            assert (got - unquantized).abs().max() > 1e-3, name
