"""The command line's options of the plug-ins, made from their declarations
(kconvert.plugins): a choice option per family (--method, --criterion, --repair,
--compensate) listing the names a stage kind takes with their summaries, and one option per
setting with its type, bounds and help. Nothing here names a plug-in."""

from __future__ import annotations

import typing
from collections.abc import Iterable

import annotated_types
import click
from pydantic.fields import FieldInfo

from kconvert.plugins.registry import Declaration, Registry


def _default_text(declared: list[Declaration]) -> str:
    """' [default: NAME]' where the kinds' defaults are one plug-in, per kind otherwise."""
    defaults = {kind: d.name for d in declared if d.default for kind in d.kinds}
    if not defaults:
        return ""
    if len(set(defaults.values())) == 1:
        return f" [default: {next(iter(defaults.values()))}]"
    return " [default: " + ", ".join(f"{n} for {k}" for k, n in defaults.items()) + "]"


def choice_option(registry: Registry, option: str, kinds: Iterable[str], lead: str,
                  default: str | None = None) -> typing.Callable:
    """--OPTION NAME: the plug-ins of `registry` that stage kinds `kinds` take; the help is
    `lead` and each one's summary (and the need it has)."""
    declared = [d for kind in kinds for d in registry.of(kind).values()]
    names = tuple(dict.fromkeys(d.name for d in declared))
    described = "; ".join(
        f"{d.name}" + (f" ({d.kinds[0]})" if sum(e.name == d.name for e in declared) > 1 else "")
        + f": {d.summary}" for d in declared)
    return click.option(f"--{option}", type=click.Choice(names), default=default,
                        show_default=default is not None,
                        help=f"{lead} {described}." + ("" if default else
                                                        _default_text(declared)))


def _click_type(info: FieldInfo) -> tuple[typing.Any, bool]:
    """(click type, is a flag) of a setting."""
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)]), False
    if annotation is bool:
        return None, True
    low = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
    if annotation is int:
        return click.IntRange(min=low, max=high), False
    if annotation is float:
        return click.FloatRange(min=low, max=high), False
    return click.STRING, False


def setting_options(registry: Registry, kinds: Iterable[str]) -> list[typing.Callable]:
    """One option per setting of the plug-ins stage kinds `kinds` take (a setting several
    declare is one option): its type and bounds, its description, and the defaults (per
    plug-in where they differ). Not given, it is None: the plug-in's default applies."""
    by_setting: dict[str, list[tuple[Declaration, FieldInfo]]] = {}
    for kind in kinds:
        for d in registry.of(kind).values():
            for name, info in d.settings.model_fields.items():
                by_setting.setdefault(name, []).append((d, info))
    options = []
    for name, taken in by_setting.items():
        kind, flag = _click_type(taken[0][1])
        defaults = {f"{d.name} ({k})": info.default for d, info in taken for k in d.kinds}
        shown = (str(next(iter(defaults.values()))) if len(set(defaults.values())) == 1 else
                 ", ".join(f"{v} for {who}" for who, v in defaults.items()))
        users = " or ".join(dict.fromkeys(d.name for d, _ in taken))
        help_text = (f"--{registry.what} {users}: "
                     f"{(taken[0][1].description or name).rstrip('.')} [default: {shown}].")
        options.append(click.option(f"--{name.replace('_', '-')}", type=kind, is_flag=flag,
                                    default=None, help=help_text))
    return options
