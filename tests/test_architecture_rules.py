"""The house rules, checked on the package's source: no import circles, no private name used
across modules, no module over 400 lines, and every document the code cites is in docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from architecture_support import fake_package, import_graph, kconvert_imports, package_modules

from conftest import ROOT
from kconvert import LAYERS

MAX_LINES = 400


def test_no_import_circles():
    graph = import_graph()
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
    fake_package(tmp_path, monkeypatch, {"a.py": "from kconvert.b import f\n",
                                         "b.py": "def f():\n    from kconvert import a\n"})
    graph = import_graph()
    assert graph["kconvert.a"] == {"kconvert.b"} and graph["kconvert.b"] == {"kconvert.a"}


def test_no_private_name_crosses_a_module():
    modules = package_modules()
    found = [f"{path.relative_to(ROOT)}:{line}: {mod}.{name}"
             for path in modules.values() for mod, names, line in kconvert_imports(path, modules)
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in package_modules().values()
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
    graph = import_graph()
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


def test_no_test_skips_when_an_oracle_or_a_dependency_is_missing():
    """numba is a hard dependency and every oracle (compressed-tensors, ModelOpt, transformers)
    a test dependency: a test whose import fails must fail the suite, never skip silently."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "importorskip(" in line and p.name != "test_architecture_rules.py"]
    assert not found, found


# --- The package order -------------------------------------------------------------------

# The package order, lowest first, as kconvert.LAYERS declares it once.
def _layers_of(name: str) -> list[int]:
    return [i for i, layer in enumerate(LAYERS) for prefix in layer
            if name == prefix or (prefix != "kconvert" and name.startswith(prefix + "."))]


def test_every_module_belongs_to_one_layer():
    found = {name: _layers_of(name) for name in package_modules()}
    wrong = {name: layers for name, layers in found.items() if len(layers) != 1}
    assert not wrong, f"modules in no layer or in several (LAYERS): {wrong}"


def test_no_import_runs_back_up_the_package_order():
    modules = package_modules()
    found = []
    for name, path in modules.items():
        (mine,) = _layers_of(name)
        for imported, _, line in kconvert_imports(path, modules):
            (theirs,) = _layers_of(imported)
            if theirs > mine:
                found.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {imported}, "
                             "a layer above it")
    assert not found, "imports up the package order:\n" + "\n".join(found)


def test_the_order_check_finds_an_upward_import_and_a_module_in_no_layer(tmp_path,
                                                                           monkeypatch):
    """The checks above are not vacuous: io importing the API inside a function, and a module
    no layer holds, are reported."""
    pkg = fake_package(tmp_path, monkeypatch, {
        "io/files.py": "def f():\n    from kconvert.api import g\n",
        "api.py": "from kconvert.io.files import f\n\n\ndef g():\n    f()\n"})
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"io/files\.py:2: kconvert\.io\.files imports "
                                             r"kconvert\.api"):
        test_no_import_runs_back_up_the_package_order()
    test_every_module_belongs_to_one_layer()
    (pkg / "elsewhere.py").write_text("")
    with pytest.raises(AssertionError, match=r"kconvert\.elsewhere"):
        test_every_module_belongs_to_one_layer()


