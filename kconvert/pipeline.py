"""Recipes: declarative TOML files in `pipelines/` naming the stages of a conversion.

A recipe is a list of `[[stages]]` tables (`stage = "dequant" | "prune" | "sparsify" |
"quantize" | "densify"` plus that stage's options) and optionally `requires_source`, a codec
the source must contain. Command-line options override the recipe's stage options.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from kconvert.codecs import DenseCodec
from kconvert.errors import KconvertError
from kconvert.sparsify import Densify, Sparsify
from kconvert.stages import Dequant, Quantize, Stage, parse_targets


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
    stages = tuple(data.get("stages", ()))
    if not stages:
        raise KconvertError("recipe has no [[stages]]", file=str(path))
    return Recipe(data.get("name", path.stem), data.get("description", ""), stages,
                  data.get("requires_source"))


def build_stages(recipe: Recipe, overrides: dict) -> list[Stage]:
    """Stage objects from a recipe; non-None `overrides` replace the recipe's options."""
    stages: list[Stage] = []
    given = {k: v for k, v in overrides.items() if v is not None}
    for spec in recipe.stages:
        kind = spec.get("stage")
        opts = {**spec, **given}
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
                data=opts.get("data_record"), hessians=opts.get("hessians")))
        elif kind == "densify":
            stages.append(Densify())
        elif kind == "prune":
            # The plan is data, not a recipe option: `kconvert reap` (or --plan) supplies it.
            if overrides.get("prune") is None:
                raise KconvertError(f"recipe {recipe.name} prunes experts: give a plan "
                                    "(kconvert reap ... --plan FILE | --stats DIR | --data FILE)")
            stages.append(overrides["prune"])
        elif kind == "quantize":
            if opts.get("format", "compressed-tensors") not in ("compressed-tensors", "modelopt"):
                raise KconvertError(f"unknown format {opts['format']!r}")
            stages.append(Quantize(
                targets=parse_targets(opts.get("targets", ["experts"])),
                fmt=opts.get("format", "compressed-tensors"),
                block_scale=opts.get("block_scale", "mse"),
                act_stats=opts.get("act_stats"),
            ))
        else:
            raise KconvertError(f"unknown stage {kind!r} in recipe {recipe.name}")
    kinds = [type(s) for s in stages]
    if Sparsify in kinds and Quantize not in kinds[kinds.index(Sparsify):]:
        raise KconvertError(f"recipe {recipe.name}: sparsify must be followed by a quantize "
                            "stage (p48 output is NVFP4)")
    return stages
