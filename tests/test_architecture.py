"""The house rules, checked on the package's source: no import circles, no private name used
across modules, no module over 400 lines, and every document the code cites is in docs/."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from helpers import checkpoint_tensors
from kconvert import LAYERS
from kconvert.formats import Codec, Encoded
from kconvert.formats.linear import Batch, Transformed
from kconvert.methods import Method
from kconvert.plugins.registry import Declaration
from kconvert.pruning.kinds import Criterion

PACKAGE = ROOT / "kconvert"
MAX_LINES = 400


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
    for base in ("kconvert", "benchmarks", "scripts", "tests"):
        for path in (ROOT / base).rglob("*.py"):
            cited.update(re.findall(r"\b([\w./-]+\.md)\b", path.read_text()))
    missing = sorted(c for c in cited
                     if not (ROOT / c).is_file() and not (ROOT / "docs" / Path(c).name).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


# Who may import kconvert.stages (the registry of stage kinds): the layers above the engine that
# build and run stages. Below them the shared linear model is kconvert.formats.linear and the
# hooks the engine calls are kconvert.engine.stage.
STAGE_USERS = {
    "kconvert.driver.convert",  # the driver
    "kconvert.driver.manifest_writer",  # what each stage kind did, by its flags
    "kconvert.driver.recipes",  # recipes name stage kinds and build them
    "kconvert.driver.commands", "kconvert.api",  # options by stage kind
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


def _registered_names() -> set[str]:
    """Every name a registry gives: plug-ins, output formats, grids."""
    from kconvert.formats import OUTPUT_CODECS, SOURCE_CODECS
    from kconvert.plugins.docs import families

    return {*(d.name for registry, _ in families() for d in registry), *OUTPUT_CODECS,
            *(c.grid for c in SOURCE_CODECS)}


# Where a plug-in's name may be compared: its declarations (kconvert.plugins) and the
# implementations of its family (methods in kconvert.methods); stages and commands know
# plug-ins through their declarations and classes.
PLUGIN_NAME_OWNERS = ("kconvert.plugins", "kconvert.methods")


def test_no_method_name_is_compared_outside_methods():
    from kconvert.plugins.methods import METHODS

    names = {d.name for d in METHODS}
    found = []
    for name, path in _modules().items():
        if name.startswith(PLUGIN_NAME_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                values = ([side] if isinstance(side, ast.Constant) else
                          list(side.elts) if isinstance(side, ast.Tuple | ast.List | ast.Set)
                          else [])
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "method chosen by name:\n" + "\n".join(found)


def test_the_method_check_finds_a_comparison(tmp_path, monkeypatch):
    """The walk above is not vacuous: `method == "gptq"` and `m in ("rtn",)` in a stage are
    reported."""
    pkg = tmp_path / "kconvert"
    (pkg / "stages").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stages" / "__init__.py").write_text("")
    (pkg / "stages" / "x.py").write_text('def f(method):\n    return method == "gptq"\n'
                                          'def g(m):\n    return m in ("rtn",)\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"stages/x\.py:2\n.*stages/x\.py:4"):
        test_no_method_name_is_compared_outside_methods()


# Where a list of choices (formats, methods, grids) may be written out: the registries and
# kconvert.common.options, the command line's torch-free copy that
# test_the_cli_lists_are_the_registries holds equal to them.
CHOICE_LIST_OWNERS = ("kconvert.common.options", "kconvert.formats", "kconvert.methods",
                      "kconvert.plugins")


def test_no_choice_list_outside_options_and_the_registries():
    names = _registered_names()
    found = []
    for name, path in _modules().items():
        if name.startswith(CHOICE_LIST_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and e.value in names for e in node.elts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "choice lists kept outside the registries:\n" + "\n".join(found)


def test_the_choice_list_check_finds_a_copy(tmp_path, monkeypatch):
    """The walk above is not vacuous: a copy of the output formats in a CLI module is found."""
    pkg = tmp_path / "kconvert"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "x.py").write_text('FORMATS = ("compressed-tensors", "modelopt")\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"cli/x\.py:1"):
        test_no_choice_list_outside_options_and_the_registries()


# The plug-ins' names and settings are written once, in their declarations (kconvert.plugins):
# no list, tuple, set or dict keys of them anywhere else in the package, options included.
def _plugin_words() -> set[str]:
    from kconvert.plugins.docs import families

    return {word for registry, _ in families() for d in registry
            for word in (d.name, *d.settings.model_fields)}


def test_no_hand_list_of_plugin_names_or_settings():
    words = _plugin_words()
    found = []
    for name, path in _modules().items():
        if name.startswith("kconvert.plugins"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            elts = (node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else
                    [k for k in node.keys if k is not None] if isinstance(node, ast.Dict)
                    else [])
            if len(elts) >= 2 and all(isinstance(e, ast.Constant) and e.value in words
                                      for e in elts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "plug-in names or settings listed by hand:\n" + "\n".join(found)


def test_the_hand_list_check_finds_a_copy(tmp_path, monkeypatch):
    """The walk above is not vacuous: a methods tuple in kconvert.common.options and a criteria dict
    are found."""
    pkg = tmp_path / "kconvert"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "options.py").write_text('QUANTIZE_METHODS = ("rtn", "gptq")\n'
                                    'CRITERIA = {"reap": "saliency", "frequency": "count"}\n'
                                    'SETTINGS = ["steps", "tokens"]\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"options\.py:1\n.*options\.py:2\n.*options\.py:3"):
        test_no_hand_list_of_plugin_names_or_settings()


# A repair, compensation or criterion kind's name is compared nowhere outside its registry
# (kconvert.plugins) and its classes: a compare of one of their names against a value whose
# name says it holds such a kind (`repair != "none"`, `s.method == "router"`,
# `compensate in ("down", ...)`) is a branch on a kind. (A method's name is compared nowhere at
# all: test_no_method_name_is_compared_outside_methods.)
KIND_HOLDERS = {"method", "repair", "compensate", "compensation", "criterion", "kind"}


def _holder(node: ast.expr) -> str | None:
    """What a compared value is called: a variable, an attribute, a `.get("key")` or `[key]`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant)):
        return str(node.args[0].value)
    return None


def test_no_kind_name_is_compared_outside_its_registry():
    from kconvert.plugins.pruning import COMPENSATIONS, CRITERIA, REPAIRS

    names = {d.name for registry in (REPAIRS, COMPENSATIONS, CRITERIA) for d in registry}
    found = []
    for name, path in _modules().items():
        if name.startswith(("kconvert.plugins", "kconvert.pruning.kinds")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            literals = [v for side in sides for v in (
                [side] if isinstance(side, ast.Constant) else
                side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [])
                if isinstance(v, ast.Constant) and v.value in names]
            if literals and any(_holder(side) in KIND_HOLDERS for side in sides):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "kind chosen by name:\n" + "\n".join(found)


def test_the_kind_check_finds_a_comparison(tmp_path, monkeypatch):
    """The walk above is not vacuous: `repair != "none"`, `s.method == "router"` and
    `options.get("compensate") in ("down",)` are reported; `tn.part == "down"` is not."""
    pkg = tmp_path / "kconvert"
    (pkg / "stages").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stages" / "__init__.py").write_text("")
    (pkg / "stages" / "x.py").write_text(
        'def f(repair, s, options, tn):\n    a = repair != "none"\n'
        '    b = s.method == "router"\n    c = options.get("compensate") in ("down",)\n'
        '    return a, b, c, tn.part == "down"\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"x\.py:2\n.*x\.py:3\n.*x\.py:4\nassert"):
        test_no_kind_name_is_compared_outside_its_registry()


def test_the_cli_lists_are_the_registries():
    """kconvert.common.options' torch-free lists (what the command line offers) are the
    registries'."""
    from kconvert.common import options
    from kconvert.formats import OUTPUT_CODECS
    from kconvert.sizing.predict import as_formats

    assert tuple(OUTPUT_CODECS) == options.OUTPUT_FORMATS
    assert set(options.AS_FORMATS) == set(as_formats())


# A new format, quantize method, sparsify method or pruning criterion is its own code plus one
# registration: these add each in a test, touching nothing else in kconvert, and run with it.

class RowInt8Codec(Codec):
    """A format with arithmetic of its own, not an existing codec's: symmetric INT8 per output
    row, scale = row amax / 127 (fp32), codes round(w * (1 / scale)) in fp32, ties to even,
    clamped to +-127 (the arithmetic of torch's quantize_per_channel); written in a config
    family of its own."""

    name = "int8-rows"
    params = ("weight_q8", "weight_row_scale")
    description = "INT8 per row (a test's format)"
    grid = "int8"
    config_family = quant_method = "test-int8"  # its config's quant_method names it
    cli_name = "test-int8"

    @classmethod
    def param_rules(cls, shape, group_size):
        return {"weight_q8": (frozenset({"I8"}), tuple(shape)),
                "weight_row_scale": (frozenset({"F32"}), (shape[0], 1))}

    @classmethod
    def logical_shape(cls, infos, shape_value):
        return tuple(infos["weight_q8"].shape)

    @classmethod
    def specs(cls, shape, input_scale=False, group_size=None):
        return [("weight_q8", "I8", tuple(shape)), ("weight_row_scale", "F32", (shape[0], 1))]

    @classmethod
    def decode(cls, t, shape):
        return t["weight_q8"].float() * t["weight_row_scale"].float()

    @classmethod
    def encode(cls, w, spec, *, amax=None, codes=None):
        scale = w.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
        q = torch.round(w * (1 / scale)).clamp(-127, 127).to(torch.int8)
        err = (q.float() * scale - w).square().sum((1, 2), dtype=torch.float64)
        return Encoded({"weight_q8": q, "weight_row_scale": scale}, err,
                       w.double().square().sum((1, 2)))

    @classmethod
    def write_config(cls, modules, names):
        return {"quant_method": cls.config_family, "modules": len(modules)}, {"int8.json": {}}


def test_a_new_output_format_is_its_codec_plus_registration(tmp_path):
    """RowInt8Codec, registered by one `formats.register` call, is written by `quantize
    --format test-int8` with the bytes torch's own per-channel INT8 quantizer gives, read
    back and dequantized by the same registry, audited clean against its source, and sized
    by `inspect --as int8`."""
    from kconvert import formats
    from kconvert.model import names as model_names

    # the registries (the objects every module holds) are put back as they were after the test
    saved = (list(formats.SOURCE_CODECS), dict(formats.OUTPUT_CODECS),
             set(model_names.PARAM_SUFFIXES))
    formats.register(RowInt8Codec)
    try:
        _convert_with_row_int8(tmp_path)
    finally:
        formats.SOURCE_CODECS[:] = saved[0]
        formats.OUTPUT_CODECS.clear()
        formats.OUTPUT_CODECS.update(saved[1])
        model_names.PARAM_SUFFIXES.clear()
        model_names.PARAM_SUFFIXES.update(saved[2])
    assert RowInt8Codec not in formats.SOURCE_CODECS


def _convert_with_row_int8(tmp_path: Path) -> None:
    import kconvert
    from conftest import BUNDLED

    made = kconvert.quantize(str(BUNDLED), str(tmp_path / "q8"), format="test-int8",
                             device="cpu")
    assert made.manifest.output_format == "test-int8"
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "test-int8"
    assert (tmp_path / "q8" / "int8.json").is_file()

    # the bytes: torch's quantize_per_channel on the source's decoded experts
    source = kconvert.dequant(str(BUNDLED), str(tmp_path / "f32"), dtype="F32", device="cpu")
    assert source.manifest is not None
    want, got = checkpoint_tensors(tmp_path / "f32"), checkpoint_tensors(tmp_path / "q8")
    experts = [n.removesuffix(".weight") for n in want if ".experts." in n]
    assert experts and all(f"{e}.weight_q8" in got for e in experts)
    for e in experts:
        w = want[f"{e}.weight"]
        scale = w.abs().amax(-1) / 127
        oracle = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale).long(),
                                            0, torch.qint8)
        assert torch.equal(got[f"{e}.weight_q8"], oracle.int_repr()), e

    # read back, dequantized and audited through the registry
    back = kconvert.dequant(str(tmp_path / "q8"), str(tmp_path / "back"), dtype="F32",
                            device="cpu")
    assert back.summary["dequantized_modules"] == len(experts)
    decoded = checkpoint_tensors(tmp_path / "back")
    for e in experts:
        assert torch.equal(decoded[f"{e}.weight"], RowInt8Codec.decode(
            {p: got[f"{e}.{p}"] for p in RowInt8Codec.params}, None))
    report = kconvert.audit(str(tmp_path / "q8"), source=str(BUNDLED), device="cpu")
    assert report.passed, report.render()
    sized = kconvert.inspect(str(BUNDLED), as_format="int8")
    assert sized.to_json()["output"]["recipe"] == "quantize"


class Clip3Sigma(Method):
    """A quantize method of a test: each row clipped to 3 standard deviations of its weights
    before the codec's own rounding."""

    declaration = Declaration("clip3", ("quantize",), "rows clipped to 3 sigma",
                              f"{__name__}:Clip3Sigma")

    def transforms(self, m) -> bool:
        return True

    def transform_batch(self, batch):
        w = batch.weights
        bound = 3 * w.std(-1, keepdim=True)  # a row's spread, whatever its batch
        return Transformed(torch.maximum(torch.minimum(w, bound), -bound))


class SmallestPairs(Method):
    """A sparsify method of a test: in every chunk of 8 keep the 2 pairs of SMALLEST
    magnitude (the opposite of `magnitude`)."""

    declaration = Declaration("smallest", ("sparsify",), "the smallest pairs kept",
                              f"{__name__}:SmallestPairs")

    def transforms(self, m) -> bool:
        return True

    def transform_batch(self, batch):
        from kconvert.formats import p48

        w = batch.weights
        keep = p48.top2_pairs(-p48.pair_scores(w))
        return Transformed(p48.apply_pair_mask(w, keep))


@pytest.mark.parametrize("method", [Clip3Sigma, SmallestPairs])
def test_a_new_method_is_its_class_plus_registration(tmp_path, monkeypatch, method):
    """A method registered by kconvert.plugins.methods.register_method runs through its
    stage's command with `method=NAME`, is recorded in the manifest, and writes what its
    transform says: the output decodes to the codec's own encode of the method's values,
    computed here."""
    import kconvert
    from conftest import BUNDLED
    from kconvert.formats import EncodeSpec, Nvfp4Codec
    from kconvert.methods import MethodInputs
    from kconvert.plugins.methods import METHODS, register_method

    monkeypatch.setattr(METHODS, "declared", list(METHODS.declared))  # put back after
    register_method(method.declaration)
    command = kconvert.quantize if method.stage == "quantize" else kconvert.sparsify
    made = command(str(BUNDLED), str(tmp_path / "out"), method=method.name, device="cpu")
    assert made.manifest.options[method.stage]["method"] == method.name
    kconvert.dequant(str(BUNDLED), str(tmp_path / "f32"), dtype="F32", device="cpu")
    source, out = checkpoint_tensors(tmp_path / "f32"), checkpoint_tensors(tmp_path / "out")

    def set_amax(module: str) -> torch.Tensor:
        """An expert's gate and up share their largest amax (one global scale)."""
        base, proj = module.rsplit(".", 1)
        members = ([f"{base}.gate_proj", f"{base}.up_proj"] if proj != "down_proj"
                   else [module])
        return torch.stack([source[f"{m}.weight"].abs().amax() for m in members]).amax()

    checked = 0
    for name, w in source.items():
        if ".mlp.experts." not in name:
            continue
        module = name.removesuffix(".weight")
        values = method(MethodInputs(frozenset())).transform_batch(
            Batch([], w[None], Nvfp4Codec, EncodeSpec(), None)).weights
        want = Nvfp4Codec.encode(values, EncodeSpec(group_size=16),
                                 amax=set_amax(module).reshape(1))
        got = {p: out[f"{module}.{p}"][None] for p in Nvfp4Codec.params}
        assert torch.equal(Nvfp4Codec.decode(got, None),
                           Nvfp4Codec.decode(want.params, None)), module
        checked += 1
    assert checked


class Busiest(Criterion):
    """A criterion of a test: the experts routed the most tokens."""

    declaration = Declaration("busiest", ("prune",), "the most routed tokens",
                              f"{__name__}:Busiest", needs="stats")
    statistic = "count"


def test_a_new_pruning_criterion_is_its_registration(tmp_path, monkeypatch):
    """A criterion registered on kconvert.plugins.pruning.CRITERIA (Busiest) is taken by
    `reap --criterion`, and keeps the experts it ranks highest."""
    import torch
    from safetensors.torch import save_file

    import kconvert
    from conftest import BUNDLED
    from kconvert.calibrate.stats import STATS_FILE
    from kconvert.io.checkpoint import open_checkpoint
    from kconvert.plugins.pruning import CRITERIA
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

    monkeypatch.setattr(CRITERIA, "declared", list(CRITERIA.declared))  # put back after
    CRITERIA.register(Busiest.declaration)
    result = kconvert.reap(str(BUNDLED), str(tmp_path / "out"), stats=str(tmp_path / "stats"),
                           keep=6, criterion="busiest", device="cpu")
    plan = json.loads((result.output / "reap-plan.json").read_text())
    assert plan["criterion"] == "busiest"
    for layer in layers:
        busiest = stats[f"layers.{layer}.count"].argsort(descending=True)[:6]
        assert plan["layers"][str(layer)]["keep"] == sorted(busiest.tolist())
    assert result.summary["pruned_experts"] == sum(n - 6 for n in layers.values())


def test_no_test_skips_when_an_oracle_or_a_dependency_is_missing():
    """numba is a hard dependency and every oracle (compressed-tensors, ModelOpt, transformers)
    a test dependency: a test whose import fails must fail the suite, never skip silently."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "importorskip(" in line and p.name != "test_architecture.py"]
    assert not found, found


# --- The package order and the one GPU budget ---------------------------------------------

# The package order, lowest first, as kconvert.LAYERS declares it once.
def _layers_of(name: str) -> list[int]:
    return [i for i, layer in enumerate(LAYERS) for prefix in layer
            if name == prefix or (prefix != "kconvert" and name.startswith(prefix + "."))]


def test_every_module_belongs_to_one_layer():
    found = {name: _layers_of(name) for name in _modules()}
    wrong = {name: layers for name, layers in found.items() if len(layers) != 1}
    assert not wrong, f"modules in no layer or in several (LAYERS): {wrong}"


def test_no_import_runs_back_up_the_package_order():
    modules = _modules()
    found = []
    for name, path in modules.items():
        (mine,) = _layers_of(name)
        for imported, _, line in _imports(path, modules):
            (theirs,) = _layers_of(imported)
            if theirs > mine:
                found.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {imported}, "
                             "a layer above it")
    assert not found, "imports up the package order:\n" + "\n".join(found)


def test_the_order_check_finds_an_upward_import_and_a_module_in_no_layer(tmp_path,
                                                                           monkeypatch):
    """The checks above are not vacuous: io importing the API inside a function, and a module
    no layer holds, are reported."""
    pkg = tmp_path / "kconvert"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "__init__.py").write_text("")
    (pkg / "io" / "files.py").write_text("def f():\n    from kconvert.api import g\n")
    (pkg / "api.py").write_text("from kconvert.io.files import f\n\n\ndef g():\n    f()\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"io/files\.py:2: kconvert\.io\.files imports "
                                             r"kconvert\.api"):
        test_no_import_runs_back_up_the_package_order()
    test_every_module_belongs_to_one_layer()
    (pkg / "elsewhere.py").write_text("")
    with pytest.raises(AssertionError, match=r"kconvert\.elsewhere"):
        test_every_module_belongs_to_one_layer()


# The GPU budget is resolved in one place: only kconvert.gpu.budget reads what a card has free
# (torch.cuda.mem_get_info) and makes a run's GpuContext from it (GpuRequest.context, once per
# run); every other step is handed that context.
BUDGET_MODULE = "kconvert.gpu.budget"


def test_gpu_budget_resolved_in_one_place():
    found = []
    for name, path in _modules().items():
        if name == BUDGET_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            reads = ((isinstance(node, ast.Attribute) and node.attr == "mem_get_info")
                     or (isinstance(node, ast.alias) and node.name == "mem_get_info"))
            makes = (isinstance(node, ast.Call)
                     and getattr(node.func, "id", getattr(node.func, "attr", None))
                     == "GpuContext")
            if reads or makes:
                found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: "
                             + ("reads the free GPU memory" if reads else "makes a GpuContext"))
    assert not found, "the GPU budget resolved outside kconvert.gpu.budget:\n" + "\n".join(found)


def test_the_budget_check_finds_a_second_resolution(tmp_path, monkeypatch):
    """The walk above is not vacuous: a step that reads the free memory itself, and one that
    makes its own GpuContext, are reported; the budget module itself is not."""
    pkg = tmp_path / "kconvert"
    (pkg / "calibrate").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    budget = tmp_path.joinpath(*BUDGET_MODULE.split(".")).with_suffix(".py")
    budget.parent.mkdir(parents=True, exist_ok=True)
    (budget.parent / "__init__.py").write_text("")
    budget.write_text("import torch\n\nfree = torch.cuda.mem_get_info(0)\n")
    (pkg / "calibrate" / "__init__.py").write_text("")
    (pkg / "calibrate" / "x.py").write_text("import torch\n\n\ndef f():\n"
                                            "    return torch.cuda.mem_get_info(0)[0]\n")
    (pkg / "y.py").write_text(f"from {BUDGET_MODULE} import GpuContext\n\n"
                              "ctx = GpuContext('cuda', 1, 1)\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError) as err:
        test_gpu_budget_resolved_in_one_place()
    message = str(err.value)
    assert "kconvert/calibrate/x.py:5: reads the free GPU memory" in message
    assert "kconvert/y.py:3: makes a GpuContext" in message
    assert str(budget.relative_to(tmp_path)) not in message


# --- A plug-in from outside the package, used everywhere a built-in one is -----------------

# A quantize method of a test, one module: its declaration (two settings, a stage record, a
# per-matrix record) and its class, and one registration call. Each routed expert's rows
# (all, or the even ones) are scaled by 1 - permille / 1000 before the codec's rounding, and
# each matrix records how many rows it scaled and their squared norm before.
SHRINK_PLUGIN = '''
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kconvert.formats.linear import Transformed
from kconvert.methods.base import Method
from kconvert.plugins.methods import register_method
from kconvert.plugins.registry import Declaration
from kconvert.pruning.kinds import Criterion


class ShrinkSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shrink_permille: int = Field(0, ge=0, le=100, description="how much rows shrink, in 1/1000.")
    shrink_rows: Literal["all", "even"] = Field("all", description="which rows shrink.")


class ShrinkRecord(BaseModel):
    shrink_permille: int | None = Field(None, description="how much rows shrank, in 1/1000")
    shrink_rows: str | None = None


class ShrinkEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shrunk_rows: int
    norm_before: float


class Shrink(Method):
    declaration = Declaration(
        "shrink", ("quantize",), "rows scaled toward zero (a test's method)",
        f"{__name__}:Shrink", ShrinkSettings, record=ShrinkRecord, matrix_record=ShrinkEntry)

    def transforms(self, m) -> bool:
        return True

    def transform_batch(self, batch):
        w = batch.weights.clone()
        rows = slice(None) if self.settings["shrink_rows"] == "all" else slice(None, None, 2)
        w[:, rows] *= 1 - self.settings["shrink_permille"] / 1000
        return Transformed(w, records=[
            {"shrunk_rows": int(m[rows].shape[0]), "norm_before": float(m[rows].square().sum())}
            for m in batch.weights])

    def record(self):
        return {"method": self.name, "shrink_permille": self.settings["shrink_permille"],
                "shrink_rows": self.settings["shrink_rows"]}


register_method(Shrink.declaration)
'''


def _with_plugin(tmp_path: Path, module: str, text: str, code: str, *args: object
                 ) -> subprocess.CompletedProcess:
    """A fresh interpreter that imports the plug-in module `module` (its source `text`, in
    tmp_path) first, as a program that ships its own plug-ins would, then runs `code` with
    sys.argv[1:] = args."""
    (tmp_path / f"{module}.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", f"import {module}\n{code}", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


CLI_WITH_PLUGIN = "from kconvert.cli import run\nrun()"


def test_a_new_method_with_settings_is_one_module_and_one_registration(tmp_path):
    """The plug-in method above, registered by one call, is offered by `--help` (its name and
    both settings), runs from the command line with its settings, from a `run` recipe and
    through the Python API (the same bytes each way), records its settings in the stage record
    and one entry per matrix in the manifest, is in the docs table, and passes the audit."""
    from conftest import BUNDLED

    def cli(*args: object) -> subprocess.CompletedProcess:
        return _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN, CLI_WITH_PLUGIN, *args)

    shown = cli("quantize", "--help").stdout
    assert "shrink:" in shown and "--shrink-permille" in shown and "--shrink-rows" in shown
    assert "--shrink-permille" in cli("run", "--help").stdout

    cli("quantize", BUNDLED, tmp_path / "cli", "--method", "shrink", "--shrink-permille", 3,
        "--shrink-rows", "even", "--device", "cpu", "--quiet")
    (tmp_path / "shrink.toml").write_text(
        'name = "shrink"\n[[stages]]\nstage = "quantize"\nmethod = "shrink"\n'
        'shrink_permille = 3\nshrink_rows = "even"\n')
    cli("run", tmp_path / "shrink.toml", BUNDLED, tmp_path / "recipe", "--device", "cpu",
        "--quiet")
    _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN,
                 "import sys, kconvert\nkconvert.quantize(sys.argv[1], sys.argv[2], "
                 "method='shrink', shrink_permille=3, shrink_rows='even', device='cpu')",
                 BUNDLED, tmp_path / "api")
    cli("quantize", BUNDLED, tmp_path / "none", "--method", "shrink", "--device", "cpu",
        "--quiet")

    manifests = {name: json.loads((tmp_path / name / "kconvert-manifest.json").read_text())
                 for name in ("cli", "recipe", "api", "none")}
    made = manifests["cli"]
    assert made["options"]["quantize"]["method"] == "shrink"
    assert made["options"]["quantize"]["shrink_permille"] == 3
    assert made["options"]["quantize"]["shrink_rows"] == "even"
    assert manifests["none"]["options"]["quantize"]["shrink_permille"] == 0  # its default
    assert made["tensors"] == manifests["recipe"]["tensors"] == manifests["api"]["tensors"]
    assert made["tensors"] != manifests["none"]["tensors"]  # the setting reached the method

    # per matrix: every routed expert's record, computed here from the source's values
    kconvert_dequant = _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN,
                                    CLI_WITH_PLUGIN, "dequant", BUNDLED, tmp_path / "f32",
                                    "--dtype", "F32", "--device", "cpu", "--quiet")
    assert kconvert_dequant.returncode == 0
    source = checkpoint_tensors(tmp_path / "f32")
    experts = {n.removesuffix(".weight"): w for n, w in source.items()
               if ".mlp.experts." in n}
    assert experts and set(made["obs"]) == set(experts)
    for module, w in experts.items():
        entry = made["obs"][module]
        assert entry["shrunk_rows"] == (w.shape[0] + 1) // 2
        assert entry["norm_before"] == pytest.approx(float(w[::2].square().sum()), rel=1e-6)

    docs = _with_plugin(tmp_path, "shrink_plugin", SHRINK_PLUGIN,
                        "from kconvert.plugins.docs import families, render\n"
                        "print(render(families()))").stdout
    assert "| `shrink` | quantize |" in docs and "`--shrink-permille` (0)" in docs

    report = json.loads(cli("audit", tmp_path / "cli", "--source", BUNDLED, "--json",
                            "--quiet", "--device", "cpu").stdout)
    assert report["passed"], report["failures"]
    assert not [w for w in report["warnings"] if "RunRecord" in str(w)]  # its record is typed


# A compensation kind of a test, one module: the shared expert's down_proj re-fitted as
# `shared` does, at one stiff ridge only, and one registration call.
STIFF_PLUGIN = '''
from kconvert.plugins.pruning import COMPENSATIONS
from kconvert.plugins.registry import Declaration
from kconvert.pruning.kinds import CompensationKind


class StiffShared(CompensationKind):
    declaration = Declaration(
        "stiff-shared", ("prune",), "the shared expert's down_proj re-fitted at ridge 1 only "
        "(a test's kind)", f"{__name__}:StiffShared", needs="data", gpu=True)
    ridges = (1.0,)


COMPENSATIONS.register(StiffShared.declaration)
'''


def test_a_new_compensation_kind_is_one_module_and_one_registration(tmp_path):
    """The compensation kind above, registered by one call, is offered by `reap --help`, runs
    from the command line, from a `run` recipe and through the Python API (the same bytes each
    way), is recorded in the manifest and the plan (its name, its one ridge, per layer), is in
    the docs table, and passes the audit."""
    from helpers import write_input_ids
    from kconvert.testing.tiny_moe import corpus_ids, windows

    src = ROOT / "tests" / "fixtures" / "tiny-moe-trained"
    data = write_input_ids(tmp_path / "calib.jsonl", windows(
        corpus_ids("train"), 8, 64, torch.Generator().manual_seed(3)))
    calibration = ["--data", data, "--keep", 12, "--samples", 8, "--seq-len", 64]

    def cli(*args: object) -> subprocess.CompletedProcess:
        return _with_plugin(tmp_path, "stiff_plugin", STIFF_PLUGIN, CLI_WITH_PLUGIN, *args)

    assert "stiff-shared:" in cli("reap", "--help").stdout
    cli("reap", src, tmp_path / "cli", *calibration, "--compensate", "stiff-shared",
        "--device", "cpu", "--quiet")
    (tmp_path / "stiff.toml").write_text(
        'name = "stiff"\n[[stages]]\nstage = "prune"\ncompensate = "stiff-shared"\n')
    cli("run", tmp_path / "stiff.toml", src, tmp_path / "recipe", *calibration, "--device",
        "cpu", "--quiet")
    _with_plugin(tmp_path, "stiff_plugin", STIFF_PLUGIN,
                 "import sys, kconvert\nkconvert.reap(sys.argv[1], sys.argv[2], data=sys.argv[3], "
                 "keep=12, samples=8, seq_len=64, compensate='stiff-shared', device='cpu')",
                 src, tmp_path / "api", data)

    manifests = {name: json.loads((tmp_path / name / "kconvert-manifest.json").read_text())
                 for name in ("cli", "recipe", "api")}
    made = manifests["cli"]
    assert made["options"]["prune"]["compensate"] == "stiff-shared"
    assert made["tensors"] == manifests["recipe"]["tensors"] == manifests["api"]["tensors"]
    plan = json.loads((tmp_path / "cli" / "reap-plan.json").read_text())
    assert plan["compensation"] == "stiff-shared"
    records = [layer["compensation"] for layer in plan["layers"].values()]
    assert records and all(r["method"] == "stiff-shared" and r["ridge"] == 1.0
                           for r in records)
    # what it re-fits: the shared experts' down_proj only, where its guard applied it
    refit = {name for r in records for name in r["matrices_xxh3"]}
    assert all(".shared_experts.down_proj." in name for name in refit)

    docs = _with_plugin(tmp_path, "stiff_plugin", STIFF_PLUGIN,
                        "from kconvert.plugins.docs import families, render\n"
                        "print(render(families()))").stdout
    assert "| `stiff-shared` | prune |" in docs

    report = json.loads(cli("audit", tmp_path / "cli", "--source", src, "--json", "--quiet",
                            "--device", "cpu").stdout)
    assert report["passed"], report["failures"]
    assert not [w for w in report["warnings"] if "RunRecord" in str(w)]


def test_the_methods_table_is_current():
    """docs/methods.md is what the plug-ins' declarations write now."""
    from kconvert.plugins.docs import families, render

    assert (ROOT / "docs" / "methods.md").read_text() == render(families()) + "\n", \
        "docs/methods.md is stale: python -m kconvert.plugins.docs > docs/methods.md"
