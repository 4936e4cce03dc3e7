"""What a plug-in declares once, and the registry that holds the declarations of one family.

A plug-in (a method, a pruning criterion, a router-repair or compensation kind) is a
`Declaration`: its name, a one-line summary, its settings as a pydantic model (each field's
type, default, bounds and description), the stage kinds that take it, what it needs, and the
pydantic models of what it records (fields it adds to its stage's record, and per matrix in
the manifest). Its behaviour is a class elsewhere (`impl`, "module:Class", imported when first
run), so that the declarations, and with them the command line, import no torch.

Everything else is derived from the declarations: the command line's choices and options with
their help (kconvert.cli.declared), the recipe keys and the Python API's keywords (each stage
kind's settings, kconvert.stages), the stage records and the manifest's per-matrix entries,
and docs/methods.md (kconvert.plugins.docs).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kconvert.errors import KconvertError


class NoSettings(BaseModel):
    """The settings of a plug-in that has none."""

    model_config = ConfigDict(extra="forbid")


# What a plug-in may need beyond the source: nothing, `kconvert calibrate`'s statistics
# (--stats DIR), or calibration data it runs through the model itself (--data FILE).
NEEDS = (None, "stats", "data")


@dataclass(frozen=True)
class Declaration:
    """One plug-in, declared once."""

    name: str
    kinds: tuple[str, ...]  # the stage kinds that take it (a recipe's `stage = ...`)
    summary: str  # one line: the command line's help and the docs table
    impl: str | type | None = None  # its behaviour: a class, or "module:Class"
    settings: type[BaseModel] = NoSettings  # its own settings (recipe keys, options, keywords)
    needs: str | None = None  # one of NEEDS
    gpu: bool = False  # whether it takes GPU memory of its own (its class plans the bytes)
    record: type[BaseModel] | None = None  # the fields it adds to its stage's record
    matrix_record: type[BaseModel] | None = None  # what the manifest records per matrix
    default: bool = False  # what its kinds take when none is named

    def load(self) -> Any:
        """Its behaviour's class."""
        if self.impl is None or not isinstance(self.impl, str):
            return self.impl
        module, _, name = self.impl.partition(":")
        return getattr(importlib.import_module(module), name)

    def defaults(self) -> dict[str, Any]:
        """Its settings' defaults, by name."""
        return {k: f.default for k, f in self.settings.model_fields.items()}

    def check(self, given: dict[str, Any]) -> dict[str, Any]:
        """`given` (its own settings, by name) checked against its settings model: all of them
        with the defaults filled in, or KconvertError naming the option and what is wrong."""
        try:
            return self.settings.model_validate(given).model_dump()
        except ValidationError as exc:
            error = exc.errors()[0]
            key = str(error["loc"][0]) if error["loc"] else "?"
            raise KconvertError(f"--{key.replace('_', '-')} {given.get(key)!r}: "
                                f"{error['msg']}") from exc


@dataclass
class Registry:
    """The declarations of one family of plug-ins (`what`: its name in messages), in the
    order they were registered."""

    what: str
    declared: list[Declaration] = field(default_factory=list)

    def register(self, declaration: Declaration) -> Declaration:
        """Add a plug-in: a name is one plug-in per stage kind."""
        for kind in declaration.kinds:
            if self.get(kind, declaration.name) is not None:
                raise ValueError(f"{self.what} {declaration.name!r} of {kind} is registered "
                                 "twice")
        self.declared.append(declaration)
        return declaration

    def unregister(self, declaration: Declaration) -> None:
        self.declared.remove(declaration)

    def __iter__(self) -> Iterator[Declaration]:
        return iter(self.declared)

    def of(self, kind: str) -> dict[str, Declaration]:
        """The plug-ins stage kind `kind` takes, by name."""
        return {d.name: d for d in self.declared if kind in d.kinds}

    def get(self, kind: str, name: str) -> Declaration | None:
        return self.of(kind).get(name)

    def names(self, kind: str | None = None) -> tuple[str, ...]:
        """The names (of one stage kind's plug-ins, or of all, each once)."""
        found = self.declared if kind is None else self.of(kind).values()
        return tuple(dict.fromkeys(d.name for d in found))

    def default(self, kind: str) -> Declaration:
        return next(d for d in self.of(kind).values() if d.default)

    def named(self, kind: str, name: str | None, option: str) -> Declaration:
        """The plug-in `name` (None: the kind's default) of stage kind `kind`, or a clear error
        (naming the kind it belongs to where it is another's)."""
        if name is None:
            return self.default(kind)
        found = self.get(kind, name)
        if found is not None:
            return found
        others = [k for d in self.declared if d.name == name for k in d.kinds]
        what = f"is a {others[0]} {self.what}" if others else f"is not a {self.what}"
        raise KconvertError(f"--{option} {name} {what}; this run's {kind} stage takes "
                            f"--{option} {' or '.join(self.of(kind))}")

    def setting_names(self, kind: str) -> tuple[str, ...]:
        """The settings of stage kind `kind`'s plug-ins, each once."""
        return tuple(dict.fromkeys(k for d in self.of(kind).values()
                                   for k in d.settings.model_fields))

    def record_fields(self, kind: str) -> dict[str, tuple[Any, Any]]:
        """The fields kind `kind`'s plug-ins add to its record, each optional (a plug-in sets
        only its own), for pydantic.create_model."""
        out: dict[str, tuple[Any, Any]] = {}
        for d in self.of(kind).values():
            for name, info in (d.record.model_fields.items() if d.record else ()):
                out.setdefault(name, (info.annotation | None, info))
        return out
