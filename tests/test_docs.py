"""The README is a front door and the manual's links hold: every relative link in README.md and
docs/*.md names a file that exists, and a `#fragment` names a heading of its target (GitHub's
slugs); the README stays at most 200 lines with the two commands in its first 40. Each check is
also shown to fail on a planted page."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from conftest import ROOT

README_MAX_LINES = 200
COMMANDS_WITHIN = 40
TWO_COMMANDS = ("make demo", "make test")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def prose(text: str) -> str:
    """`text` without fenced code blocks and code spans: links and headings there are code."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (code marks and link targets dropped), lower
    case, every character that is not a letter, digit, `_`, `-` or space removed, spaces
    made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of `page`, repeated slugs numbered -1, -2, ... as GitHub does."""
    seen: Counter[str] = Counter()
    found = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(1))
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def broken_links(pages: list[Path]) -> list[str]:
    """`page: target (why)` for each relative link of `pages` that does not resolve."""
    broken = []
    for page in pages:
        for target in LINK.findall(prose(page.read_text())):
            if not target or EXTERNAL.match(target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{page.name}: {target} (no heading #{fragment} in {dest.name})")
    return broken


def front_door_problems(readme: Path) -> list[str]:
    lines = readme.read_text().splitlines()
    problems = []
    if len(lines) > README_MAX_LINES:
        problems.append(f"{len(lines)} lines, more than {README_MAX_LINES}")
    head = [line.strip() for line in lines[:COMMANDS_WITHIN]]
    problems += [f"`{cmd}` is not in the first {COMMANDS_WITHIN} lines" for cmd in TWO_COMMANDS
                 if cmd not in head]
    return problems


def manual() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = manual()
    assert len(pages) > 10 and (ROOT / "docs" / "README.md") in pages
    assert not broken_links(pages)


def test_the_readme_is_a_front_door():
    assert not front_door_problems(ROOT / "README.md")


def test_slugs_are_githubs():
    assert slug("§1. INT4 \"pack-quantized\" (compressed-tensors): Kimi-K2.5") == \
        "1-int4-pack-quantized-compressed-tensors-kimi-k25"
    assert slug("`kconvert eval`: is it still the same model?") == \
        "kconvert-eval-is-it-still-the-same-model"
    assert slug("The exact MXFP4 -> NVFP4 cast") == "the-exact-mxfp4---nvfp4-cast"
    assert slug("Learned compression (`--method learned`)") == \
        "learned-compression---method-learned"


def test_a_planted_broken_link_or_anchor_is_found(tmp_path):
    # The pages' names are built, so that test_architecture_rules' scan for cited documents does
    # not take them for citations.
    target, page, missing = (f"{name}.{'md'}" for name in ("target", "page", "missing"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / target).write_text(
        "# Target page\n\n## Step two: `run`\n\n## Step two: `run`\n\n"
        "```\n# not a heading\n```\n")
    (tmp_path / page).write_text(
        "# Page\n\n"
        f"[ok](sub/{target}) [ok](sub/{target}#step-two-run) [ok](sub/{target}#step-two-run-1)"
        f" [ok](#page) [ok](https://example.invalid/{missing}) ![ok](sub)\n"
        f"[gone](sub/{missing}) [bad anchor](sub/{target}#step-three)"
        f" [code heading](sub/{target}#not-a-heading) [self](#nowhere)\n\n"
        f"`[in a code span]({missing})`\n\n```\n[in a fence]({missing})\n```\n")
    assert broken_links([tmp_path / page]) == [
        f"{page}: sub/{missing} (no such file)",
        f"{page}: sub/{target}#step-three (no heading #step-three in {target})",
        f"{page}: sub/{target}#not-a-heading (no heading #not-a-heading in {target})",
        f"{page}: #nowhere (no heading #nowhere in {page})"]


def test_a_long_readme_or_late_commands_fail(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```\nmake demo\nmake test\n```\n")
    assert front_door_problems(readme) == []
    readme.write_text("# x\n" + "\n" * (README_MAX_LINES + 1))
    assert front_door_problems(readme) == [
        f"{README_MAX_LINES + 2} lines, more than {README_MAX_LINES}",
        f"`make demo` is not in the first {COMMANDS_WITHIN} lines",
        f"`make test` is not in the first {COMMANDS_WITHIN} lines"]
    readme.write_text("# x\n\nmake demo\n" + "\n" * COMMANDS_WITHIN + "make test\n")
    assert front_door_problems(readme) == [
        f"`make test` is not in the first {COMMANDS_WITHIN} lines"]


def test_the_readme_names_the_locked_versions():
    """Every version the README's Install section calls tested is the one constraints.txt
    pins (torch's is the Makefile's TORCH), so a refreshed lock cannot leave it stale."""
    lock = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    lock["torch"] = re.search(r"TORCH \?= torch==(\S+)", (ROOT / "Makefile").read_text())[1]
    tested = re.search(r"Tested: (.*?) \(`make test`", (ROOT / "README.md").read_text(),
                       re.S)[1]
    named = re.findall(r"([a-z][a-z0-9-]*) (\d[\w.]*)", tested.replace("\n", " "))
    assert len(named) >= 7
    for name, version in named:
        assert lock.get(name) == version, (name, version, lock.get(name))
