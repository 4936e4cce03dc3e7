"""Recipes: `kconvert run` on the built-in int4-to-nvfp4 recipe gives the command's bytes."""

from __future__ import annotations

import pytest

from conftest import BUNDLED
from kconvert.driver.convert import RunControl, convert
from kconvert.driver.recipes import load_recipe
from kconvert.errors import KconvertError


def _shard_bytes(d):
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


def test_recipe_file_equals_builtin_command(tmp_path):
    quiet = RunControl(quiet=True)
    convert(str(BUNDLED), str(tmp_path / "a"), load_recipe("int4-to-nvfp4"), {}, quiet)
    recipe = tmp_path / "mine.toml"
    recipe.write_text(
        'name = "mine"\n[[stages]]\nstage = "dequant"\n'
        '[[stages]]\nstage = "quantize"\ntargets = ["experts"]\nblock_scale = "mse"\n'
    )
    convert(str(BUNDLED), str(tmp_path / "b"), load_recipe(str(recipe)), {}, quiet)
    a, b = _shard_bytes(tmp_path / "a"), _shard_bytes(tmp_path / "b")
    assert a and a == b


def test_recipe_options_are_overridden_and_validated(tmp_path):
    quiet = RunControl(quiet=True)
    m = convert(str(BUNDLED), str(tmp_path / "a"), load_recipe("int4-to-nvfp4"),
                {"block_scale": "amax"}, quiet)
    assert m.options["quantize"]["block_scale"] == "amax"
    with pytest.raises(KconvertError, match="unknown --targets"):
        convert(str(BUNDLED), str(tmp_path / "b"), load_recipe("int4-to-nvfp4"),
                {"targets": "embeddings"}, quiet)
    with pytest.raises(KconvertError, match="no recipe"):
        load_recipe("no-such-recipe")


def test_int4_recipe_refuses_a_bf16_source(tmp_path, fixture_dir):
    with pytest.raises(KconvertError, match="int4-pack-quantized"):
        convert(str(fixture_dir("bf16")), str(tmp_path / "o"), load_recipe("int4-to-nvfp4"), {},
                RunControl(quiet=True))


def test_every_stage_kind_builds_the_stage_it_names_and_records():
    """A kind's factory builds a stage of that name whose manifest record is the kind's record
    type, and the manifest's RunRecord has one field per kind."""
    from kconvert.stages import KINDS
    from kconvert.stages.prune import Prune
    from kconvert.stages.records import RunRecord

    assert set(RunRecord.model_fields) == {"recipe", *KINDS}
    prune = Prune(keep=((1, (0, 2)),), plan_json="{}")
    for name, kind in KINDS.items():
        stage = kind.build({}, prune if kind.input_type is Prune else None)
        assert stage.name == name and type(stage.record()) is kind.record_type, name
        RunRecord(recipe="r", **{name: stage.record()})


def test_prepared_inputs_are_typed_by_stage_kind(tmp_path):
    """What a command prepares from the source reaches a stage only as the input type its kind
    declares, and only a stage the recipe has."""
    from kconvert.driver.recipes import build_stages
    from kconvert.stages.prune import Prune

    prune = Prune(keep=((1, (0, 2)),), plan_json="{}")
    stages = build_stages(load_recipe("reap"), {}, {"prune": prune})
    assert stages == [prune]
    with pytest.raises(KconvertError, match="needs a plan"):
        build_stages(load_recipe("reap"), {}, {})
    with pytest.raises(TypeError, match="takes Prune"):
        build_stages(load_recipe("reap"), {}, {"prune": {"keep": 2}})
    with pytest.raises(TypeError, match="takes none"):
        build_stages(load_recipe("int4-to-nvfp4"), {}, {"prune": prune})
    with pytest.raises(KconvertError, match="sparsify must be followed by a quantize"):
        recipe = tmp_path / "p48.toml"
        recipe.write_text('[[stages]]\nstage = "sparsify"\n')
        build_stages(load_recipe(str(recipe)), {}, {})
