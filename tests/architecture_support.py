"""The package's modules and the imports between them, read from the source with ast: what the
architecture tests walk."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "kconvert"


def package_modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def kconvert_imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
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


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: {m for m, _, _ in kconvert_imports(path, modules) if m != name}
            for name, path in modules.items()}



def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]
                 ) -> Path:
    """A stand-in `kconvert` package in tmp_path that the walks read instead of the real one:
    each of `files` (its path in the package -> its source), every folder with an empty
    __init__.py. The checks' self-tests plant their defects in it. Returns its folder."""
    pkg = tmp_path / "kconvert"
    for name, source in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == tmp_path:
                break
            (folder / "__init__.py").touch()
        path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    return pkg
