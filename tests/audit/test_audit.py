"""`kconvert audit`: clean outputs pass, every tampering is caught and named, pruned checkpoints
made by a third-party script are audited against their source, memory stays bounded.

Tampering is done with plain file I/O (headers parsed here with struct + json, bytes patched in
place) or safetensors, never with kconvert's own readers, and expectations come from the
tampering itself (which layer/tensor/row was touched), never from a previous audit run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import ROOT
from helpers import audit_json, cli_inproc, st_header
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.formats.p48 import check_packed as p48_check
from kconvert.pruning.plan import PrunePlan, load_plan, plan_json_schema
from kconvert.stages.prune import prune_stage
from third_party_prune import prune

INDEX = "model.safetensors.index.json"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------ helpers (independent I/O)


def locate(ckpt: Path, name: str) -> tuple[Path, int, int, dict]:
    shard = json.loads((ckpt / INDEX).read_text())["weight_map"][name]
    header, base = st_header(ckpt / shard)
    start, end = header[name]["data_offsets"]
    return ckpt / shard, base + start, base + end, header[name]


def read_raw(ckpt: Path, name: str) -> bytes:
    path, start, end, _ = locate(ckpt, name)
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(end - start)


def write_raw(ckpt: Path, name: str, data: bytes) -> None:
    path, start, end, _ = locate(ckpt, name)
    assert len(data) == end - start
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(data)


def tensor(ckpt: Path, name: str) -> torch.Tensor:
    path, _, _, _ = locate(ckpt, name)
    with safe_open(str(path), "pt") as fh:
        return fh.get_tensor(name)


def rewrite_shard(ckpt: Path, shard: str, edit, update_index: bool = True) -> None:
    """Load one shard with safetensors, let `edit` change the dict, save it (and the index)."""
    with safe_open(str(ckpt / shard), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors = edit(tensors)
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    if update_index:
        index = json.loads((ckpt / INDEX).read_text())
        wm = {k: v for k, v in index["weight_map"].items() if v != shard}
        wm.update({k: shard for k in tensors})
        index["weight_map"] = dict(sorted(wm.items()))
        (ckpt / INDEX).write_text(json.dumps(index, indent=2))


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def failures(report: dict, group: str, check: str | None = None) -> list[dict]:
    return [f for f in report["failures"] if f["group"] == group
            and (check is None or f["check"] == check)]


def assert_named(report: dict, group: str, check: str, *, layer: int | None = None,
                 tensor: str | None = None, file: str | None = None, text: str = "") -> dict:
    """A failure of this group/check names the layer, the tensor/file and says `text`."""
    found = failures(report, group, check)
    for f in found:
        if (layer is None or f.get("layer") == layer) and (
                tensor is None or tensor in f.get("tensor", "")) and (
                file is None or f.get("file") == file) and text in f["message"]:
            return f
    got = json.dumps(report["failures"], indent=1)
    raise AssertionError(f"no {group}/{check} failure with layer={layer} tensor~{tensor} "
                         f"file={file} text~{text!r}; got {got}")


def rehash_generated(ckpt: Path) -> None:
    """After deliberately editing config files, record their new hashes in the manifest (so
    that only the check under test can object)."""
    path = ckpt / "kconvert-manifest.json"
    man = json.loads(path.read_text())
    for name in man.get("generated_files", {}):
        man["generated_files"][name] = xxhash.xxh3_128((ckpt / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(man))


def run(src: Path, dst: Path, recipe: str, plan: Path | None = None, **options) -> Path:
    prepare = None
    if plan is not None:  # the reap command's path for a given --plan
        prepare = lambda ckpt: {"prune": prune_stage(load_plan(plan), ckpt)}  # noqa: E731
    convert(str(src), str(dst), load_recipe(recipe), options, RunControl(quiet=True),
            prepare=prepare)
    return dst


# A REAP plan for the 16-expert fixtures: kept source ids per MoE layer, ascending.
REAP_KEEP = {"1": [0, 2, 3, 5, 8, 9, 12, 15], "2": [1, 2, 4, 6, 7, 10, 11, 14]}


# ------------------------------------------------------------------ fixtures


RECIPES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.toml"))
# Every command (with the options that change what it writes) and every built-in recipe.
OUTPUTS = [
    "int4-to-nvfp4-ct", "int4-to-nvfp4-amax", "int4-to-nvfp4-modelopt", "k25-int4-to-nvfp4-ct",
    "quantize-ct", "quantize-modelopt-all", "dequant-int4", "dequant-int4-f32", "dequant-nvfp4",
    "reap", "reap-int4-to-nvfp4", "sparsify-dense-16", "sparsify-dense-32",
    "sparsify-pair-bitmask-16", "sparsify-pair-bitmask-32", "densify",
    *(f"run-{r}" for r in RECIPES)]


@pytest.fixture(scope="module")
def outputs(fixture_dir, tmp_path_factory):
    """Every command and recipe, on the fixtures: name -> (output, source)."""
    root = tmp_path_factory.mktemp("audit-outputs")
    kimi, ct, k25, bf16 = (fixture_dir(v) for v in ("k2-int4-kimi", "k2-int4-ct", "k25-int4",
                                                    "bf16"))
    made = {
        "int4-to-nvfp4-ct": (run(kimi, root / "a", "int4-to-nvfp4"), kimi),
        "int4-to-nvfp4-amax": (run(kimi, root / "a2", "int4-to-nvfp4", block_scale="amax"),
                               kimi),
        "int4-to-nvfp4-modelopt": (run(ct, root / "b", "int4-to-nvfp4", format="modelopt"), ct),
        "k25-int4-to-nvfp4-ct": (run(k25, root / "c", "int4-to-nvfp4"), k25),
        "quantize-ct": (run(bf16, root / "e", "quantize"), bf16),
        "quantize-modelopt-all": (run(bf16, root / "f", "quantize", format="modelopt",
                                      targets="experts,shared_experts,dense_mlp,attention"),
                                  bf16),
        "dequant-int4": (run(ct, root / "g", "dequant"), ct),
        "dequant-int4-f32": (run(kimi, root / "g2", "dequant", dtype="F32"), kimi),
    }
    made["dequant-nvfp4"] = (run(made["int4-to-nvfp4-ct"][0], root / "h", "dequant"),
                             made["int4-to-nvfp4-ct"][0])
    plan = root / "reap-plan.json"
    plan.write_text(json.dumps({"criterion": "manual", "layers": {
        k: {"keep": v} for k, v in REAP_KEEP.items()}}))
    made["reap"] = (run(kimi, root / "i", "reap", plan=plan), kimi)
    made["reap-int4-to-nvfp4"] = (run(k25, root / "j", "reap-int4-to-nvfp4", plan=plan), k25)
    for storage in ("dense", "pair-bitmask"):
        for group in (16, 32):
            name = f"sparsify-{storage}-{group}"
            made[name] = (run(kimi, root / name, "sparsify", storage=storage, group_size=group),
                          kimi)
    bitmask = made["sparsify-pair-bitmask-16"][0]
    made["densify"] = (run(bitmask, root / "densify", "densify"), bitmask)
    for recipe in RECIPES:  # as `kconvert run NAME` runs them
        spec = load_recipe(recipe)
        src = {"nvfp4-pair-bitmask": bitmask,
               "mxfp4": made.get("run-int4-to-mxfp4", (kimi,))[0]}.get(spec.requires_source, kimi)
        prunes = any(s.get("stage") == "prune" for s in spec.stages)
        dst = root / f"run-{recipe}"
        res = cli_inproc("run", recipe, src, dst, "--quiet",
                         *(["--plan", str(plan)] if prunes else []))
        assert res.exit_code == 0, res.output
        made[f"run-{recipe}"] = (dst, src)
    assert sorted(made) == sorted(OUTPUTS)
    return made


@pytest.fixture(scope="module")
def pruned(fixture_dir, tmp_path_factory):
    """The third-party pruned checkpoint (8 of 16 experts per layer) and its plan."""
    src = fixture_dir("k2-int4-kimi")
    root = tmp_path_factory.mktemp("pruned")
    plan = prune(src, root / "pruned", keep=8, rule="router-l2")
    (root / "plan.json").write_text(json.dumps(plan))
    return root / "pruned", src, root / "plan.json", plan


# ------------------------------------------------------------------ plan file and schema


def test_committed_plan_schema_is_current():
    committed = json.loads((ROOT / "manifests" / "plan.schema.json").read_text())
    assert committed == plan_json_schema(), (
        "regenerate: python -m kconvert.plan > manifests/plan.schema.json")
    layer = committed["$defs"]["PruneLayer"]["properties"]
    assert {"keep", "saliency", "frequency"} <= set(layer)
    assert {"criterion", "layers"} <= set(committed["properties"])


def test_plan_validation(tmp_path):
    ok = PrunePlan.model_validate({"criterion": "reap", "layers": {
        "1": {"keep": [0, 2, 5], "saliency": [1, 0, 2, 0, 0, 3], "frequency": [4, 0, 1, 0, 0, 2]}}})
    assert ok.keep(1) == [0, 2, 5] and ok.keep(2) is None
    for bad in ({"layers": {"1": {"keep": [2, 1]}}},  # not ascending
                {"layers": {"1": {"keep": [1, 1]}}},  # duplicate
                {"layers": {"1": {"keep": [0, 9], "saliency": [0.0] * 4}}},  # beyond source
                {"layers": {"x": {"keep": [0]}}},  # not a layer index
                {"n_routed_experts": 4, "layers": {"1": {"keep": [0, 4]}}}):
        path = tmp_path / "p.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(Exception, match="invalid plan") as info:
            load_plan(path)
        # one line naming the field, without pydantic's boilerplate
        said = str(info.value)
        assert "\n" not in said and "errors.pydantic.dev" not in said and "[type=" not in said
        assert "layer" in said and "Value error" not in said, said
    path.write_text(json.dumps({"layers": {"1": {"keep": "x"}}}))
    with pytest.raises(Exception, match=r"invalid plan: layers\.1\.keep: Input should be"):
        load_plan(path)


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


# ------------------------------------------------------------------ 2. tampering


def test_flipped_byte_in_kept_router_row(pruned, outputs, tmp_path):
    out, src, plan_path, plan = pruned
    bad = copy(out, tmp_path / "pruned")
    name = "model.layers.1.mlp.gate.weight"
    raw = bytearray(read_raw(bad, name))
    row_bytes = len(raw) // 8
    raw[3 * row_bytes + 17] ^= 0x01  # row 3, one byte
    write_raw(bad, name, bytes(raw))
    code, rep = audit_json(bad, "--source", str(src), "--plan", str(plan_path))
    assert code == 1
    f = assert_named(rep, "source", "router", layer=1, tensor=name,
                     text=f"row 3 differs from source row {plan['layers']['1']['keep'][3]}")
    assert len(failures(rep, "source", "router")) == 1, f
    # Without a plan the row can no longer be matched to any source row.
    _, rep = audit_json(bad, "--source", str(src))
    assert_named(rep, "source", "router", layer=1, tensor=name, text="row 3 equals no source")

    # In a kconvert output the manifest's hash catches it even without the source.
    out2 = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    raw = bytearray(read_raw(out2, name))
    raw[5 * (len(raw) // 16)] ^= 0x80
    write_raw(out2, name, bytes(raw))
    _, rep = audit_json(out2)
    assert_named(rep, "manifest", "hash", layer=1, tensor=name)


def test_one_bias_entry_changed(pruned, tmp_path):
    out, src, plan_path, plan = pruned
    bad = copy(out, tmp_path / "pruned")
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    b = tensor(bad, name).clone()
    b[5] += 1e-3
    write_raw(bad, name, b.numpy().tobytes())
    code, rep = audit_json(bad, "--source", str(src), "--plan", str(plan_path))
    assert code == 1
    kept = plan["layers"]["2"]["keep"][5]
    assert_named(rep, "source", "bias", layer=2, tensor=name,
                 text=f"entry 5 = {float(b[5])!r} but source entry {kept}")
    assert len(rep["failures"]) == 1


def _swap_experts(ckpt: Path, layer: int, a: int, b: int) -> list[str]:
    names = [n for n in json.loads((ckpt / INDEX).read_text())["weight_map"]
             if f"layers.{layer}.mlp.experts.{a}." in n]
    for na in names:
        nb = na.replace(f".experts.{a}.", f".experts.{b}.")
        ra, rb = read_raw(ckpt, na), read_raw(ckpt, nb)
        write_raw(ckpt, na, rb)
        write_raw(ckpt, nb, ra)
    return names


def test_two_experts_swapped(outputs, pruned, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    src = outputs["int4-to-nvfp4-ct"][1]
    names = _swap_experts(out, 2, 3, 5)
    _, rep = audit_json(out)
    for n in names:  # every swapped tensor named, both ways
        assert_named(rep, "manifest", "hash", layer=2, tensor=n)
        assert_named(rep, "manifest", "hash", layer=2, tensor=n.replace(".3.", ".5."))
    # No manifest: against the source every decode of experts 3 and 5 is far off.
    (out / "kconvert-manifest.json").unlink()
    _, rep = audit_json(out, "--source", str(src))
    for e in (3, 5):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert_named(rep, "source", "decode", layer=2,
                         tensor=f"model.layers.2.mlp.experts.{e}.{proj}.weight_packed",
                         text=f"source decode of model.layers.2.mlp.experts.{e}.{proj}")
    assert len(failures(rep, "source", "decode")) == 6
    # Same format (pruned INT4): byte comparison names them.
    bad = copy(pruned[0], tmp_path / "pruned")
    _swap_experts(bad, 1, 0, 6)
    _, rep = audit_json(bad, "--source", str(pruned[1]), "--plan", str(pruned[2]))
    assert_named(rep, "source", "bytes", layer=1, tensor="model.layers.1.mlp.experts.0.",
                 text="must be byte-identical")
    assert_named(rep, "source", "bytes", layer=1, tensor="model.layers.1.mlp.experts.6.")


def test_expert_id_gap(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    shard = json.loads((out / INDEX).read_text())["weight_map"]["model.layers.1.mlp.gate.weight"]
    rewrite_shard(out, shard, lambda t: {k.replace("layers.1.mlp.experts.7.",
                                                   "layers.1.mlp.experts.16."): v
                                         for k, v in t.items()})
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "structure", "expert-ids", layer=1, text="missing 7; unexpected 16")
    assert rep["layers"]["1"]["ids"] == "gap: 7"


def test_stale_index_entry(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    index = json.loads((out / INDEX).read_text())
    wm = index["weight_map"]
    moved = "model.layers.1.self_attn.o_proj.weight"
    right = wm[moved]
    wrong = wm["model.layers.2.mlp.gate.weight"]
    wm[moved] = wrong
    wm["model.layers.1.mlp.experts.16.up_proj.weight_packed"] = right  # pruned long ago
    (out / INDEX).write_text(json.dumps(index))
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "structure", "index", layer=1, tensor=moved, file=wrong,
                 text=f"maps it to {wrong} but it is in {right}")
    assert_named(rep, "structure", "index", layer=1,
                 tensor="model.layers.1.mlp.experts.16.up_proj.weight_packed", file=right,
                 text="does not hold it")


def test_files_nothing_accounts_for(outputs, tmp_path):
    """With a manifest: an unknown file warns, an unknown *.safetensors fails (indexed or not,
    at the top or below); kconvert's temporary names fail with or without a manifest."""
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    (out / "notes.txt").write_text("mine")
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    assert any(w["check"] == "non-weight" and w["file"] == "notes.txt" for w in rep["warnings"])
    extra = {"extra.safetensors", "sub/more.safetensors"}
    for rel in extra:
        (out / rel).parent.mkdir(exist_ok=True)
        save_file({"w": torch.zeros(2)}, str(out / rel))
    temps = {"tokenizer_config.json.kconvert-tmp", "kconvert-manifest.json.tmp"}
    for rel in temps:
        (out / rel).write_text("{}")
    code, rep = audit_json(out)
    assert code == 1
    assert {f["file"] for f in failures(rep, "manifest", "files")} == extra
    assert {f["file"] for f in failures(rep, "structure", "incomplete")} == temps
    assert len(rep["failures"]) == len(extra) + len(temps), rep["failures"]
    # Without a manifest nothing says what belongs; the temporaries still fail.
    (out / "kconvert-manifest.json").unlink()
    code, rep = audit_json(out)
    assert code == 1
    assert {f["file"] for f in rep["failures"]} == temps, rep["failures"]


def test_tensor_missing_from_a_shard(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "ct")
    name = "model.layers.2.mlp.experts.4.up_proj.weight_scale"
    shard = json.loads((out / INDEX).read_text())["weight_map"][name]
    rewrite_shard(out, shard, lambda t: {k: v for k, v in t.items() if k != name},
                  update_index=False)
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "structure", "index", layer=2, tensor=name, file=shard,
                 text="tensor missing from its shard")
    assert_named(rep, "structure", "experts", layer=2,
                 tensor="model.layers.2.mlp.experts.4.up_proj", text="missing ['weight_scale']")


def test_n_routed_experts_edited(outputs, tmp_path):
    out = copy(outputs["k25-int4-to-nvfp4-ct"][0], tmp_path / "k25")
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["n_routed_experts"] = 15
    (out / "config.json").write_text(json.dumps(cfg))
    code, rep = audit_json(out)
    assert code == 1
    for layer in (1, 2):
        assert_named(rep, "structure", "counts", layer=layer,
                     tensor=f"language_model.model.layers.{layer}.mlp.gate.weight",
                     text="n_routed_experts = 15, expert ids = 16, router rows = 16")
        assert_named(rep, "structure", "expert-ids", layer=layer, text="unexpected 15")
    # The manifest records config.json's hash: the edit is caught there too.
    assert_named(rep, "manifest", "generated", file="config.json")


@pytest.mark.parametrize("name,param", [("int4-to-nvfp4-ct", "weight_global_scale"),
                                        ("int4-to-nvfp4-modelopt", "weight_scale_2")])
def test_gate_up_global_scales_different(outputs, tmp_path, name, param):
    out = copy(outputs[name][0], tmp_path / "o")
    gate = f"model.layers.1.mlp.experts.2.gate_proj.{param}"
    up = f"model.layers.1.mlp.experts.2.up_proj.{param}"
    assert torch.equal(tensor(out, gate), tensor(out, up))  # shared before tampering
    t = tensor(out, up) * 1.5
    write_raw(out, up, t.numpy().tobytes())
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "scales", "fused-scale", layer=1,
                 tensor="model.layers.1.mlp.experts.2.up_proj",
                 text="fused set model.layers.1.mlp.experts.2.gate_up_proj must share one")
    assert len(failures(rep, "scales", "fused-scale")) == 1
    assert rep["layers"]["1"]["scales"] == "1 bad"


def test_negative_and_nan_scales(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "o")
    block = "model.layers.2.mlp.experts.9.down_proj.weight_scale"
    raw = bytearray(read_raw(out, block))
    raw[10] |= 0x80  # negative FP8 block scale at element 10
    raw[11] = 0x7F  # FP8 NaN at element 11
    write_raw(out, block, bytes(raw))
    _, rep = audit_json(out)
    cols = locate(out, block)[3]["shape"][1]
    assert_named(rep, "scales", "scale-values", layer=2, tensor=block,
                 text=f"negative FP8 block scale(s), first at element [{10 // cols}, {10 % cols}]")
    assert_named(rep, "scales", "finite", layer=2, tensor=block,
                 text=f"first at element [{11 // cols}, {11 % cols}]")


def test_changed_non_weight_file(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "o")
    path = out / "tokenizer_config.json"
    path.write_text(path.read_text().replace("262144", "131072"))
    _, rep = audit_json(out)
    assert_named(rep, "manifest", "non-weight", file="tokenizer_config.json",
                 text="content changed")
    (out / "kconvert-manifest.json").unlink()
    _, rep = audit_json(out, "--source", str(outputs["int4-to-nvfp4-ct"][1]))
    assert_named(rep, "source", "non-weight", file="tokenizer_config.json",
                 text="differs from the source")
    assert len(rep["failures"]) == 1


def test_stale_int4_block_in_text_config(outputs, tmp_path):
    out, src = outputs["k25-int4-to-nvfp4-ct"]
    out = copy(out, tmp_path / "k25")
    cfg = json.loads((out / "config.json").read_text())
    stale = json.loads((src / "config.json").read_text())["text_config"]["quantization_config"]
    assert stale["format"] == "pack-quantized"
    cfg["quantization_config"] = cfg["text_config"]["quantization_config"]  # the NVFP4 block
    cfg["text_config"]["quantization_config"] = stale
    (out / "config.json").write_text(json.dumps(cfg))
    code, rep = audit_json(out)
    assert code == 1
    assert_named(rep, "quant-config", "format", file="config.json",
                 text="top-level quantization_config and text_config.quantization_config differ")
    for layer in (1, 2):
        assert_named(rep, "quant-config", "format", layer=layer,
                     tensor=f"language_model.model.layers.{layer}.mlp.experts.0.gate_proj",
                     text="text_config.quantization_config gives this module INT4 pack-quantized "
                          "but its tensors are NVFP4 (compressed-tensors)")
    # The top-level block is right: no module is blamed on it.
    assert not [f for f in failures(rep, "quant-config", "format")
                if f["message"].startswith("quantization_config")]


def test_excluded_modules_carry_no_scales(outputs, tmp_path):
    """A ModelOpt-excluded linear that has scale tensors is named (vLLM #45102)."""
    out = copy(outputs["int4-to-nvfp4-modelopt"][0], tmp_path / "o")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    # hf_quant_config.json spells it exclude_modules; config.json's block (ModelOpt's export
    # shape) spells it ignore.
    hf["quantization"]["exclude_modules"].append("model.layers.2.mlp.experts.1.*")
    cfg["quantization_config"]["ignore"].append("model.layers.2.mlp.experts.1.*")
    (out / "hf_quant_config.json").write_text(json.dumps(hf))
    (out / "config.json").write_text(json.dumps(cfg))
    rehash_generated(out)
    _, rep = audit_json(out)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert_named(rep, "quant-config", "format", layer=2,
                     tensor=f"model.layers.2.mlp.experts.1.{proj}",
                     text="gives this module unquantized (no scale tensors)")
    assert not failures(rep, "quant-config", "hf_quant_config")


def test_modelopt_weight_only_spelling(outputs, tmp_path):
    """ModelOpt quant_algo NVFP4 is W4A4: modules without input_scale are warned about (not a
    failure); the weight-only spelling W4A16_NVFP4 is accepted without a warning."""
    out = copy(outputs["int4-to-nvfp4-modelopt"][0], tmp_path / "o")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    names = json.loads((out / INDEX).read_text())["weight_map"]
    has_input = any(n.endswith(".input_scale") for n in names)
    code, rep = audit_json(out)
    warned = [w for w in rep["warnings"] if w["check"] == "scheme"]
    assert code == 0
    assert bool(warned) == (hf["quantization"]["quant_algo"] == "NVFP4" and not has_input)
    cfg = json.loads((out / "config.json").read_text())
    for block in (hf["quantization"], cfg["quantization_config"]):
        block["quant_algo"] = "W4A16_NVFP4"
    (out / "hf_quant_config.json").write_text(json.dumps(hf))
    (out / "config.json").write_text(json.dumps(cfg))
    rehash_generated(out)
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    assert not [w for w in rep["warnings"] if w["check"] == "scheme"]


# ------------------------------------------------------------------ p48


def _reference_p48(packed: torch.Tensor) -> tuple[int, int]:
    """Plain loops over chunks: (chunks with > 2 nonzero pairs, chunks with > 2 non-0x00 bytes
    but <= 2 nonzero pairs)."""
    over = negz = 0
    for row in packed.tolist():
        for c in range(0, len(row), 4):
            chunk = row[c:c + 4]
            nonzero = sum(1 for b in chunk if b & 0x77)
            stored = sum(1 for b in chunk if b)
            over += nonzero > 2
            negz += nonzero <= 2 < stored
    return over, negz


def test_p48_check_on_crafted_bytes():
    g = torch.Generator().manual_seed(0)
    rows, chunks = 6, 10
    packed = torch.zeros(rows, chunks * 4, dtype=torch.uint8)
    masks = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # the 6 valid pair masks
    for r in range(rows):
        for c in range(chunks):
            for p in masks[(r + c) % 6]:
                packed[r, 4 * c + p] = int(torch.randint(1, 256, (), generator=g)) | 0x01
    ok = p48_check(packed)
    assert ok.ok and ok.chunks == rows * chunks
    # A kept pair that quantized to -0 (0x08) next to one nonzero pair is still valid.
    valid = packed.clone()
    valid[0, 0:4] = torch.tensor([0x08, 0x00, 0x35, 0x00], dtype=torch.uint8)
    assert p48_check(valid).ok
    # 3 nonzero pairs in row 4, chunk 7.
    bad = packed.clone()
    bad[4, 28:32] = torch.tensor([0x12, 0x70, 0x00, 0x07], dtype=torch.uint8)
    res = p48_check(bad)
    assert (res.over_two, res.neg_zero) == (1, 0)
    assert res.first == (4, 7, [0x12, 0x70, 0x00, 0x07])
    # A pruned pair stored as -0 (0x80) beside two nonzero pairs: row 2, chunk 3.
    negz = packed.clone()
    chunk = negz[2, 12:16]
    zero_slot = int((chunk == 0).nonzero()[0])
    chunk[zero_slot] = 0x80
    res = p48_check(negz)
    assert (res.over_two, res.neg_zero) == (0, 1) and res.first[:2] == (2, 3)
    # Random bytes: counts agree with the plain-loop reference.
    noise = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    noise[noise < 128] = 0
    res = p48_check(noise)
    assert (res.over_two, res.neg_zero) == _reference_p48(noise)
    assert res.over_two + res.neg_zero > 0


def _p48_prune_bytes(raw: bytes) -> bytes:
    """Keep the 2 pairs (bytes) of largest code magnitude in each chunk of 4, zero the rest."""
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, 4)
    mag = (t & 0x7) + ((t >> 4) & 0x7)
    order = torch.argsort(mag.int() * 4 - torch.arange(4), dim=1, descending=True)
    keep = torch.zeros_like(t, dtype=torch.bool).scatter_(1, order[:, :2], True)
    return bytes(torch.where(keep, t, 0).numpy())


def test_p48_declared_in_manifest_is_checked(outputs, tmp_path):
    out = copy(outputs["int4-to-nvfp4-ct"][0], tmp_path / "o")
    man_path = out / "kconvert-manifest.json"
    man = json.loads(man_path.read_text())
    packed = [n for n in man["tensors"] if ".mlp.experts." in n and n.endswith("weight_packed")]
    for n in packed:
        data = _p48_prune_bytes(read_raw(out, n))
        write_raw(out, n, data)
        man["tensors"][n]["hash"] = xxhash.xxh3_128(data).hexdigest()
    # What the sparsify stage records (a typed SparsifyRecord: the audit reads its fields).
    man["options"]["sparsify"] = {"pattern": "p48", "method": "magnitude", "group_size": 16,
                                  "storage": "dense", "targets": ["routed_expert"]}
    man_path.write_text(json.dumps(man))
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]
    assert rep["checks"]["p48"]["run"] == sum(
        man["tensors"][n]["shape"][0] * man["tensors"][n]["shape"][1] // 4 for n in packed)
    # One chunk given a third nonzero pair (the manifest hash updated so only p48 can object).
    victim = "model.layers.2.mlp.experts.11.down_proj.weight_packed"
    raw = bytearray(read_raw(out, victim))
    row_bytes = locate(out, victim)[3]["shape"][1]
    # The first chunk from row 5 on with exactly 2 nonzero pairs gets a third.
    at = next(c for c in range(5 * row_bytes, len(raw), 4)
              if sum(1 for b in raw[c:c + 4] if b & 0x77) == 2)
    row, chunk = at // row_bytes, (at % row_bytes) // 4
    slot = next(i for i in range(4) if raw[at + i] == 0)
    raw[at + slot] = 0x21
    write_raw(out, victim, bytes(raw))
    man["tensors"][victim]["hash"] = xxhash.xxh3_128(bytes(raw)).hexdigest()
    man_path.write_text(json.dumps(man))
    code, rep = audit_json(out)
    assert code == 1
    f = assert_named(rep, "p48", "pattern", layer=2, tensor=victim,
                     text=f"first: row {row}, chunk {chunk} (elements {8 * chunk}..{8 * chunk + 7})"
                          " has 3 or more nonzero pairs")
    assert len(rep["failures"]) == 1, f


# ------------------------------------------------------------------ 3. third-party pruning


def test_third_party_pruned_checkpoint_with_plan(pruned):
    out, src, plan_path, plan = pruned
    assert not (out / "kconvert-manifest.json").exists()
    code, rep = audit_json(out, "--source", str(src), "--plan", str(plan_path))
    assert code == 0, rep["failures"]
    for layer, entry in plan["layers"].items():
        assert rep["mapping"][layer] == {"mode": "plan", "source_ids": entry["keep"]}
        assert rep["layers"][layer]["experts"] == "8/16"
    assert any("taken from the plan" in n for n in rep["notes"])
    # Independently: the pruned router rows are the plan's source rows.
    for layer, entry in plan["layers"].items():
        name = f"model.layers.{layer}.mlp.gate.weight"
        assert torch.equal(tensor(out, name), tensor(src, name)[entry["keep"]])
    # Alone, the pruned checkpoint is structurally sound.
    code, rep = audit_json(out)
    assert code == 0, rep["failures"]


def test_third_party_pruned_checkpoint_without_plan_infers_mapping(pruned):
    out, src, _, plan = pruned
    code, rep = audit_json(out, "--source", str(src))
    assert code == 0, rep["failures"]
    for layer, entry in plan["layers"].items():
        assert rep["mapping"][layer] == {"mode": "inferred", "source_ids": entry["keep"]}
    assert any("INFERRED by matching router rows" in n for n in rep["notes"])


def test_wrong_plan_is_caught(pruned, tmp_path):
    out, src, _, plan = pruned
    keep = plan["layers"]["2"]["keep"]
    dropped = next(e for e in range(16) if e not in keep)
    wrong_keep = sorted([*keep[:3], dropped, *keep[4:]])
    position = wrong_keep.index(dropped)
    wrong = {"criterion": "oops", "layers": {**plan["layers"], "2": {"keep": wrong_keep}}}
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(wrong))
    code, rep = audit_json(out, "--source", str(src), "--plan", str(path))
    assert code == 1
    assert_named(rep, "source", "router", layer=2, tensor="model.layers.2.mlp.gate.weight",
                 text=f"row {position} differs from source row {dropped} chosen by the plan")
    assert all(f["layer"] == 2 for f in rep["failures"])
    # A plan keeping the wrong number of experts is named too.
    short = {"layers": {**plan["layers"], "1": {"keep": plan["layers"]["1"]["keep"][:6]}}}
    path.write_text(json.dumps(short))
    _, rep = audit_json(out, "--source", str(src), "--plan", str(path))
    assert_named(rep, "source", "plan", layer=1, text="the plan keeps 6 experts")


def test_pruned_then_converted_against_original_source(pruned, tmp_path):
    """Prune (third party) -> int4-to-nvfp4 (kconvert): kept experts decode within the
    manifest's error of the ORIGINAL source's experts the plan chose."""
    out, src, plan_path, _ = pruned
    conv = run(out, tmp_path / "conv", "int4-to-nvfp4")
    code, rep = audit_json(conv, "--source", str(src), "--plan", str(plan_path))
    assert code == 0, rep["failures"]
    assert rep["layers"]["1"]["compared"] == 8 * 3
    # And against the wrong expert it would not be.
    wrong = json.loads(plan_path.read_text())
    keep = wrong["layers"]["1"]["keep"]
    other = next(e for e in range(16) if e not in keep)
    wrong["layers"]["1"]["keep"] = sorted([*keep[1:], other])
    pos = wrong["layers"]["1"]["keep"].index(other)
    (tmp_path / "w.json").write_text(json.dumps(wrong))
    _, rep = audit_json(conv, "--source", str(src), "--plan", str(tmp_path / "w.json"))
    assert_named(rep, "source", "decode", layer=1, tensor=f"model.layers.1.mlp.experts.{pos}.",
                 text=f"source decode of model.layers.1.mlp.experts.{other}.")


def test_unaccounted_source_tensor(pruned, tmp_path):
    out, src, plan_path, _ = pruned
    bad = copy(out, tmp_path / "pruned")
    name = "model.layers.1.self_attn.kv_a_layernorm.weight"
    shard = json.loads((bad / INDEX).read_text())["weight_map"][name]
    rewrite_shard(bad, shard, lambda t: {k: v for k, v in t.items() if k != name})
    _, rep = audit_json(bad, "--source", str(src), "--plan", str(plan_path))
    assert_named(rep, "source", "accounting", layer=1, tensor=name,
                 text="source tensor has no counterpart")


# ------------------------------------------------------------------ 4. memory


PROBE = ("import resource, subprocess, sys; "
         "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
         "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _peak_rss_mb(cmd: list[str]) -> tuple[int, float]:
    """Peak RSS of `cmd`, measured in a probe process that runs nothing else."""
    res = subprocess.run([sys.executable, "-c", PROBE, *cmd], capture_output=True, text=True,
                         check=True)
    rc, kib = res.stdout.split()
    return int(rc), int(kib) / 1024


def test_memory_stays_bounded_with_large_shards(fixture_dir, tmp_path):
    """A 384 MB shard (embed_tokens and lm_head of 192 MB each): audit with default settings,
    hashing every tensor against a manifest and comparing every byte with a source, stays
    within 128 MB above an import-only process, a third of that one shard (measured: ~80 MB)."""
    from kconvert.records.manifest import FileEntry, Manifest, SourceEntry, TensorEntry

    bound_mb, vocab = 128, 3 << 18
    ckpt = copy(fixture_dir("bf16"), tmp_path / "big")
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] = vocab
    (ckpt / "config.json").write_text(json.dumps(config))
    hidden = config["hidden_size"]
    shard = json.loads((ckpt / INDEX).read_text())["weight_map"]["lm_head.weight"]
    # Random 8 MB blocks tiled (what the values are does not matter here, only their size).
    g = torch.Generator().manual_seed(0)
    block = torch.randn(1 << 22, generator=g).bfloat16()
    tiles = vocab * hidden // block.numel()
    rewrite_shard(ckpt, shard, lambda t: {
        **t, "model.embed_tokens.weight": block.repeat(tiles).reshape(vocab, hidden),
        "lm_head.weight": (block * 0.1).repeat(tiles).reshape(vocab, hidden)})
    sizes = {p.name: p.stat().st_size for p in ckpt.glob("*.safetensors")}
    assert max(sizes.values()) > 3 * bound_mb * 2**20, sizes
    # A manifest computed here: xxh3 of raw bytes read straight from the files.
    tensors, files = {}, {}
    for name_ in sorted(sizes):
        header, base = st_header(ckpt / name_)
        header.pop("__metadata__", None)
        files[name_] = FileEntry(bytes=sizes[name_], tensors=len(header))
        with open(ckpt / name_, "rb") as fh:
            for name, e in header.items():
                fh.seek(base + e["data_offsets"][0])
                h, left = xxhash.xxh3_128(), e["data_offsets"][1] - e["data_offsets"][0]
                while left:
                    block = fh.read(min(left, 8 << 20))
                    h.update(block)
                    left -= len(block)
                tensors[name] = TensorEntry(file=name_, dtype=e["dtype"], shape=e["shape"],
                                            hash=h.hexdigest(), stage="copy", sources=[name])
    others = {p.name: xxhash.xxh3_128(p.read_bytes()).hexdigest() for p in ckpt.iterdir()
              if p.suffix != ".safetensors" and p.name not in (INDEX, "config.json")}
    man = Manifest(tool={"name": "test"}, command="copy", options={},
                   source=SourceEntry(path=str(ckpt)), output_format="bf16", files=files,
                   non_weight_files=others, tensors=tensors, fused_sets={}, layers={},
                   summary={"tensors": len(tensors)})
    (ckpt / "kconvert-manifest.json").write_text(man.model_dump_json())

    rc, base = _peak_rss_mb([sys.executable, "-c",
                             "import kconvert.cli, kconvert.audit.auditor, tqdm, xxhash"])
    assert rc == 0
    rc, peak = _peak_rss_mb([sys.executable, "-c",
                             "import sys; from kconvert.cli import main; "
                             "main(['audit', *sys.argv[1:]])",
                             str(ckpt), "--source", str(ckpt), "--quiet", "--device", "cpu"])
    assert rc == 0, "audit of the big checkpoint did not pass"
    assert peak - base < bound_mb, f"audit peak {peak:.0f} MB vs import-only {base:.0f} MB"
