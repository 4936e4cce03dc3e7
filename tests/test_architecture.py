"""The house rules, checked on the package's source: no import circles, no private name used
across modules, no module over 500 lines, and every document the code cites is in docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
