"""The house rules, checked on the package's source: no import circles, no private name used
across modules, no module over 500 lines, and every document the code cites is in docs/."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "kconvert"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported kconvert module, names taken from it, line) for every import in the file,
    at any depth (a function's lazy import still makes a dependency)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            names = [a.name for a in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in modules]
            others = [n for n in names if f"{node.module}.{n}" not in modules]
            out += [(m, [], node.lineno) for m in submodules]
            if others:
                out.append((node.module, others, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, _, _ in _imports(path, modules) if m != name}
            for name, path in modules.items()}


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_circle(tmp_path, monkeypatch):
    """The walk above is not vacuous: a two-module circle is reported."""
    pkg = tmp_path / "kconvert"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kconvert.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from kconvert import a\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = _graph()
    assert graph["kconvert.a"] == {"kconvert.b"} and graph["kconvert.b"] == {"kconvert.a"}


def test_no_private_name_crosses_a_module():
    modules = _modules()
    found = [f"{path.relative_to(ROOT)}:{line}: {mod}.{name}"
             for path in modules.values() for mod, names, line in _imports(path, modules)
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_cited_document_is_in_docs():
    """Code comments cite the specifications by file name (formats.md, p48.md, ...): each must
    exist in the repository's docs/ (or be a file the repository has at that path)."""
    cited = set()
    for base in ("kconvert", "scripts", "tests"):
        for path in (ROOT / base).rglob("*.py"):
            cited.update(re.findall(r"\b([\w./-]+\.md)\b", path.read_text()))
    missing = sorted(c for c in cited
                     if not (ROOT / c).is_file() and not (ROOT / "docs" / Path(c).name).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


# Who may import kconvert.stages (the registry of stage kinds): the layers above the engine that
# build and run stages. Below them the shared linear model is kconvert.formats.linear and the
# hooks the engine calls are kconvert.engine.stage.
STAGE_USERS = {
    "kconvert.convert",  # the driver
    "kconvert.recipes",  # recipes name stage kinds and build them
    "kconvert.commands", "kconvert.api",  # options by stage kind
    "kconvert.sizing.predict",  # plans a conversion on headers as the driver does
}
# The audit reads what each stage recorded in the manifest (kconvert.stages.records) and only that.
RECORD_READERS = {"kconvert.audit.context", "kconvert.audit.manifest_checks"}


def test_nothing_below_the_driver_imports_the_stages():
    graph = _graph()
    found = []
    for module, imported in graph.items():
        if module.startswith(("kconvert.stages", "kconvert.cli")) or module in STAGE_USERS:
            continue
        for name in imported:
            if name == "kconvert.stages.records" and module in RECORD_READERS:
                continue
            if name == "kconvert.stages" or name.startswith("kconvert.stages."):
                found.append(f"{module} imports {name}")
    assert not found, "\n".join(found)


# Where a format family's name may be compared: the format plug-ins (their own arithmetic and
# config) and the command line (its choices). Elsewhere behaviour comes from the codec.
FAMILY_NAMES = {"modelopt", "compressed-tensors"}


def test_no_format_family_is_chosen_by_comparing_its_name():
    found = []
    for name, path in _modules().items():
        if name.startswith(("kconvert.formats", "kconvert.cli")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
                continue
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in FAMILY_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {side.value!r}")
    assert not found, "format chosen by name:\n" + "\n".join(found)


def test_the_name_check_finds_a_comparison(tmp_path, monkeypatch):
    """The walk above is not vacuous: `fmt == "modelopt"` in an engine module is reported."""
    pkg = tmp_path / "kconvert"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "x.py").write_text('def f(fmt):\n    return fmt == "modelopt"\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"engine/x\.py:2"):
        test_no_format_family_is_chosen_by_comparing_its_name()


# A new format or pruning method is its own code plus one registration: these add each in a
# test, touching nothing else in kconvert, and run a conversion with it.

def test_a_new_output_format_is_its_codec_plus_registration(tmp_path, monkeypatch):
    """A fake format (NVFP4 bytes under its own parameter names, described by its own config
    family) registered in kconvert.formats (its codec), kconvert.model.names (its parameter
    names) and kconvert.formats.quant_config (its config family) is written by
    `quantize --format fake`, read back by the same registry, and decodes to the values the
    compressed-tensors output holds."""
    import torch

    from conftest import BUNDLED
    from helpers import checkpoint_tensors
    from kconvert import formats
    from kconvert.convert import RunControl, convert
    from kconvert.formats import nvfp4
    from kconvert.formats.linear import group_modules
    from kconvert.formats.nvfp4_ct import Nvfp4Codec
    from kconvert.formats.quant_config import CONFIG_WRITERS
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.model import names as model_names
    from kconvert.recipes import load_recipe

    names = {"weight_packed": "weight_fp4", "weight_scale": "weight_fp4_scale",
             "weight_global_scale": "weight_fp4_tensor_scale"}

    class FakeCodec(Nvfp4Codec):
        name = "nvfp4-fake"
        params = tuple(names.values())
        packed_param = "weight_fp4"
        global_scale_param = "weight_fp4_tensor_scale"
        ct_format = None
        config_family = "fake-family"
        cli_name = "fake"
        p48_forms = False

        @classmethod
        def unpack(cls, t):
            return t["weight_fp4"], t["weight_fp4_scale"], t["weight_fp4_tensor_scale"].reshape(-1)

        @classmethod
        def specs(cls, shape, input_scale=False, group_size=nvfp4.BLOCK):
            return [(names[p], d, s) for p, d, s in super().specs(shape, False, group_size)]

        @classmethod
        def encode(cls, q, i, input_amax=None):
            return {names[p]: t for p, t in super().encode(q, i).items()}

    def fake_config(modules, out_names):
        return {"quant_method": "fake-family", "modules": len(modules)}, {"fake.json": {}}

    monkeypatch.setattr(model_names, "PARAM_SUFFIXES",
                        (*names.values(), *model_names.PARAM_SUFFIXES))
    monkeypatch.setitem(formats.OUTPUT_CODECS, "fake", FakeCodec)
    monkeypatch.setattr(formats, "SOURCE_CODECS", (FakeCodec, *formats.SOURCE_CODECS))
    monkeypatch.setitem(CONFIG_WRITERS, "fake-family", fake_config)
    quiet = RunControl(quiet=True, device="cpu")
    recipe = load_recipe("int4-to-nvfp4")
    made = convert(str(BUNDLED), str(tmp_path / "fake"), recipe, {"format": "fake"}, quiet)
    convert(str(BUNDLED), str(tmp_path / "ct"), recipe, {}, quiet)

    assert made.output_format == "fake-family"
    config = json.loads((tmp_path / "fake" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fake-family"
    assert (tmp_path / "fake" / "fake.json").is_file()

    fake, ct = checkpoint_tensors(tmp_path / "fake"), checkpoint_tensors(tmp_path / "ct")
    out = open_checkpoint(str(tmp_path / "fake"))
    modules, _ = group_modules(out.tensors, {})
    out.close()
    fakes = [m for m in modules if m.codec is FakeCodec]
    assert fakes and not [n for n in fake if n.endswith(".weight_packed")]
    for m in fakes:
        got = FakeCodec.decode({p: fake[f"{m.module}.{p}"][None] for p in FakeCodec.params},
                               m.shape)
        want = Nvfp4Codec.decode({p: ct[f"{m.module}.{p}"][None] for p in Nvfp4Codec.params},
                                 m.shape)
        assert torch.equal(got, want), m.module


def test_a_new_pruning_criterion_is_its_registration(tmp_path, monkeypatch):
    """A criterion registered in kconvert.options.PRUNE_CRITERIA (here "busiest": the experts
    routed the most tokens) is taken by `reap --criterion`, and keeps the experts it ranks
    highest."""
    import torch
    from safetensors.torch import save_file

    import kconvert
    from conftest import BUNDLED
    from kconvert.calibrate.stats import STATS_FILE
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.options import PRUNE_CRITERIA
    from kconvert.pruning.reap import moe_layers

    ckpt = open_checkpoint(str(BUNDLED))
    layers = moe_layers(ckpt)
    ckpt.close()
    gen = torch.Generator().manual_seed(0)
    stats = {}
    for layer, n in layers.items():
        stats[f"layers.{layer}.count"] = torch.randperm(n, generator=gen).double()
        stats[f"layers.{layer}.saliency"] = torch.rand(n, generator=gen, dtype=torch.float64)
        stats[f"layers.{layer}.ean_sum"] = torch.rand(n, generator=gen, dtype=torch.float64)
    (tmp_path / "stats").mkdir()
    save_file(stats, tmp_path / "stats" / STATS_FILE)

    monkeypatch.setitem(PRUNE_CRITERIA, "busiest", "count")
    result = kconvert.reap(str(BUNDLED), str(tmp_path / "out"), stats=str(tmp_path / "stats"),
                           keep=5, criterion="busiest", device="cpu")
    plan = json.loads((result.output / "reap-plan.json").read_text())
    assert plan["criterion"] == "busiest"
    for layer in layers:
        busiest = stats[f"layers.{layer}.count"].argsort(descending=True)[:5]
        assert plan["layers"][str(layer)]["keep"] == sorted(busiest.tolist())
    assert result.summary["pruned_experts"] == sum(n - 5 for n in layers.values())


def test_no_test_skips_when_an_oracle_or_a_dependency_is_missing():
    """numba is a hard dependency and every oracle (compressed-tensors, ModelOpt, transformers)
    a test dependency: a test whose import fails must fail the suite, never skip silently."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "importorskip(" in line and p.name != "test_architecture.py"]
    assert not found, found
