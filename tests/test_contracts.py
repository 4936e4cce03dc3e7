"""The plug-in contracts, checked on the package's source: a codec is known by what it declares
(kconvert.formats.base.Codec), never by which class it is; the engine and the driver reach formats
only through their registry and contract; a stage kind is known by its hooks and records, never
by comparing its name; nothing below the driver imports the stage kinds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT
from kconvert.engine.stage import PRUNE, QUANTIZE
from kconvert.formats import Codec
from kconvert.stages import KINDS

PACKAGE = ROOT / "kconvert"

# The formats' public face: the registry (the package), the codec contract, the linear model and
# the config writer that picks a family. Every other module of kconvert.formats is one format's
# arithmetic or layout.
FORMAT_CONTRACT = {"kconvert.formats", "kconvert.formats.base", "kconvert.formats.linear",
                   "kconvert.formats.quant_config"}
# The engine and the driver, which run any format through that face.
ENGINE_AND_DRIVER = ("kconvert.engine", "kconvert.driver")
# Who may import kconvert.stages (the registry of stage kinds): the kinds themselves, the
# fixtures, and the driver and the command layers above it.
STAGE_IMPORTERS = ("kconvert.stages", "kconvert.driver", "kconvert.testing", "kconvert.api",
                   "kconvert.cli", "kconvert.__main__")
# Modules beside the driver in the package order (tests/test_architecture_rules.py, LAYERS) that
# still read the stages' records: the audit validates a manifest's options as a RunRecord, which
# is built from the registry of kinds; `inspect --keep` makes the prune stage it plans with.
STAGE_RECORD_READERS = {"kconvert.audit.context", "kconvert.audit.manifest_checks",
                        "kconvert.sizing.predict"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imported(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(kconvert module, line) of every import in the file at any depth; `from P import m`
    of a submodule m names P.m."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("kconvert")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("kconvert"):
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in modules]
            out += [(m, node.lineno) for m in subs]
            if len(subs) < len(node.names):
                out.append((node.module, node.lineno))
    return out


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def _codec_classes() -> set[str]:
    """The names of every codec class kconvert defines (Codec's subclasses, at any depth)."""
    found, todo = set(), [Codec]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("kconvert.formats"):
                found.add(sub.__name__)
            todo.append(sub)
    return found | {"Codec"}


def _names_in(side: ast.AST) -> list[ast.AST]:
    return list(side.elts) if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]


def test_no_codec_is_told_by_its_class_outside_formats():
    """`m.codec is DenseCodec`, `codec in (A, B)`, `c == Int4Codec`: a format's behaviour is
    asked of the codec (its attributes and methods), only kconvert.formats names classes."""
    classes = _codec_classes()
    found = []
    for name, path in _modules().items():
        if _within(name, ("kconvert.formats",)):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                for elt in _names_in(side):
                    named = elt.id if isinstance(elt, ast.Name) else \
                        elt.attr if isinstance(elt, ast.Attribute) else None
                    if named in classes:
                        found.append(f"{_where(path, node)}: compared with {named}")
    assert not found, "codec identity tests outside kconvert.formats:\n" + "\n".join(found)


def test_engine_and_driver_import_no_format_module():
    modules = _modules()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name} imports {imported}"
             for name, path in modules.items() if _within(name, ENGINE_AND_DRIVER)
             for imported, line in _imported(path, modules)
             if _within(imported, ("kconvert.formats",)) and imported not in FORMAT_CONTRACT]
    assert not found, "format modules imported by the engine or driver:\n" + "\n".join(found)


def _stage_names_used(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Where a stage kind's name is a string that chooses something: compared (==, in, ...) or
    looked up (`d.get("quantize")`, `d["quantize"]`)."""
    names = set(KINDS)
    found = []
    for node in ast.walk(tree):
        sides: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            sides = [e for s in (node.left, *node.comparators) for e in _names_in(s)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get":
            sides = node.args[:1]
        elif isinstance(node, ast.Subscript):
            sides = [node.slice]
        found += [(node, s.value) for s in sides
                  if isinstance(s, ast.Constant) and s.value in names]
    return found


def test_no_stage_name_is_compared_outside_stages():
    found = [f"{_where(path, node)}: {value!r}" for name, path in _modules().items()
             if not _within(name, ("kconvert.stages",))
             for node, value in _stage_names_used(ast.parse(path.read_text()))]
    assert not found, "stage names compared outside kconvert.stages:\n" + "\n".join(found)


def test_the_stage_names_declared_below_the_stages_are_kinds():
    """engine.stage's names of the kinds found by name in what a run recorded are the kinds'."""
    assert {QUANTIZE, PRUNE} <= set(KINDS)
    assert KINDS[QUANTIZE].record_type.model_fields.get("block_scale") is not None
    assert KINDS[PRUNE].record_type.model_fields.get("kept_per_layer") is not None


def test_nothing_below_the_driver_imports_the_stages():
    modules = _modules()
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name} imports {imported}"
             for name, path in modules.items()
             if not _within(name, STAGE_IMPORTERS) and name not in STAGE_RECORD_READERS
             for imported, line in _imported(path, modules)
             if _within(imported, ("kconvert.stages",))]
    assert not found, "kconvert.stages imported below the driver:\n" + "\n".join(found)


def _planted(tmp_path: Path, monkeypatch, files: dict[str, str]) -> None:
    """A package of `files` (path -> text) in place of kconvert's sources."""
    pkg = tmp_path / "kconvert"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(pkg).parents:
            if not (pkg / folder / "__init__.py").exists():
                (pkg / folder / "__init__.py").write_text("")
        path.write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)


def test_the_checks_find_what_they_forbid(tmp_path, monkeypatch):
    """The walks above are not vacuous: an engine module that tests a codec's class, imports
    NVFP4's arithmetic and compares a stage's name, an audit module that looks a stage's
    record up by name, and a pruning module that imports the stages, are each reported; the
    same in kconvert.formats and kconvert.stages is not."""
    _planted(tmp_path, monkeypatch, {
        "formats/nvfp4.py": "",
        "formats/x.py": "def f(c, D):\n    return c is DenseCodec\n",
        "engine/x.py": ("from kconvert.formats import DenseCodec, nvfp4\n\n\n"
                        "def f(m, stage):\n    return m.codec in (DenseCodec, None)"
                        " or stage == 'quantize'\n"),
        "audit/x.py": "def f(options):\n    return options.get('sparsify')\n",
        "stages/__init__.py": "",
        "stages/x.py": "def f(s):\n    return s == 'prune'\n",
        "pruning/x.py": "def f():\n    from kconvert.stages import x\n",
    })
    checks = [
        (test_no_codec_is_told_by_its_class_outside_formats,
         ["kconvert/engine/x.py:5: compared with DenseCodec"]),
        (test_engine_and_driver_import_no_format_module,
         ["kconvert/engine/x.py:1: kconvert.engine.x imports kconvert.formats.nvfp4"]),
        (test_no_stage_name_is_compared_outside_stages,
         ["kconvert/engine/x.py:5: 'quantize'", "kconvert/audit/x.py:2: 'sparsify'"]),
        (test_nothing_below_the_driver_imports_the_stages,
         ["kconvert/pruning/x.py:2: kconvert.pruning.x imports kconvert.stages.x"]),
    ]
    for check, reported in checks:
        with pytest.raises(AssertionError) as err:
            check()
        message = str(err.value)
        assert all(r in message for r in reported), message
        assert "formats/x.py" not in message and "stages/x.py" not in message
