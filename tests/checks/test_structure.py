"""A conversion runs the audit's structure and quantization_config checks on its source before
it writes anything: a source the audit rejects is refused with the audit's message (exit 2, no
output); a quantization_config that is known but disagrees with the tensors is followed with a
warning naming the disagreement, and the output audits clean.

Sources are broken here with plain JSON edits and safetensors' own reader/writer; expectations
come from the edit (which key, which expert), never from an earlier run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import audit_json, cli_inproc

INDEX = "model.safetensors.index.json"
MANIFEST = "kconvert-manifest.json"


def edit_config(ckpt: Path, edit) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))


def drop_tensors(ckpt: Path, prefix: str) -> list[str]:
    """Remove every tensor whose name starts with `prefix` from its shard and the index."""
    index = json.loads((ckpt / INDEX).read_text())
    gone = sorted(n for n in index["weight_map"] if n.startswith(prefix))
    assert gone, prefix
    for shard in {index["weight_map"][n] for n in gone}:
        with safe_open(str(ckpt / shard), "pt") as fh:
            kept = {k: fh.get_tensor(k) for k in fh.keys() if k not in gone}
        save_file(kept, str(ckpt / shard), metadata={"format": "pt"})
    for n in gone:
        del index["weight_map"][n]
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))
    return gone


def weights(cfg: dict) -> dict:
    return cfg["quantization_config"]["config_groups"]["group_0"]["weights"]


# ------------------------------------------------------------------ structure: refused


def _missing_expert(ckpt: Path) -> None:
    drop_tensors(ckpt, "model.layers.1.mlp.experts.5.")


def _expert_scale_in_f64(ckpt: Path) -> None:
    """Expert 5's down_proj scales of layer 1 stored as F64 (INT4 scales are BF16, F16 or
    F32), the layer's others as BF16."""
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale"
    shard = json.loads((ckpt / INDEX).read_text())["weight_map"][name]
    with safe_open(str(ckpt / shard), "pt") as fh:
        kept = {k: fh.get_tensor(k) for k in fh.keys()}
    kept[name] = kept[name].double()
    save_file(kept, str(ckpt / shard), metadata={"format": "pt"})


STRUCTURE = {
    # name: (fixture variant, edit, text of the audit's failure, its group/check)
    "layer-missing-expert-5": ("k2-int4-kimi", _missing_expert,
                               "expert ids must be exactly 0..15: missing 5",
                               "structure/expert-ids"),
    "n_routed_experts-12": ("k2-int4-kimi", lambda c: edit_config(
        c, lambda cfg: cfg.update(n_routed_experts=12)),
        "disagree: n_routed_experts = 12, expert ids = 16, router rows = 16",
        "structure/counts"),
    "n_routed_experts-missing": ("k2-int4-kimi", lambda c: edit_config(
        c, lambda cfg: cfg.pop("n_routed_experts")),
        "config.json has no n_routed_experts", "structure/config"),
    "n_routed_experts-string": ("k2-int4-kimi", lambda c: edit_config(
        c, lambda cfg: cfg.update(n_routed_experts="16")),
        "config.json's n_routed_experts is '16': input should be a valid integer",
        "structure/config"),
    "num_hidden_layers-missing": ("k2-int4-kimi", lambda c: edit_config(
        c, lambda cfg: cfg.pop("num_hidden_layers")),
        "config.json has no num_hidden_layers", "structure/config"),
    "k25-text_config-n_routed_experts-12": ("k25-int4", lambda c: edit_config(
        c, lambda cfg: (cfg["text_config"].update(n_routed_experts=12),
                        cfg.update(n_routed_experts=12))),
        "disagree: n_routed_experts = 12, expert ids = 16", "structure/counts"),
    "expert-5-scale-f64": ("k2-int4-kimi", _expert_scale_in_f64,
                           "F64[128, 2] but the layer's other experts have BF16[128, 2]",
                           "structure/experts"),
}


@pytest.fixture(scope="module")
def broken(fixture_dir, tmp_path_factory):
    """name -> a copy of its fixture with the defect made."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name, (variant, edit, _, _) in STRUCTURE.items():
        out[name] = Path(shutil.copytree(fixture_dir(variant), root / name))
        edit(out[name])
    return out


@pytest.mark.parametrize("name", list(STRUCTURE))
def test_audit_and_conversion_refuse_the_same_structure(broken, name, tmp_path):
    src = broken[name]
    _, _, text, check = STRUCTURE[name]
    code, rep = audit_json(src)
    assert code == 1
    messages = [f["message"] for f in rep["failures"]
                if f"{f['group']}/{f['check']}" == check]
    assert any(text in m for m in messages), rep["failures"]
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    for command in (["int4-to-nvfp4"], ["dequant"], ["run", "sparsify"]):
        dst = tmp_path / command[-1]
        res = cli_inproc(*command, src, dst, "--quiet")
        assert res.exit_code == 1, res.output
        # a config value is refused where config.json is read, before the tensors are planned
        refusal = (f"kconvert: error: {text}" if check == "structure/config" else
                   "kconvert: error: the source is not what its config says")
        assert refusal in res.output, res.output
        # The audit's own words, its first failure's included.
        assert text in res.output and rep["failures"][0]["message"] in res.output, res.output
        assert ("config.json" in res.output) == (check == "structure/config"), res.output
        assert not dst.exists(), "a refused conversion wrote something"
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before


def test_a_mistyped_scale_fails_its_layout_check_by_name(broken):
    """The quant-config check of every parameter's dtype and shape, on a failure: its message
    (made only then) names the parameter, what it is and what the format needs."""
    code, rep = audit_json(broken["expert-5-scale-f64"])
    assert code == 1
    layout = [f for f in rep["failures"] if f"{f['group']}/{f['check']}" ==
              "quant-config/scale-layout"]
    assert [f["tensor"] for f in layout] == ["model.layers.1.mlp.experts.5.down_proj.weight_scale"]
    assert layout[0]["message"] == ("weight_scale is F64[128, 2], int4-pack-quantized needs "
                                    "BF16/F16/F32[128, 2]")


def test_refusal_names_the_file_and_tensor(broken):
    """The KconvertError of a per-tensor failure names the shard that holds the tensor."""
    from kconvert.driver.convert import RunControl, convert
    from kconvert.driver.recipes import load_recipe
    from kconvert.errors import KconvertError

    src = broken["n_routed_experts-12"]
    shard = json.loads((src / INDEX).read_text())["weight_map"]["model.layers.1.mlp.gate.weight"]
    with pytest.raises(KconvertError) as err:
        convert(str(src), str(src.parent / "never"), load_recipe("int4-to-nvfp4"), {},
                RunControl(quiet=True))
    assert err.value.tensor == "model.layers.1.mlp.gate.weight"
    assert err.value.file == str(src / shard)
    assert "4 check(s)" in str(err.value) and "and 1 more" in str(err.value)


# ------------------------------------------------------------------ quantization_config


UNKNOWN = {
    "format-mystery": (lambda cfg: cfg["quantization_config"].update(format="mystery-quantized"),
                       "format 'mystery-quantized'"),
    "method-gptq": (lambda cfg: cfg["quantization_config"].update(quant_method="gptq"),
                    "quant_method 'gptq'"),
}


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_unknown_quantization_is_refused(fixture_dir, tmp_path, name):
    edit, value = UNKNOWN[name]
    src = Path(shutil.copytree(fixture_dir("k2-int4-kimi"), tmp_path / "src"))
    edit_config(src, edit)
    code, rep = audit_json(src)
    assert code == 1
    found = [f for f in rep["failures"] if f["check"] == "unknown-format"]
    assert len(found) == 1 and found[0]["file"] == "config.json", rep["failures"]
    assert value in found[0]["message"] and "tensors are quantized" in found[0]["message"]
    res = cli_inproc("int4-to-nvfp4", src, tmp_path / "out", "--quiet")
    assert res.exit_code == 1, res.output
    assert value in res.output and str(src / "config.json") in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_unknown_quantization_over_unquantized_tensors_warns(fixture_dir, tmp_path):
    """Nothing quantized, nothing the unknown block could mislead: a warning, not a failure."""
    src = Path(shutil.copytree(fixture_dir("bf16"), tmp_path / "src"))
    edit_config(src, lambda cfg: cfg.update(quantization_config={"quant_method": "gptq"}))
    code, rep = audit_json(src)
    assert code == 0, rep["failures"]
    assert any(w["check"] == "unknown-format" and "quant_method 'gptq'" in w["message"]
               for w in rep["warnings"]), rep["warnings"]


CONTRADICTIONS = {
    # name: (edit of the Kimi INT4 config, key named, what the config says, what the tensors are)
    "num_bits-8": (lambda cfg: weights(cfg).update(num_bits=8), "num_bits", "8", "4"),
    "group_size-64": (lambda cfg: weights(cfg).update(group_size=64), "group_size", "64", "32"),
    "type-float": (lambda cfg: weights(cfg).update(type="float"), "type", "'float'", "'int'"),
}


@pytest.mark.parametrize("name", list(CONTRADICTIONS))
def test_contradicting_quantization_config_is_reported_and_followed(fixture_dir, tmp_path,
                                                                    name):
    edit, key, says, actual = CONTRADICTIONS[name]
    src = Path(shutil.copytree(fixture_dir("k2-int4-kimi"), tmp_path / "src"))
    edit_config(src, edit)
    text = f"quantization_config says weights.{key} = {says}, the tensors are {actual}"
    code, rep = audit_json(src)
    assert code == 1
    named = [f for f in rep["failures"] if f["check"] == "scheme" and text in f["message"]]
    # Every routed expert projection of both MoE layers, each named by its tensor.
    assert len(named) == 2 * 16 * 3, rep["failures"]
    assert all(".mlp.experts." in f["tensor"] for f in named)
    dst = tmp_path / "out"
    res = cli_inproc("int4-to-nvfp4", src, dst, "--quiet")
    assert res.exit_code == 0, res.output
    warned = [line for line in res.output.splitlines() if text in line]
    assert len(warned) == 1 and warned[0].startswith("kconvert: warning:"), res.output
    assert "96 times" in warned[0] and "following the tensors" in warned[0]
    for args in ((), ("--source", src)):
        code, rep = audit_json(dst, *args)
        assert code == 0, rep["failures"]
