"""`kconvert audit --serve`: every kconvert output of the bundled fixture is READY for the
engines the README's loader table says read it, and each planted defect (a wrong prefix in the
ignore list, a reciprocal global scale, a zero W4A4 input scale, a BF16 routing bias, an MTP
layer with the unpruned expert count, an expert count no common EP size divides) makes the
right engine NOT READY, naming the file, the tensor and the engine's rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import BUNDLED
from helpers import INDEX, assert_user_error, cli_inproc, edit_json, edit_tensor, file_tensors
from kconvert.audit.serve import ENGINES
from kconvert.model.expert_parallel import ep_divisors

# (command, its options) -> the engines the README's loader table says read the output.
OUTPUTS = {
    "nvfp4-ct": (["int4-to-nvfp4"], ["vllm", "sglang"]),
    "nvfp4-modelopt": (["int4-to-nvfp4", "--format", "modelopt"], ["vllm", "sglang", "trtllm"]),
    "w4a4-ct": (["int4-to-nvfp4", "--input-scale", "one"], ["vllm", "sglang"]),
    "w4a4-modelopt": (["int4-to-nvfp4", "--format", "modelopt", "--input-scale", "one"],
                      ["vllm", "sglang", "trtllm"]),
    "mxfp4-quark": (["int4-to-mxfp4", "--format", "quark-mxfp4"], ["vllm", "sglang"]),
    "mxfp4-ct": (["int4-to-mxfp4", "--format", "mxfp4-pack-quantized"], ["vllm", "sglang"]),
    "p48-dense": (["sparsify", "--method", "magnitude"], ["vllm", "sglang"]),
    "bf16": (["dequant"], ["vllm", "sglang", "trtllm", "transformers"]),
    # MoESQ's patched vLLM only: no engine of the table
    "p48-32": (["sparsify", "--method", "magnitude", "--group-size", "32"], []),
    "p48-bitmask": (["sparsify", "--method", "magnitude", "--storage", "pair-bitmask"], []),
}


def plan_file(root: Path, keep: int) -> Path:
    path = root / f"plan-{keep}.json"
    path.write_text(json.dumps({"criterion": "manual", "layers": {
        str(layer): {"keep": list(range(keep))} for layer in (1, 2)}}))
    return path


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Each output: its directory and what its conversion printed."""
    root = tmp_path_factory.mktemp("serve")
    runs = {name: args for name, (args, _) in OUTPUTS.items()}
    for keep in (8, 15):
        # 15: what the ep-sizes check fails, written past reap's own refusal of it
        runs[f"pruned-{keep}"] = ["reap", "--plan", str(plan_file(root, keep)),
                                  "--allow-uneven-ep"]
    made = {}
    for name, args in runs.items():
        res = cli_inproc(args[0], BUNDLED, root / name, *args[1:], "--device", "cpu", "--quiet")
        assert res.exit_code == 0, res.output
        made[name] = (root / name, res.output)
    return made


@pytest.fixture(scope="module")
def outputs(printed) -> dict[str, Path]:
    return {name: path for name, (path, _) in printed.items()}


def test_a_conversion_warns_per_engine_not_ready(printed):
    """The same checks end every conversion: a warning line per NOT READY engine, no failure."""
    lines = [line for line in printed["pruned-15"][1].splitlines() if "NOT READY" in line]
    assert [line.split(" NOT READY")[0] for line in lines] == ["warning: vllm", "warning: sglang"]
    assert all("[ep-sizes]" in line and "--serve" in line for line in lines)
    assert all("NOT READY" not in out for name, (_, out) in printed.items() if name != "pruned-15")


def serve_audit(ckpt: Path, engines: str = "auto") -> tuple[int, dict]:
    res = cli_inproc("audit", ckpt, "--json", "--quiet", "--device", "cpu", "--serve", engines)
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)["serve"]


def failures(serve: dict, engine: str) -> list[dict]:
    return [c for c in serve[engine]["checks"] if not c["ok"]]


def copy_of(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def shard_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][tensor]


@pytest.mark.parametrize("name", [*OUTPUTS, "pruned-8"])
def test_every_output_is_ready_for_its_engines(outputs, name):
    code, serve = serve_audit(outputs[name])
    expected = OUTPUTS[name][1] if name in OUTPUTS else ["vllm", "sglang"]  # reap keeps INT4
    assert sorted(serve) == sorted(expected)
    assert {e: failures(serve, e) for e in serve} == {e: [] for e in serve}
    assert code == 0
    for engine in serve:  # every check the engine's table row lists ran, with its source
        ran = {c["name"]: c["source"] for c in serve[engine]["checks"]}
        assert ran == {k: v[1] for k, v in ENGINES[engine].items()}
        if "ep-sizes" in ran:  # the sizes that split the kept experts are listed
            experts = 8 if name.startswith("pruned") else 16
            assert [c["message"] for c in serve[engine]["checks"] if c["name"] == "ep-sizes"] \
                == [f"{experts} routed experts: expert-parallel sizes "
                    f"{', '.join(str(e) for e in range(1, 17) if experts % e == 0)} divide it"]


def test_an_engine_that_does_not_read_the_format_is_not_ready(outputs):
    code, serve = serve_audit(outputs["nvfp4-ct"], "trtllm,transformers")
    assert code == 1 and set(serve) == {"trtllm", "transformers"}
    for engine in serve:
        assert {c["name"] for c in failures(serve, engine)} == {"format"}
        assert "NVFP4 (compressed-tensors) is not read by" in failures(serve, engine)[0]["message"]


@pytest.mark.parametrize("name,says", [("p48-32", "96 NVFP4 matrices in blocks of 32"),
                                       ("p48-bitmask", "pair-bitmask (compressed-tensors) is "
                                                       "not read by vllm")])
def test_p48_layouts_no_stock_engine_reads(outputs, name, says):
    code, serve = serve_audit(outputs[name], "vllm")
    assert code == 1
    bad = failures(serve, "vllm")
    assert [c["name"] for c in bad] == ["format"] and says in bad[0]["message"]


def test_unknown_engine_is_a_usage_error(outputs):
    assert_user_error(cli_inproc("audit", outputs["bf16"], "--serve", "vllm,tgi"),
                      "unknown engine 'tgi'", code=2)


def test_exclude_list_with_a_wrapper_prefix(outputs, tmp_path):
    """SGLang PR #18370's defect: exclude entries under `language_model.` over plain names, so
    the engine quantizes the BF16 attention and dense MLP."""
    ckpt = copy_of(outputs["nvfp4-modelopt"], tmp_path)

    def wrap(entries: list[str]) -> list[str]:
        return ["language_model." + e for e in entries]

    edit_json(ckpt / "config.json", lambda c: c["quantization_config"].update(
        ignore=wrap(c["quantization_config"]["ignore"])))
    edit_json(ckpt / "hf_quant_config.json", lambda c: c["quantization"].update(
        exclude_modules=wrap(c["quantization"]["exclude_modules"])))
    code, serve = serve_audit(ckpt)
    assert code == 1 and set(serve) == {"vllm", "sglang", "trtllm"}
    for engine in serve:
        assert not serve[engine]["ready"]
        bad = failures(serve, engine)
        prefix = [c for c in bad if c["name"] == "name-prefix"]
        assert prefix and all(c["file"] == "config.json" for c in prefix)
        assert "begins with 'language_model'" in prefix[0]["message"]
        names = {c["tensor"]: c for c in bad if c["name"] == "quantized-names"}
        attn = names["model.layers.0.self_attn.o_proj.weight"]
        assert "stored unquantized" in attn["message"] and attn["file"] == "config.json"
        assert "is_layer_excluded" in attn["source"] or "excluded_from_quantization" in \
            attn["source"]
        assert {c["name"] for c in bad} == {"name-prefix", "quantized-names"}


@pytest.mark.parametrize("name,param,edit,says", [
    ("nvfp4-ct", "weight_global_scale", lambda t: 1.0 / t, "its reciprocal gives weights up to"),
    ("nvfp4-modelopt", "weight_scale_2", lambda t: 1.0 / t, "its reciprocal gives weights up to"),
    ("nvfp4-ct", "weight_global_scale", torch.zeros_like, "weight_global_scale = 0.0")])
def test_reciprocal_or_zero_global_scale(outputs, tmp_path, name, param, edit, says):
    ckpt = copy_of(outputs[name], tmp_path)
    tensor = f"model.layers.2.mlp.experts.3.up_proj.{param}"
    edit_tensor(shard_of(ckpt, tensor), tensor, edit)
    code, serve = serve_audit(ckpt)
    assert code == 1
    for engine in serve:
        bad = failures(serve, engine)
        assert [(c["name"], c["tensor"], c["file"]) for c in bad] == [
            ("global-scale", tensor, shard_of(ckpt, tensor).name)], bad
        assert says in bad[0]["message"]


def test_zero_input_scale_in_a_w4a4_output(outputs, tmp_path):
    ckpt = copy_of(outputs["w4a4-ct"], tmp_path)
    tensor = "model.layers.1.mlp.experts.7.down_proj.input_global_scale"
    edit_tensor(shard_of(ckpt, tensor), tensor, torch.zeros_like)
    code, serve = serve_audit(ckpt, "vllm")
    assert code == 1 and list(serve) == ["vllm"]
    bad = failures(serve, "vllm")
    assert [(c["name"], c["tensor"]) for c in bad] == [("input-scales", tensor)]
    assert bad[0]["file"] == shard_of(ckpt, tensor).name and "#45212" in bad[0]["source"]


def test_missing_input_scale_of_one_expert(outputs, tmp_path):
    """vLLM #45212: one routed expert without the input scale its layer's others have."""
    ckpt = copy_of(outputs["w4a4-modelopt"], tmp_path)
    gone = "model.layers.2.mlp.experts.11.gate_proj.input_scale"
    shard = shard_of(ckpt, gone)
    kept = {k: v for k, v in file_tensors(shard).items() if k != gone}
    save_file(kept, str(shard), metadata={"format": "pt"})
    edit_json(ckpt / INDEX, lambda index: index["weight_map"].pop(gone))
    code, serve = serve_audit(ckpt, "sglang,trtllm")
    assert code == 1
    for engine in ("sglang", "trtllm"):
        bad = failures(serve, engine)
        assert [(c["name"], c["tensor"]) for c in bad] == [
            ("input-scales", "model.layers.2.mlp.experts.11.gate_proj.weight")]
        assert "loads it as 0" in bad[0]["message"]


def test_bf16_routing_bias(outputs, tmp_path):
    ckpt = copy_of(outputs["bf16"], tmp_path)
    tensor = "model.layers.2.mlp.gate.e_score_correction_bias"
    edit_tensor(shard_of(ckpt, tensor), tensor, lambda t: t.to(torch.bfloat16))
    code, serve = serve_audit(ckpt)
    assert code == 1 and set(serve) == {"vllm", "sglang", "trtllm", "transformers"}
    for engine in serve:
        bad = failures(serve, engine)
        assert [(c["name"], c["tensor"]) for c in bad] == [("router-bias", tensor)]
        assert "stored BF16" in bad[0]["message"]
        assert "e_score_correction_bias" in bad[0]["source"]


def test_mtp_layer_with_the_unpruned_expert_count(outputs, tmp_path):
    """A pruned output (8 experts) given one MTP layer (layer 3) that holds the source's 16."""
    ckpt = copy_of(outputs["pruned-8"], tmp_path)
    source = {}
    for path in sorted(BUNDLED.glob("*.safetensors")):
        source.update({k: v for k, v in file_tensors(path).items()
                       if k.startswith("model.layers.2.mlp.")})
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in source.items()}
    shard = "model-mtp.safetensors"
    save_file(mtp, str(ckpt / shard), metadata={"format": "pt"})
    edit_json(ckpt / INDEX, lambda index: index["weight_map"].update(dict.fromkeys(mtp, shard)))
    edit_json(ckpt / "config.json", lambda c: c.update(num_nextn_predict_layers=1))
    code, serve = serve_audit(ckpt)
    assert code == 1
    for engine in ("vllm", "sglang"):
        counts = [c for c in failures(serve, engine) if c["name"] == "expert-counts"]
        assert [c["message"].split(":")[0] for c in counts] == [
            "MTP layer 3 holds 16 routed experts (ids 0..15), n_routed_experts is 8"]
        assert counts[0]["file"] == shard and "MTP" in counts[0]["source"]
        assert counts[0]["tensor"].startswith("model.layers.3.mlp.experts.8.")


def test_expert_count_no_common_ep_size_divides(outputs):
    code, serve = serve_audit(outputs["pruned-15"])
    assert code == 1 and set(serve) == {"vllm", "sglang"}
    for engine in serve:
        bad = failures(serve, engine)
        assert [c["name"] for c in bad] == ["ep-sizes"]
        assert "15 routed experts" in bad[0]["message"] and "only 1, 3, 5, 15" in \
            bad[0]["message"] and "#52435" in bad[0]["message"]


def test_ep_divisors_of_full_size_counts():
    assert ep_divisors(255) == [1, 3, 5, 15]  # a keep of 255: EP 2 does not split it
    assert ep_divisors(256) == [1, 2, 4, 8, 16]
    assert ep_divisors(384) == [1, 2, 3, 4, 6, 8, 12, 16]


@pytest.mark.parametrize("variant,fmt,engines", [
    ("k25-int4", "modelopt", ["vllm", "sglang", "trtllm"]),
    ("k26-int4", "compressed-tensors", ["vllm", "sglang"])])
def test_wrapper_outputs_are_ready(converted, variant, fmt, engines):
    """A K2.5/K2.6 wrapper's lists name `language_model.` and `vision_tower` modules, as its
    stored names do: no prefix mismatch."""
    _, out = converted(variant, "int4-to-nvfp4", format=fmt)
    code, serve = serve_audit(out)
    assert sorted(serve) == sorted(engines)
    assert {e: failures(serve, e) for e in serve} == {e: [] for e in serve} and code == 0
