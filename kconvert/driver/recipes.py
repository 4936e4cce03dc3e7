"""Recipes: declarative TOML files in `pipelines/` naming the stages of a conversion.

A recipe is a list of `[[stages]]` tables (`stage = ` a kind of kconvert.stages.KINDS, plus
that stage's settings) and optionally `requires_source`, a codec (by name, or by the grid it
stores: "mxfp4" is either MXFP4 layout) the source must contain, and `grid`, the 4-bit grid
its name promises ("nvfp4" for int4-to-nvfp4): a --format of another grid is refused, naming
the recipe that writes it. Command-line options override the recipe's stage settings.

Each stage kind declares which options it takes; a recipe key or a command-line option that no
stage of the recipe takes is an error naming the stages that would.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kconvert.engine.stage import Stage
from kconvert.errors import KconvertError, UsageError
from kconvert.formats import OUTPUT_CODECS
from kconvert.stages import KINDS
from kconvert.stages.base import stage_settings

RECIPE_KEYS = ("name", "description", "requires_source", "grid", "stages")


def builtin_dir() -> Path:
    """`kconvert/pipelines` in an installed wheel, the repo's `pipelines/` in a checkout."""
    here = Path(__file__).resolve().parents[1]
    packaged = here / "pipelines"
    return packaged if packaged.is_dir() else here.parent / "pipelines"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    stages: tuple[dict, ...]
    requires_source: str | None = None
    grid: str | None = None  # the grid its output is in, where its name promises one

    @property
    def kinds(self) -> list[str]:
        return [s.get("stage") for s in self.stages]


def load_recipe(name_or_path: str) -> Recipe:
    path = Path(name_or_path)
    if not path.is_file():
        path = builtin_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in builtin_dir().glob("*.toml"))
        raise KconvertError(f"no recipe {name_or_path!r}; built-in recipes: {known}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise KconvertError(f"bad recipe: {exc}", file=str(path)) from exc
    except UnicodeDecodeError as exc:
        raise KconvertError(f"bad recipe: not UTF-8 text (byte {exc.start}); TOML files are "
                            "UTF-8", file=str(path)) from exc
    unknown = sorted(set(data) - set(RECIPE_KEYS))
    if unknown:
        hint = _did_you_mean(unknown[0], RECIPE_KEYS)
        raise KconvertError(f"unknown recipe key {unknown[0]!r}{hint}; a recipe has "
                            f"{', '.join(RECIPE_KEYS)}", file=str(path))
    stages = tuple(data.get("stages", ()))
    if not stages:
        raise KconvertError("recipe has no [[stages]]", file=str(path))
    for number, spec in enumerate(stages, 1):
        _check_stage_table(spec, number, str(path))
    # a stage that decodes every module after one that encodes would undo it
    kinds = [s["stage"] for s in stages]
    encoding = [k for k in kinds if KINDS[k].encodes]
    decoding = [k for k in kinds if KINDS[k].decodes]
    if decoding and encoding and kinds.index(decoding[0]) > kinds.index(encoding[0]):
        raise KconvertError(f"stage {decoding[0]} after {encoding[0]} would decode what "
                            f"{encoding[0]} encodes: {decoding[0]} comes first (it decodes the "
                            "source)", file=str(path))
    grid = data.get("grid")
    if grid is not None and grid not in {c.grid for c in OUTPUT_CODECS.values()}:
        raise KconvertError(f"unknown grid {grid!r}; formats write "
                            f"{sorted({c.grid for c in OUTPUT_CODECS.values()})}", file=str(path))
    return Recipe(data.get("name", path.stem), data.get("description", ""), stages,
                  data.get("requires_source"), grid)


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _takers(option: str) -> list[str]:
    """The stage kinds that take `option`."""
    return [name for name, kind in KINDS.items() if option in kind.options]


def _check_stage_table(spec: dict, number: int, where: str) -> None:
    """A [[stages]] table names a known stage kind and only settings that kind takes."""
    name = spec.get("stage") if isinstance(spec, dict) else None
    if name not in KINDS:
        raise KconvertError(f"[[stages]] #{number}: unknown stage {name!r}; stages: "
                            f"{', '.join(KINDS)}", file=where)
    kind = KINDS[name]
    for key in spec:
        if key == "stage" or key in kind.settings:
            continue
        if key in kind.input_options:
            raise KconvertError(f"[[stages]] #{number} ({name}): {key!r} is not a recipe "
                                f"setting; give --{key.replace('_', '-')} on the command line",
                                file=where)
        others = _takers(key)
        hint = (f"it is an option of stage {', '.join(others)}" if others
                else f"no stage takes it{_did_you_mean(key, kind.settings)}")
        accepted = ", ".join(kind.settings) or "no settings"
        raise KconvertError(f"[[stages]] #{number} ({name}): unknown key {key!r}: {hint}; "
                            f"{name} takes {accepted}", file=where)


def check_options(recipe: Recipe, given: Iterable[str]) -> None:
    """Refuse a given stage option (by name, see StageKind.options) that no stage of `recipe`
    takes: it would be silently dropped. Options of no stage kind (run controls) pass."""
    kinds = recipe.kinds
    for option in given:
        takers = _takers(option)
        if takers and not set(takers) & set(kinds):
            users = sorted(p.stem for p in builtin_dir().glob("*.toml")
                           if set(takers) & set(load_recipe(str(p)).kinds))
            raise UsageError(
                f"--{option.replace('_', '-')} is not used by recipe {recipe.name} (stages "
                f"{', '.join(kinds)}); it is an option of stage {', '.join(takers)}"
                + (f" (recipes: {', '.join(users)})" if users else ""))


def build_stages(recipe: Recipe, settings: Mapping[str, object],
                 inputs: Mapping[str, object]) -> list[Stage]:
    """The stages of `recipe`. Non-None `settings` (by name, see StageKind.settings; a
    command checks them with check_options) replace the recipe's, each in the first stage that
    takes it (kconvert.stages.base.stage_settings); `inputs` holds, by stage
    kind, what a command prepared from the opened source (an instance of that kind's
    StageKind.input_type)."""
    given = {k: v for k, v in settings.items() if v is not None}
    for name, prepared in inputs.items():
        wanted = KINDS[name].input_type if name in recipe.kinds else None
        if wanted is None or not isinstance(prepared, wanted):
            raise TypeError(f"a {type(prepared).__name__} for stage {name!r} of recipe "
                            f"{recipe.name}, which takes {wanted.__name__ if wanted else 'none'}")
    stages: list[Stage] = []
    for spec in stage_settings(recipe.stages, given, KINDS):  # checked by load_recipe
        kind = KINDS[spec["stage"]]
        chosen = {k: v for k, v in spec.items() if k in kind.settings}
        stages.append(kind.build(chosen, inputs.get(kind.name)))
    names = recipe.kinds
    for at, name in enumerate(names):
        if KINDS[name].followed_by is not None:
            later, why = KINDS[name].followed_by
            if later not in names[at + 1:]:
                raise KconvertError(f"recipe {recipe.name}: {name} must be followed by a {later} "
                                    f"stage ({why})")
    return stages


def check_format(recipe: Recipe, fmt: str | None) -> None:
    """Refuse a --format whose grid is not the one the recipe promises (int4-to-mxfp4
    --format compressed-tensors would write NVFP4 under an MXFP4 recipe's name and record),
    naming the built-in recipes of the same stages that write that grid."""
    if fmt is None or recipe.grid is None or fmt not in OUTPUT_CODECS:
        return
    grid = OUTPUT_CODECS[fmt].grid
    if grid == recipe.grid:
        return
    others = sorted(r.name for p in builtin_dir().glob("*.toml")
                    if (r := load_recipe(str(p))).grid == grid and r.kinds == recipe.kinds
                    and r.requires_source == recipe.requires_source)
    instead = " or ".join(f"`kconvert {o} --format {fmt}`" for o in others) or \
        f"`kconvert quantize --format {fmt}`"
    raise UsageError(f"--format {fmt} writes {grid.upper()}, and {recipe.name} writes "
                     f"{recipe.grid.upper()}: run {instead}")
