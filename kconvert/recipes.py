"""Recipes: declarative TOML files in `pipelines/` naming the stages of a conversion.

A recipe is a list of `[[stages]]` tables (`stage = "dequant" | "prune" | "sparsify" |
"quantize" | "densify"` plus that stage's settings) and optionally `requires_source`, a codec
the source must contain. Command-line options override the recipe's stage settings.

`STAGE_KINDS` declares, once, which options each stage kind takes; a recipe key or a
command-line option that no stage of the recipe takes is an error naming the stages that would.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kconvert.errors import KconvertError
from kconvert.formats.dense import DenseCodec
from kconvert.stages.base import Stage
from kconvert.stages.densify import Densify
from kconvert.stages.dequant import Dequant
from kconvert.stages.quantize import Quantize, parse_targets
from kconvert.stages.sparsify import Sparsify


@dataclass(frozen=True)
class StageOptions:
    """The options one stage kind takes. A name is both the recipe key and the long
    command-line option with `_` for `-` (`block_scale` is `--block-scale`)."""

    # Set in the stage's [[stages]] table; the command-line option, when given, wins.
    settings: tuple[str, ...] = ()
    # Command line only: what the command prepares for the stage from the opened source
    # (a pruning plan, calibration inputs).
    inputs: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.settings + self.inputs


CALIBRATION_INPUTS = ("data", "samples", "seq_len", "batch_size", "seed")
STAGE_KINDS: dict[str, StageOptions] = {
    "dequant": StageOptions(settings=("dtype",)),
    "prune": StageOptions(inputs=("keep", "prune_ratio", "criterion", "plan", "stats",
                                  *CALIBRATION_INPUTS, "save_stats")),
    "sparsify": StageOptions(settings=("pattern", "method", "group_size", "storage", "stats"),
                             inputs=CALIBRATION_INPUTS),
    "quantize": StageOptions(settings=("targets", "format", "block_scale", "act_stats")),
    "densify": StageOptions(),
}
# What a command's prepare(ckpt) hands build_stages besides settings: the Prune stage itself
# and SparseGPT's calibration (see kconvert.cli).
PREPARED = ("prune", "hessians", "data_record")
RECIPE_KEYS = ("name", "description", "requires_source", "stages")


def builtin_dir() -> Path:
    """`kconvert/pipelines` in an installed wheel, the repo's `pipelines/` in a checkout."""
    here = Path(__file__).resolve().parent
    packaged = here / "pipelines"
    return packaged if packaged.is_dir() else here.parent / "pipelines"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    stages: tuple[dict, ...]
    requires_source: str | None = None

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
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise KconvertError(f"bad recipe: {exc}", file=str(path)) from exc
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
    return Recipe(data.get("name", path.stem), data.get("description", ""), stages,
                  data.get("requires_source"))


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _takers(option: str) -> list[str]:
    """The stage kinds that take `option`."""
    return [kind for kind, takes in STAGE_KINDS.items() if option in takes.names]


def _check_stage_table(spec: dict, number: int, where: str) -> None:
    """A [[stages]] table names a known stage kind and only settings that kind takes."""
    kind = spec.get("stage") if isinstance(spec, dict) else None
    if kind not in STAGE_KINDS:
        raise KconvertError(f"[[stages]] #{number}: unknown stage {kind!r}; stages: "
                            f"{', '.join(STAGE_KINDS)}", file=where)
    takes = STAGE_KINDS[kind]
    for key in spec:
        if key == "stage" or key in takes.settings:
            continue
        if key in takes.inputs:
            raise KconvertError(f"[[stages]] #{number} ({kind}): {key!r} is not a recipe "
                                f"setting; give --{key.replace('_', '-')} on the command line",
                                file=where)
        others = _takers(key)
        hint = (f"it is an option of stage {', '.join(others)}" if others
                else f"no stage takes it{_did_you_mean(key, takes.settings)}")
        accepted = ", ".join(takes.settings) or "no settings"
        raise KconvertError(f"[[stages]] #{number} ({kind}): unknown key {key!r}: {hint}; "
                            f"{kind} takes {accepted}", file=where)


def check_options(recipe: Recipe, given: Iterable[str]) -> None:
    """Refuse a given stage option (by name, see StageOptions) that no stage of `recipe`
    takes: it would be silently dropped. Options of no stage kind (run controls) pass."""
    kinds = recipe.kinds
    for option in given:
        takers = _takers(option)
        if takers and not set(takers) & set(kinds):
            users = sorted(p.stem for p in builtin_dir().glob("*.toml")
                           if set(takers) & set(load_recipe(str(p)).kinds))
            raise KconvertError(
                f"--{option.replace('_', '-')} is not used by recipe {recipe.name} (stages "
                f"{', '.join(kinds)}); it is an option of stage {', '.join(takers)}"
                + (f" (recipes: {', '.join(users)})" if users else ""))


def build_stages(recipe: Recipe, overrides: dict) -> list[Stage]:
    """Stage objects from a recipe; non-None `overrides` (stage settings, and what a command
    prepared: see PREPARED) replace the recipe's settings."""
    given = {k: v for k, v in overrides.items() if v is not None}
    check_options(recipe, [k for k in given if k not in PREPARED])
    stages: list[Stage] = []
    for number, spec in enumerate(recipe.stages, 1):
        _check_stage_table(spec, number, f"recipe {recipe.name}")
        kind = spec["stage"]
        takes = STAGE_KINDS[kind].settings
        opts = {k: v for k, v in {**spec, **given}.items() if k in takes}
        if kind == "dequant":
            dtype = opts.get("dtype", "BF16")
            if dtype not in DenseCodec.DTYPES:
                raise KconvertError(f"dequant dtype must be one of {sorted(DenseCodec.DTYPES)}")
            stages.append(Dequant(dtype))
        elif kind == "sparsify":
            if opts.get("pattern", "p48") != "p48":
                raise KconvertError(f"unknown sparsity pattern {opts['pattern']!r}; only p48")
            stages.append(Sparsify(
                method=opts.get("method", "magnitude"), group_size=opts.get("group_size", 16),
                storage=opts.get("storage", "dense"), stats=opts.get("stats"),
                data=given.get("data_record"), hessians=given.get("hessians")))
        elif kind == "densify":
            stages.append(Densify())
        elif kind == "prune":
            # The plan is data, not a recipe option: `kconvert reap` (or --plan) supplies it.
            if given.get("prune") is None:
                raise KconvertError(f"recipe {recipe.name} prunes experts: give a plan "
                                    "(kconvert reap ... --plan FILE | --stats DIR | --data FILE)")
            stages.append(given["prune"])
        elif kind == "quantize":
            if opts.get("format", "compressed-tensors") not in ("compressed-tensors", "modelopt"):
                raise KconvertError(f"unknown format {opts['format']!r}")
            stages.append(Quantize(
                targets=parse_targets(opts.get("targets", ["experts"])),
                fmt=opts.get("format", "compressed-tensors"),
                scale_rule=opts.get("block_scale", "mse"),
                act_stats=opts.get("act_stats"),
            ))
    kinds = [type(s) for s in stages]
    if Sparsify in kinds and Quantize not in kinds[kinds.index(Sparsify):]:
        raise KconvertError(f"recipe {recipe.name}: sparsify must be followed by a quantize "
                            "stage (p48 output is NVFP4)")
    return stages
