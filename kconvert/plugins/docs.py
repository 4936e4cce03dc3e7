"""docs/methods.md, written from the plug-ins' declarations
(`python -m kconvert.plugins.docs > docs/methods.md`; a test keeps the committed file current):
per family, each plug-in's name, the stage kinds that take it, what it needs, its settings
with their defaults and help, and what it records."""

from __future__ import annotations

from kconvert.plugins.registry import Declaration, Registry


def _settings(d: Declaration) -> str:
    fields = d.settings.model_fields
    return "<br>".join(f"`--{k.replace('_', '-')}` ({f.default}): {f.description or ''}".strip()
                       for k, f in fields.items()) or "none"


def _records(d: Declaration) -> str:
    parts = [f"stage: {', '.join(f'`{k}`' for k in d.record.model_fields)}"] if d.record else []
    if d.matrix_record:
        parts.append(f"per matrix: `{d.matrix_record.__name__}`")
    return "; ".join(parts) or "none"


def table(registry: Registry, option: str) -> list[str]:
    """The markdown table of one family (`--OPTION NAME` chooses one)."""
    lines = [f"## --{option}", "",
             "| name | stage | default | needs | GPU | settings | records | what it does |",
             "|---|---|---|---|---|---|---|---|"]
    for d in registry:
        lines.append(f"| `{d.name}` | {', '.join(d.kinds)} | {'yes' if d.default else ''} | "
                     f"{d.needs or ''} | {'yes' if d.gpu else ''} | {_settings(d)} | "
                     f"{_records(d)} | {d.summary} |")
    return [*lines, ""]


def render(families: list[tuple[Registry, str]]) -> str:
    lines = ["# Methods and kinds", "",
             "Generated from the plug-ins' declarations (kconvert.plugins) by "
             "`python -m kconvert.plugins.docs > docs/methods.md`; do not edit by hand.", ""]
    for registry, option in families:
        lines += table(registry, option)
    return "\n".join(lines)


def families() -> list[tuple[Registry, str]]:
    """Every registry of plug-ins, with the option that chooses one."""
    from kconvert.plugins.input_scales import INPUT_SCALE_POLICIES
    from kconvert.plugins.methods import METHODS
    from kconvert.plugins.pruning import COMPENSATIONS, CRITERIA, REPAIRS

    return [(METHODS, "method"), (CRITERIA, "criterion"), (REPAIRS, "repair"),
            (COMPENSATIONS, "compensate"), (INPUT_SCALE_POLICIES, "input-scale")]


if __name__ == "__main__":
    print(render(families()))
