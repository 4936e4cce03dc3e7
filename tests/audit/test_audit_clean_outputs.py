"""`kconvert audit`: every command's and every recipe's output passes, the error it reports
equals one computed here from scratch, its table and exit codes, FP8 block sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from audit_support import (
    INDEX,
    OUTPUTS,
    REAP_KEEP,
    assert_named,
    copy,
    rewrite_shard,
    run,
    tensor,
    write_raw,
)

from helpers import audit_json, cli_inproc

# The fixture `outputs` (every command and recipe on the fixtures), built once for all
# the audit test modules.
pytest_plugins = ["audit_fixtures"]

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------ 1. clean outputs pass


def _int4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """formats.md §1, written out here: nibble k of a word is element k, value = u - 8."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], -1).reshape(
        packed.shape[0], -1) - 8
    return codes.float() * scale.float().repeat_interleave(codes.shape[1] // scale.shape[1], 1)


def _nvfp4_decode(packed: torch.Tensor, block: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """formats.md §2 step 4, written out here: low nibble = even element, sign = bit 3."""
    nib = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    vals = E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
    return vals * (block.float() / gs.float()).repeat_interleave(16, 1)


@pytest.mark.parametrize("name", OUTPUTS)
def test_every_command_output_passes(outputs, name):
    out, src = outputs[name]
    code, rep = audit_json(out)
    assert code == 0 and rep["passed"], rep["failures"]
    assert rep["checks"]["manifest"]["run"] > 0 and rep["checks"]["structure"]["run"] > 0
    code, rep = audit_json(out, "--source", str(src))
    assert code == 0 and rep["passed"], rep["failures"]
    assert rep["checks"]["source"]["run"] > 0
    manifest = json.loads((out / "kconvert-manifest.json").read_text())
    for layer in ("1", "2"):
        if "prune" in manifest["options"]:  # the plan written to DST by the run is the one used
            want = {"mode": "plan", "source_ids": REAP_KEEP[layer]}
        else:  # unpruned: router rows matched one to one
            want = {"mode": "identity", "source_ids": list(range(16))}
        assert rep["mapping"][layer] == want
    changed = {t.rsplit(".", 1)[0] for t, e in manifest["tensors"].items()
               if e["stage"] not in ("copy", "select-rows")}  # select-rows: the router
    for layer in ("1", "2"):
        expected = sum(1 for m in changed if f"layers.{layer}." in m)
        assert rep["layers"][layer]["compared"] == expected  # every re-encoded module decoded
    if name in ("densify", "run-densify"):  # re-laid out byte for byte, nothing quantized
        assert manifest["summary"]["quantized_modules"] == 0 and not manifest["layers"]


def test_reported_error_matches_an_independent_decode(outputs):
    """The max relative MSE audit reports for a layer equals one computed here from scratch."""
    out, src = outputs["int4-to-nvfp4-ct"]
    _, rep = audit_json(out, "--source", str(src))
    worst = 0.0
    for e in range(16):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            m = f"model.layers.1.mlp.experts.{e}.{proj}"
            a = _int4_decode(tensor(src, f"{m}.weight_packed"), tensor(src, f"{m}.weight_scale"))
            b = _nvfp4_decode(tensor(out, f"{m}.weight_packed"), tensor(out, f"{m}.weight_scale"),
                              tensor(out, f"{m}.weight_global_scale"))
            worst = max(worst, float((b.double() - a.double()).square().sum()
                                     / a.double().square().sum()))
    assert rep["layers"]["1"]["max_rel_mse"] == pytest.approx(worst, rel=1e-6)
    assert 1e-4 < worst < 0.05


def test_table_output_and_exit_codes(outputs, tmp_path):
    out, src = outputs["int4-to-nvfp4-ct"]
    res = cli_inproc("audit", out, "--source", src, "--quiet")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert any(line.split()[:3] == ["1", "16", "0..15"] for line in lines), res.stdout
    assert "PASS" in lines[-1]
    res = cli_inproc("audit", tmp_path / "nope", "--quiet")
    assert res.exit_code == 1 and "not a directory" in res.output, res.output
    bad = copy(out, tmp_path / "bad")
    (bad / "config.json").write_text("{")
    res = cli_inproc("audit", bad, "--quiet")
    assert res.exit_code == 1 and "config.json is not valid JSON" in res.stdout


def _to_fp8_block(src: Path, dst: Path) -> Path:
    """Kimi-K2-Instruct / DeepSeek-V3 style FP8: every projection FP8 with 128x128 block scales
    (formats.md §4), written here from the BF16 fixture."""
    ckpt = copy(src, dst)
    for shard in sorted(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values())):
        def edit(t):
            out = {}
            for k, v in t.items():
                if not (k.endswith(("_proj.weight", "_mqa.weight")) and v.dim() == 2):
                    out[k] = v
                    continue
                w = v.float()
                scale = torch.zeros(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
                q = torch.empty_like(w)
                for a in range(scale.shape[0]):
                    for b in range(scale.shape[1]):
                        blk = w[a * 128:(a + 1) * 128, b * 128:(b + 1) * 128]
                        scale[a, b] = blk.abs().max() / 448
                        q[a * 128:(a + 1) * 128, b * 128:(b + 1) * 128] = blk / scale[a, b]
                out[k] = q.to(torch.float8_e4m3fn)
                out[k[: -len("weight")] + "weight_scale_inv"] = scale
            return out
        rewrite_shard(ckpt, shard, edit)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def test_fp8_block_source_and_its_dequant(fixture_dir, tmp_path):
    fp8 = _to_fp8_block(fixture_dir("bf16"), tmp_path / "fp8")
    code, rep = audit_json(fp8)
    assert code == 0, rep["failures"]
    out = run(fp8, tmp_path / "dq", "dequant")
    code, rep = audit_json(out, "--source", str(fp8))
    assert code == 0, rep["failures"]
    assert rep["layers"]["1"]["compared"] == 16 * 3 + 3 + 5  # experts, shared, attention
    # A scale of one block made negative is named.
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    t = tensor(fp8, name).clone()
    t[0, 0] = -t[0, 0]
    write_raw(fp8, name, t.numpy().tobytes())
    _, rep = audit_json(fp8)
    assert_named(rep, "scales", "scale-values", layer=1, tensor=name, text="finite and > 0")
