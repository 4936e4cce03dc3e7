"""MXFP4 (docs/formats.md §6): the E8M0 amax rule against compressed-tensors' own MXFP4
compressor, the mse rule, the compressed-tensors layout end to end (bytes and config read by
compressed-tensors), and MXFP4 as an input: dequant, reap, audit (a tampered E8M0 scale is
caught), inspect and eval. AMD Quark's layout against Quark itself: test_mxfp4_quark.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams

from conftest import BUNDLED, ROOT
from helpers import (
    add_at,
    assert_audit_passes,
    audit_json,
    checkpoint_tensors,
    cli_inproc,
    edit_tensor,
    write_input_ids,
)
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.formats import Mxfp4Codec, QuarkMxfp4Codec, mxfp4
from kconvert.formats.ct_config import CT_TARGETS
from kconvert.formats.int4 import Int4Codec
from kconvert.model.names import Role
from kconvert.pruning.plan import parse_plan
from kconvert.stages.prune import prune_stage
from oracles import by_module

QUIET = RunControl(device="cpu", quiet=True)
KEEP = {1: [0, 2, 3, 5, 8, 9, 12, 15], 2: [1, 2, 4, 6, 7, 10, 11, 14]}
TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


def ct_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' MXFP4 bytes of w [M, K]: its observer's scales (calculate_qparams on
    each 32-group's min/max, what llm-compressor computes) and its MXFP4 compressor."""
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    groups = w.reshape(w.shape[0], -1, mxfp4.BLOCK)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return out["weight_packed"], out["weight_scale"]


def edge_rows() -> torch.Tensor:
    """Every E2M1 tie point and its neighbours, signed zeros, values that round to 0, amaxes
    on both sides of the 1.75 round-up, an all-zero block, large and small exponents."""
    x = torch.zeros(8, 64)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5])
    x[0, :32] = torch.cat([ties, -ties, ties.nextafter(torch.tensor(9.0)),
                           -ties.nextafter(torch.tensor(0.0))])
    x[1, :8] = torch.tensor([-0.0, -0.1, 0.1, -0.24, 4.0, 6.99, -7.0, 1.0])
    x[2, :32] = torch.linspace(-1.75, 1.75, 32)
    x[2, 32:] = torch.linspace(-1.7499, 1.7, 32)
    x[3, :32] = torch.randn(32) * 2.0**-100
    x[4, :32] = torch.randn(32) * 2.0**100
    x[5] = torch.randn(64) * 0.02  # BF16-like weights
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amax_rule_is_compressed_tensors_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.cat([edge_rows(), torch.randn(56, 64, generator=g) * 0.05]).to(dtype)
    packed, scales = ct_mxfp4(w)
    q = mxfp4.quantize(w.float().unsqueeze(0), "amax", mxfp4.COMPRESSED_TENSORS)
    assert torch.equal(q.scales[0], scales)
    assert torch.equal(q.packed[0], packed)
    # compressed-tensors' decompressor reads our bytes as our decode does.
    back = MXFP4PackedCompressor.decompress(
        {"weight_packed": q.packed[0], "weight_scale": q.scales[0]},
        preset_name_to_scheme("MXFP4A16", ["Linear"]))["weight"]
    torch.testing.assert_close(back.float(), mxfp4.dequantize(q.packed, q.scales)[0],
                               rtol=0, atol=0)


def kimi_int4(experts: int, out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """INT4 experts decoded exactly: codes -7..7, one bf16 scale per 32."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-7, 8, (experts, out, inp), generator=g).float()
    scale = (torch.rand(experts, out, inp // 32, generator=g) * 0.004 + 0.001).bfloat16()
    return codes * scale.float().repeat_interleave(32, dim=-1)


def test_mse_rule_never_worse_per_block_and_lower_on_bf16_weights():
    w = (torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0)) * 0.02)
    w = w.bfloat16().float()
    amax = mxfp4.quantize(w, "amax")
    mse = mxfp4.quantize(w, "mse")
    ratio = float(mse.err_sq.sum() / amax.err_sq.sum())
    assert ratio < 1.0, ratio  # full-size figures: benchmarks/quality/mxfp4_quality.py
    # Per block: the amax rule's code is among the candidates, so no block gets worse.
    def block_err(q):
        return (mxfp4.dequantize(q.packed, q.scales) - w).square().reshape(2, 64, -1, 32).sum(-1)
    assert bool((block_err(mse) <= block_err(amax)).all())
    # The recorded error is the decode's error against the source.
    torch.testing.assert_close(mse.err_sq, block_err(mse).sum((1, 2)).double(), rtol=1e-6,
                               atol=0)
    changed = mse.scales != amax.scales
    assert bool(changed.any())
    assert bool(((mse.scales.int() - amax.scales.int()).abs()[changed] == 1).all())
    # On INT4 groups whose largest code is 7 the amax rule's octave is already the best one.
    w4 = kimi_int4(1, 32, 256)
    assert torch.equal(mxfp4.quantize(w4, "mse").scales, mxfp4.quantize(w4, "amax").scales)


def test_bytes_do_not_depend_on_the_chunking():
    w = kimi_int4(3, 32, 128, seed=1)
    for rule in mxfp4.RULES:
        a, b = mxfp4.quantize(w, rule, chunk_elems=128), mxfp4.quantize(w, rule)
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)


def test_nan_scale_code_decodes_to_nan():
    packed = torch.full((1, 1, 16), 0x22, dtype=torch.uint8)
    scales = torch.tensor([[[mxfp4.NAN_CODE]]], dtype=torch.uint8)
    assert bool(mxfp4.dequantize(packed, scales).isnan().all())


@pytest.fixture(scope="module")
def ct_out(tmp_path_factory):
    dst = tmp_path_factory.mktemp("mx-ct") / "out"
    convert(str(BUNDLED), str(dst), load_recipe("int4-to-mxfp4"),
            {"format": "mxfp4-pack-quantized", "block_scale": "amax"}, QUIET)
    return dst


@pytest.fixture(scope="module")
def quark_out(tmp_path_factory):
    dst = tmp_path_factory.mktemp("mx-quark") / "out"
    convert(str(BUNDLED), str(dst), load_recipe("int4-to-mxfp4"), {}, QUIET)
    return dst


def test_compressed_tensors_layout_is_its_compressors_bytes_and_config(ct_out):
    src, out = by_module(checkpoint_tensors(BUNDLED)), by_module(checkpoint_tensors(ct_out))
    experts = [m for m in out if ".mlp.experts." in m]
    assert len(experts) == 96
    for module in experts:
        sd = {p: t.unsqueeze(0) for p, t in src[module].items() if p != "weight_shape"}
        packed, scales = ct_mxfp4(Int4Codec.decode(sd, None)[0])
        assert set(out[module]) == {"weight_packed", "weight_scale"}
        assert torch.equal(out[module]["weight_packed"], packed), module
        assert torch.equal(out[module]["weight_scale"], scales), module
    block = json.loads((ct_out / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(block)
    scheme = preset_name_to_scheme("MXFP4A16", [CT_TARGETS[Role.ROUTED_EXPERT][0]])
    scheme.format = "mxfp4-pack-quantized"
    assert {k: g.model_dump(mode="json") for k, g in qc.config_groups.items()} == {
        "group_0": scheme.model_dump(mode="json")}
    assert qc.format == "mxfp4-pack-quantized" and qc.ignore == ["lm_head"]
    manifest = json.loads((ct_out / "kconvert-manifest.json").read_text())
    assert manifest["options"]["quantize"]["activations"] == "none"
    assert manifest["fused_sets"] == {}  # no per-tensor scale to share


def test_dynamic_activations_declare_w4a4_in_the_config(tmp_path):
    dst = tmp_path / "out"
    convert(str(BUNDLED), str(dst), load_recipe("int4-to-mxfp4"),
            {"format": "mxfp4-pack-quantized", "activations": "dynamic"}, QUIET)
    block = json.loads((dst / "config.json").read_text())["quantization_config"]
    acts = block["config_groups"]["group_0"]["input_activations"]
    want = preset_name_to_scheme("MXFP4", ["Linear"]).input_activations
    assert acts == want.model_dump(mode="json") and acts["dynamic"] is True
    assert not any(n.endswith("input_global_scale") for n in checkpoint_tensors(dst))


def test_mxfp4_sources_decode_everywhere(quark_out, ct_out, tmp_path):
    """dequant writes the codec's decode; the audit passes both layouts against the INT4
    source and the dequantized copy against its MXFP4 source; inspect reads them."""
    for out, codec in ((quark_out, QuarkMxfp4Codec), (ct_out, Mxfp4Codec)):
        dst = tmp_path / f"dq-{codec.name}"
        convert(str(out), str(dst), load_recipe("dequant"), {"dtype": "F32"}, QUIET)
        mods, dq = by_module(checkpoint_tensors(out)), checkpoint_tensors(dst)
        module = "model.layers.1.mlp.experts.3.down_proj"
        want = codec.decode({p: t.unsqueeze(0) for p, t in mods[module].items()}, None)[0]
        assert torch.equal(dq[module + ".weight"], want)
        assert "quantization_config" not in json.loads((dst / "config.json").read_text())
        for ckpt, source in ((out, BUNDLED), (dst, out)):
            assert_audit_passes(ckpt, "--source", source)
        res = cli_inproc("inspect", out)
        assert res.exit_code == 0 and "routed_experts" in res.output, res.output


def test_reap_keeps_mxfp4_experts_byte_identical(quark_out, tmp_path):
    plan = {"criterion": "manual", "layers": {str(k): {"keep": v} for k, v in KEEP.items()}}
    dst = tmp_path / "pruned"
    convert(str(quark_out), str(dst), load_recipe("reap"), {}, QUIET,
            prepare=lambda ckpt: {"prune": prune_stage(parse_plan(plan), ckpt)})
    s, d = checkpoint_tensors(quark_out), checkpoint_tensors(dst)
    for layer, keep in KEEP.items():
        for new, old in enumerate(keep):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for param in QuarkMxfp4Codec.params:
                    a = d[f"model.layers.{layer}.mlp.experts.{new}.{proj}.{param}"]
                    b = s[f"model.layers.{layer}.mlp.experts.{old}.{proj}.{param}"]
                    assert a.dtype == torch.uint8 and torch.equal(a, b)
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] \
        == "quark"
    assert_audit_passes(dst)


def test_audit_catches_a_tampered_e8m0_scale(quark_out, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(quark_out, bad)
    name = "model.layers.2.mlp.experts.5.up_proj.weight_scale"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())[
        "weight_map"][name]
    edit_tensor(shard, name, add_at((7, 1), 3))  # one block 8x larger
    code, rep = audit_json(bad)
    assert code == 1
    assert any(f["group"] == "manifest" and f["tensor"] == name for f in rep["failures"]), rep
    (bad / "kconvert-manifest.json").unlink()
    code, rep = audit_json(bad, "--source", BUNDLED)
    assert code == 1
    hits = [f for f in rep["failures"] if f["group"] == "source" and f["check"] == "decode"]
    assert [f["tensor"] for f in hits] == ["model.layers.2.mlp.experts.5.up_proj.weight"], rep


def test_eval_reads_an_mxfp4_checkpoint(tmp_path):
    dst = tmp_path / "mx"
    convert(str(TINY_MOE), str(dst), load_recipe("quantize"),
            {"format": "quark-mxfp4", "block_scale": "mse"}, QUIET)
    data = write_input_ids(tmp_path / "d.jsonl", ([(7 * i + 3 * j) % 250 for j in range(16)]
                                                  for i in range(2)))
    res = cli_inproc("eval", TINY_MOE, dst, "--data", data, "--seq-len", "16", "--samples", "2",
                     "--device", "cpu", "-o", tmp_path / "ev", "--quiet")
    assert res.exit_code == 0, res.output
    logits = json.loads((tmp_path / "ev" / "eval.json").read_text())["candidates"][0]["logits"]
    assert 0 < logits["kl_mean"] < 0.5


def test_mxfp4_refuses_what_it_cannot_write(tmp_path):
    res = cli_inproc("int4-to-mxfp4", BUNDLED, tmp_path / "a", "--format", "quark-mxfp4",
                     "--act-stats", BUNDLED / "config.json")
    assert res.exit_code == 2 and "takes no --act-stats" in res.output, res.output
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "b", "--activations", "dynamic")
    assert res.exit_code == 2 and "MXFP4" in res.output, res.output


@pytest.fixture(scope="module")
def routers_out(tmp_path_factory):
    """AMD's recipe: routed experts and routers MXFP4 (Quark layout, W4A4 declared)."""
    dst = tmp_path_factory.mktemp("mx-routers") / "out"
    convert(str(BUNDLED), str(dst), load_recipe("int4-to-mxfp4"),
            {"targets": "experts,routers"}, QUIET)
    return dst


def test_quantized_routers_are_audited_through_their_decode(routers_out, tmp_path):
    router = "model.layers.1.mlp.gate"
    t = checkpoint_tensors(routers_out)
    assert t[router + ".weight"].dtype == torch.uint8 and t[router + ".weight_scale"].shape == \
        (16, 4)
    block = json.loads((routers_out / "config.json").read_text())["quantization_config"]
    assert router not in block["exclude"] and "lm_head" in block["exclude"]
    assert_audit_passes(routers_out, "--source", BUNDLED)
    bad = tmp_path / "bad"
    shutil.copytree(routers_out, bad)
    (bad / "kconvert-manifest.json").unlink()
    name = router + ".weight_scale"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())[
        "weight_map"][name]
    edit_tensor(shard, name, add_at((6, 2), 2))  # one block of row 6, 4x larger
    code, rep = audit_json(bad, "--source", BUNDLED)
    assert code == 1
    hits = [f for f in rep["failures"] if f["check"] == "router"]
    assert len(hits) == 1 and "row 6 " in hits[0]["message"], rep["failures"]


def test_quantized_routers_read_everywhere(routers_out, tmp_path):
    """reap selects the router rows of both tensors; dequant and eval decode the router."""
    plan = {"criterion": "manual", "layers": {str(k): {"keep": v} for k, v in KEEP.items()}}
    pruned = tmp_path / "pruned"
    convert(str(routers_out), str(pruned), load_recipe("reap"), {}, QUIET,
            prepare=lambda ckpt: {"prune": prune_stage(parse_plan(plan), ckpt)})
    s, d = checkpoint_tensors(routers_out), checkpoint_tensors(pruned)
    for layer, keep in KEEP.items():
        for p in QuarkMxfp4Codec.params:
            name = f"model.layers.{layer}.mlp.gate.{p}"
            assert torch.equal(d[name], s[name][torch.tensor(keep)])
    assert_audit_passes(pruned)
    dq = tmp_path / "dq"
    convert(str(routers_out), str(dq), load_recipe("dequant"), {"dtype": "F32"}, QUIET)
    router = "model.layers.2.mlp.gate"
    want = QuarkMxfp4Codec.decode({p: s[f"{router}.{p}"].unsqueeze(0)
                                   for p in QuarkMxfp4Codec.params}, None)[0]
    assert torch.equal(checkpoint_tensors(dq)[router + ".weight"], want)
    assert_audit_passes(dq, "--source", routers_out)
    # eval runs a W4A4 output with its activations quantized (tests/evaluate/
    # test_mxfp4_w4a4_eval.py): the weights alone are compared on the W4A16 twin.
    w4a16 = tmp_path / "w4a16"
    convert(str(BUNDLED), str(w4a16), load_recipe("int4-to-mxfp4"),
            {"targets": "experts,routers", "activations": "none"}, QUIET)
    twin = checkpoint_tensors(w4a16)
    assert set(twin) == set(s) and all(torch.equal(twin[n], t) for n, t in s.items())
    data = write_input_ids(tmp_path / "d.jsonl", [list(range(3, 19))])
    res = cli_inproc("eval", dq, w4a16, "--data", data, "--seq-len", "16", "--samples", "1",
                     "--device", "cpu", "-o", tmp_path / "ev", "--quiet")
    assert res.exit_code == 0, res.output
    logits = json.loads((tmp_path / "ev" / "eval.json").read_text())["candidates"][0]["logits"]
    assert logits["kl_mean"] < 1e-6  # the same weights, decoded by eval or by dequant


def test_routers_only_in_quarks_format(tmp_path):
    res = cli_inproc("int4-to-mxfp4", BUNDLED, tmp_path / "a", "--format", "mxfp4-pack-quantized",
                     "--targets", "experts,routers")
    assert res.exit_code == 2 and "only quark-mxfp4" in res.output, res.output
