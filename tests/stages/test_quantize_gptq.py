"""GPTQ (`quantize --method gptq`): the OBS engine without a mask against GPTQ's per-column loop
written from its paper with no kconvert code (tests/nvfp4_reference.py: its own FP8 scale
choice, E2M1 rounding and inverse), never worse than RTN per matrix, RTN's bytes where RTN is
kept, and the command line end to end (manifest record, audit against the source, usage
errors).

Tolerance against the per-column loop as for SparseGPT (p48.md, "Mask selection" 3): the
batched loop sums each column's error updates in another order and U comes from another
factorisation, so an E2M1 code may differ where a rounding boundary decides; at most 0.1% of
the block codes may differ, and the output error must not be worse than the reference's by
more than 1%.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from nvfp4_reference import on_grid, output_error, sparsegpt_p48_nvfp4

from conftest import BUNDLED, ROOT
from helpers import assert_audit_passes, cli_inproc, obs_problem, write_input_ids
from kconvert.formats import nvfp4
from kconvert.methods import gptq, obs, obs_method, sparsegpt
from kconvert.methods.sparsegpt import SparseGpt
from oracles import raw_tensors

TINY_MOE = ROOT / "tests" / "fixtures" / "tiny-moe-trained"


@pytest.mark.parametrize("shape,group,rule,arithmetic", [
    ((2, 32, 256, 600), 16, "mse", "compressed-tensors"),  # two lazy blocks of 128
    ((2, 24, 96, 300), 32, "amax", "modelopt"),  # K < 128: lazy block = scale block
])
def test_gptq_loop_matches_the_per_column_loop(shape, group, rule, arithmetic):
    b, m, k, tokens = shape
    w, h, gs = obs_problem(b, m, k, tokens, seed=k, arithmetic=arithmetic)
    row_gs = gs.repeat_interleave(m).reshape(b, m)
    ref_w, ref_codes = sparsegpt_p48_nvfp4(w, h, row_gs, group, rule, arithmetic, prune=False)
    new_w, new_codes = obs.obs_quantize(w, obs.prepare_inverse(h), row_gs, group, rule,
                                        arithmetic=arithmetic)
    ref_err, new_err = output_error(w, ref_w, h), output_error(w, new_w, h)
    differ = int((ref_codes != new_codes.long()).sum())
    print(f"{shape} g{group} {rule}: codes differing {differ}/{ref_codes.numel()}, values "
          f"differing {int((ref_w != new_w).sum())}/{w.numel()}, error {ref_err:.5f} -> "
          f"{new_err:.5f}")
    assert differ <= ref_codes.numel() // 1000
    assert new_err <= ref_err * 1.01
    assert on_grid(new_w, new_codes, row_gs, group, arithmetic)
    assert on_grid(ref_w, ref_codes, row_gs, group, arithmetic)


def _batches(w, h, gs):
    members = [obs.Member(0, e, "gate_proj") for e in range(w.shape[0])]
    return obs.quantize_batches(w, gs, members, lambda mb: obs.HessianSplit(h[mb.expert], None),
                                16, "mse", torch.float32, "compressed-tensors", against_rtn=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="TF32 needs a GPU"))])
@pytest.mark.parametrize("mask", [None, sparsegpt.p48_mask], ids=["gptq", "sparsegpt"])
def test_obs_precision_is_fp32_on_a_cpu_and_as_good_on_a_gpu(device, mask):
    """GPTQ's and SparseGPT's inverse and column loop at the precision they run with
    (obs_method.PRECISION: TF32) against fp32, on a problem whose inverse takes the blocked
    recursion (K = 512, two leaves): on a CPU, which has no TF32, the same bytes; on a GPU an
    output error within 0.5% of fp32's (measured for GPTQ on full-size Kimi experts: within
    0.04%, on either side; docs/obs.md, "TF32")."""
    w, h, gs = obs_problem(4, 32, 512, 1500, seed=11, arithmetic="compressed-tensors")
    w, h, gs = w.to(device), h.to(device), gs.to(device)
    members = [obs.Member(0, e, "gate_proj") for e in range(4)]
    runs = {p: obs.quantize_batches(w, gs, members, lambda mb: obs.HessianSplit(h[mb.expert], None),
                                    16, "mse", torch.float32, "compressed-tensors",
                                    mask=mask, precision=p)
            for p in ("fp32", obs_method.PRECISION)}
    (ref_w, ref_codes, _), (got_w, got_codes, _) = runs.values()
    if device == "cpu":
        assert torch.equal(got_w, ref_w) and torch.equal(got_codes, ref_codes)
    else:
        assert output_error(w, got_w, h) <= output_error(w, ref_w, h) * 1.005


@pytest.mark.parametrize("method", [gptq.Gptq, SparseGpt])
def test_obs_methods_record_tf32_on_a_gpu_only(method):
    """The manifest says where an OBS method's products ran on TF32: its calibration's device
    is a GPU (no GPU is needed to build the record)."""
    from types import SimpleNamespace

    from kconvert.methods.base import MethodInputs
    from kconvert.model.names import Role

    for device, want in (("cpu", None), ("cuda", obs_method.PRECISION)):
        hessians = SimpleNamespace(device=torch.device(device), sequential=False,
                                   gram_roles=frozenset())
        calibration = SimpleNamespace(hessians=hessians, data={"samples": 4})
        made = method(MethodInputs(frozenset({Role.ROUTED_EXPERT}), calibration,
                                   settings={"hessian": "source"}))
        assert made.record().get("obs_precision") == want


def test_gptq_kept_only_where_it_beats_rtn():
    """Correlated inputs: GPTQ wins and its recorded errors are the true ones. A diagonal
    Hessian leaves GPTQ nothing to compensate (its result is RTN's, a tie): RTN is kept, and
    its values and codes are exactly the encoder's RTN. Margins (measured): GPTQ's output error
    36-41% below RTN's; the tie is exact (the same values), not a margin."""
    w, h, gs = obs_problem(3, 16, 128, 400, seed=5, arithmetic="compressed-tensors")
    out, codes, choices = _batches(w, h, gs)
    assert [c.method for c in choices] == ["gptq"] * 3
    for i, c in enumerate(choices):
        assert c.gptq_error < c.rtn_error
        assert c.gptq_error == pytest.approx(output_error(w[i:i + 1], out[i:i + 1],
                                                          h[i:i + 1]), rel=1e-5)
    diagonal = torch.diag_embed(h.diagonal(dim1=-2, dim2=-1))
    out, codes, choices = _batches(w, diagonal, gs)
    assert [c.method for c in choices] == ["rtn"] * 3
    assert all(c.gptq_error == c.rtn_error for c in choices)
    rtn = nvfp4.quantize(w, w.abs().amax((1, 2)), "mse")
    got = nvfp4.quantize(out, w.abs().amax((1, 2)), "mse", block_codes=codes)
    assert torch.equal(got.packed, rtn.packed)
    assert torch.equal(got.block_scales.view(torch.uint8), rtn.block_scales.view(torch.uint8))


def test_gptq_judged_on_held_out_tokens():
    """The comparison with RTN is on the held-out tokens' Hessian where one is given: GPTQ fitted
    to correlated inputs beats RTN on them (above), but judged on held-out tokens whose
    Hessian is diagonal it loses, so RTN is written, with both errors the true ones on the
    held-out Hessian; a matrix with no held-out Hessian is judged on its calibration one.
    Margins (measured): GPTQ's held-out error 31% and 36% above RTN's; the third matrix's
    GPTQ error 36% below RTN's."""
    w, h, gs = obs_problem(3, 16, 128, 400, seed=5, arithmetic="compressed-tensors")
    held = torch.diag_embed(h.diagonal(dim1=-2, dim2=-1))
    members = [obs.Member(0, e, "gate_proj") for e in range(3)]
    out, _codes, choices = obs.quantize_batches(
        w, gs, members,
        lambda mb: obs.HessianSplit(h[mb.expert], None if mb.expert == 2 else held[mb.expert]),
        16, "mse", torch.float32, "compressed-tensors", against_rtn=True)
    assert [(c.method, c.judged_on) for c in choices] == [
        ("rtn", "held-out"), ("rtn", "held-out"), ("gptq", "calibration")]
    rtn = nvfp4.fake_quantize(w.reshape(48, -1, 16), nvfp4.choose_block_codes(
        w.reshape(48, -1, 16), gs.repeat_interleave(16).reshape(-1, 1), "mse", torch.float32,
        "compressed-tensors"), gs.repeat_interleave(16).reshape(-1, 1),
        "compressed-tensors").reshape(w.shape)
    for i in range(2):
        assert torch.equal(out[i], w[i])  # RTN: the encoder rounds the target itself
        assert choices[i].rtn_error == pytest.approx(output_error(
            w[i:i + 1], rtn[i:i + 1], held[i:i + 1]), rel=1e-5)
        assert choices[i].rtn_error <= choices[i].gptq_error


def _data(tmp_path, vocab: int):
    data = write_input_ids(tmp_path / "d.jsonl", ([(7 * i + j) % vocab for j in range(16)]
                                                  for i in range(4)))
    return data


def test_int4_to_nvfp4_gptq_end_to_end(tmp_path):
    """GPTQ from INT4 (the target is the decoded INT4 weights): every routed expert matrix
    recorded, no recorded GPTQ error above RTN's, RTN's bytes wherever RTN was kept, audit
    against the source clean; `--method rtn` writes exactly the default run's bytes. GPTQ is
    kept in all 96 matrices, each by 64% or more below RTN's error (measured)."""
    data = _data(tmp_path, 64)
    gptq, rtn, default = tmp_path / "gptq", tmp_path / "rtn", tmp_path / "default"
    res = cli_inproc("int4-to-nvfp4", BUNDLED, gptq, "--method", "gptq", "--data", data,
                     "--seq-len", "16", "--samples", "4", "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    assert cli_inproc("int4-to-nvfp4", BUNDLED, rtn, "--method", "rtn", "--device", "cpu",
                      "--quiet").exit_code == 0
    assert cli_inproc("int4-to-nvfp4", BUNDLED, default, "--device", "cpu",
                      "--quiet").exit_code == 0
    assert raw_tensors(rtn) == raw_tensors(default)
    man = json.loads((gptq / "kconvert-manifest.json").read_text())
    assert man["options"]["quantize"]["method"] == "gptq"
    assert man["options"]["quantize"]["gptq_targets"] == ["routed_expert"]
    assert "obs_precision" not in man["options"]["quantize"]  # a CPU: fp32
    # GPU manifests written before SparseGPT took TF32 too name the field gptq_precision: the
    # audit still reads them as kconvert's run record (not another tool's, whose checks of
    # the stages' parameters it skips)
    from kconvert.stages.records import RunRecord

    earlier = {**man["options"], "quantize": {**man["options"]["quantize"],
                                              "gptq_precision": "tf32"}}
    assert RunRecord.model_validate(earlier).quantize.gptq_precision == "tf32"
    assert "method" not in json.loads((rtn / "kconvert-manifest.json").read_text()
                                      )["options"]["quantize"]
    got, ref = raw_tensors(gptq), raw_tensors(rtn)
    experts = {n.rsplit(".", 1)[0] for n in ref if ".mlp.experts." in n}
    assert experts and experts == set(man["obs"])
    choices = man["obs"].values()
    assert all(c["gptq_error"] < c["rtn_error"] if c["method"] == "gptq"
               else c["rtn_error"] <= c["gptq_error"] for c in choices)
    assert any(c["method"] == "gptq" for c in choices)
    for module, c in man["obs"].items():
        same = got[f"{module}.weight_packed"] == ref[f"{module}.weight_packed"]
        assert same == (c["method"] == "rtn") or (same and c["method"] == "gptq")
    assert_audit_passes(gptq, "--source", BUNDLED)


def test_quantize_gptq_shared_expert_and_usage(tmp_path):
    """A BF16 source with shared experts and attention targeted: GPTQ on routed and shared
    experts (Hessians from every token for the shared one) and attention (its input Grams),
    as recorded;
    --data without gptq, gptq without --data and a sparsify method are refused."""
    vocab = json.loads((TINY_MOE / "config.json").read_text())["vocab_size"]
    data = _data(tmp_path, vocab)
    dst = tmp_path / "q"
    res = cli_inproc("quantize", TINY_MOE, dst, "--method", "gptq", "--data", data, "--seq-len",
                     "16", "--samples", "4", "--targets", "experts,shared_experts,attention",
                     "--device", "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    man = json.loads((dst / "kconvert-manifest.json").read_text())
    assert man["options"]["quantize"]["gptq_targets"] == ["attention", "routed_expert",
                                                          "shared_expert"]
    assert any(".shared_experts." in m for m in man["obs"])
    assert any(".self_attn." in m for m in man["obs"])
    assert not any(".layers.0.mlp." in m for m in man["obs"])  # the dense MLP: not targeted
    # 64 tokens: too few to hold any out (obs.HELDOUT_MIN), and the manifest says so
    assert {c["judged_on"] for c in man["obs"].values()} == {"calibration"}
    assert all(c["gptq_error"] < c["rtn_error"] or c["method"] == "rtn"
               for c in man["obs"].values())
    assert_audit_passes(dst, "--source", TINY_MOE)
    res = cli_inproc("quantize", TINY_MOE, tmp_path / "a", "--data", data, "--device", "cpu",
                     "--quiet")
    assert res.exit_code == 2 and "--data serves --method gptq" in res.output
    for command, src in (("quantize", TINY_MOE), ("int4-to-nvfp4", BUNDLED)):
        res = cli_inproc(command, src, tmp_path / "b", "--method", "gptq", "--device", "cpu",
                         "--quiet")
        assert res.exit_code == 2, res.output
        assert "--method gptq needs calibration data" in res.output, res.output
        assert not (tmp_path / "b").exists()
    res = cli_inproc("run", "quantize", TINY_MOE, tmp_path / "c", "--method", "sparsegpt",
                     "--device", "cpu", "--quiet")
    assert res.exit_code == 2 and "is a sparsify method" in res.output


def test_the_projection_for_the_whole_model_is_the_layers_measured(tmp_path):
    """-v's whole-model projection of an OBS run is its MoE layers' own seconds (waited for
    the forward + solved) carried to Kimi's 61 decoder layers: 60 MoE layers at the steady
    ones' mean plus the first's extra, as the line's own figures say."""
    res = cli_inproc("int4-to-nvfp4", BUNDLED, tmp_path / "out", "--method", "gptq", "--data",
                     _data(tmp_path, 64), "--seq-len", "16", "--samples", "4", "--device",
                     "cpu", "-v")
    assert res.exit_code == 0, res.output
    layers = [float(a) + float(b) for a, b in re.findall(
        r"OBS layer \d+: ([\d.]+) s waiting for its calibration forward, ([\d.]+) s solving",
        res.output)]
    (line,) = re.findall(r"OBS engine: projection for the whole model \(61 decoder layers; "
                         r"([\d.]+) s per steady MoE layer as measured, the first ([\d.]+) s\): "
                         r"([\d.]+) min", res.output)
    steady, first, minutes = map(float, line)
    assert len(layers) == 2  # the bundled checkpoint's MoE layers 1 and 2 (layer 0 dense)
    assert steady == pytest.approx(layers[1], abs=0.06)
    assert first == pytest.approx(layers[0], abs=0.06)
    assert minutes == pytest.approx((60 * layers[1] + layers[0] - layers[1]) / 60, abs=0.06)


def test_gptq_is_nvfp4_only(tmp_path):
    """GPTQ is implemented on NVFP4's grid: an MXFP4 --format with --method gptq is a usage
    error before any write, and int4-to-mxfp4 offers no --method."""
    data = _data(tmp_path, 64)
    dst = tmp_path / "mx"
    res = cli_inproc("quantize", BUNDLED, dst, "--format", "quark-mxfp4", "--method", "gptq",
                     "--data", data, "--seq-len", "16", "--samples", "4", "--device", "cpu",
                     "--quiet")
    assert res.exit_code == 2 and "--method gptq writes NVFP4" in res.output, res.output
    assert not dst.exists() or not any(dst.iterdir())
    res = cli_inproc("int4-to-mxfp4", BUNDLED, dst, "--method", "gptq", "--device", "cpu",
                     "--quiet")
    assert res.exit_code == 2 and "--method" in res.output


def test_quantize_gptq_holds_tokens_out_where_there_are_enough(tmp_path):
    """2,048 calibration tokens: the shared expert (every token) holds 256 out and is judged on
    them; a routed expert's ~340 tokens leave too few (obs.HELDOUT_MIN) and are judged on all."""
    vocab = json.loads((TINY_MOE / "config.json").read_text())["vocab_size"]
    data = tmp_path / "d.jsonl"
    g = torch.Generator().manual_seed(0)
    write_input_ids(data, (torch.randint(0, vocab, (64,), generator=g) for _ in range(32)))
    dst = tmp_path / "q"
    res = cli_inproc("quantize", TINY_MOE, dst, "--method", "gptq", "--data", data, "--seq-len",
                     "64", "--samples", "32", "--targets", "experts,shared_experts", "--device",
                     "cpu", "--quiet")
    assert res.exit_code == 0, res.output
    judged = {m: c["judged_on"] for m, c in json.loads(
        (dst / "kconvert-manifest.json").read_text())["obs"].items()}
    assert {j for m, j in judged.items() if ".shared_experts." in m} == {"held-out"}
    assert {j for m, j in judged.items() if ".experts." in m} == {"calibration"}
