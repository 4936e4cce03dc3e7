"""Each choice has one owner: a format family, a method or a pruning kind is chosen by its
plug-in, never by comparing its name elsewhere; the lists of choices are the registries'; the GPU
budget is resolved in one module."""

from __future__ import annotations

import ast

import pytest
from architecture_support import fake_package, package_modules

from conftest import ROOT

# Where a format family's name may be compared: the format plug-ins (their own arithmetic and
# config) and the command line (its choices). Elsewhere behaviour comes from the codec.
FAMILY_NAMES = {"modelopt", "compressed-tensors"}


def test_no_format_family_is_chosen_by_comparing_its_name():
    found = []
    for name, path in package_modules().items():
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
    fake_package(tmp_path, monkeypatch,
                 {"engine/x.py": 'def f(fmt):\n    return fmt == "modelopt"\n'})
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
    for name, path in package_modules().items():
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
    fake_package(tmp_path, monkeypatch, {"stages/x.py": 'def f(method):\n'
                                                        '    return method == "gptq"\n'
                                                        'def g(m):\n    return m in ("rtn",)\n'})
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
    for name, path in package_modules().items():
        if name.startswith(CHOICE_LIST_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and e.value in names for e in node.elts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "choice lists kept outside the registries:\n" + "\n".join(found)


def test_the_choice_list_check_finds_a_copy(tmp_path, monkeypatch):
    """The walk above is not vacuous: a copy of the output formats in a CLI module is found."""
    fake_package(tmp_path, monkeypatch,
                 {"cli/x.py": 'FORMATS = ("compressed-tensors", "modelopt")\n'})
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
    for name, path in package_modules().items():
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
    fake_package(tmp_path, monkeypatch, {"options.py": 'QUANTIZE_METHODS = ("rtn", "gptq")\n'
                                         'CRITERIA = {"reap": "saliency", "frequency": "count"}\n'
                                         'SETTINGS = ["steps", "tokens"]\n'})
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
    for name, path in package_modules().items():
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
    fake_package(tmp_path, monkeypatch, {"stages/x.py": (
        'def f(repair, s, options, tn):\n    a = repair != "none"\n'
        '    b = s.method == "router"\n    c = options.get("compensate") in ("down",)\n'
        '    return a, b, c, tn.part == "down"\n')})
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


# The GPU budget is resolved in one place: only kconvert.gpu.budget reads what a card has free
# (torch.cuda.mem_get_info) and makes a run's GpuContext from it (GpuRequest.context, once per
# run); every other step is handed that context.
BUDGET_MODULE = "kconvert.gpu.budget"


def test_gpu_budget_resolved_in_one_place():
    found = []
    for name, path in package_modules().items():
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
    budget = tmp_path.joinpath(*BUDGET_MODULE.split(".")).with_suffix(".py")
    fake_package(tmp_path, monkeypatch, {
        str(budget.relative_to(tmp_path / "kconvert")):
            "import torch\n\nfree = torch.cuda.mem_get_info(0)\n",
        "calibrate/x.py": "import torch\n\n\ndef f():\n"
                          "    return torch.cuda.mem_get_info(0)[0]\n",
        "y.py": f"from {BUDGET_MODULE} import GpuContext\n\nctx = GpuContext('cuda', 1, 1)\n"})
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError) as err:
        test_gpu_budget_resolved_in_one_place()
    message = str(err.value)
    assert "kconvert/calibrate/x.py:5: reads the free GPU memory" in message
    assert "kconvert/y.py:3: makes a GpuContext" in message
    assert str(budget.relative_to(tmp_path)) not in message


