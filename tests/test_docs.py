"""The docs that can go stale: docs/cli.md against the commands, and the links between the Markdown pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rvqtts.cli.reference import REGENERATE, markdown

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.MULTILINE | re.DOTALL)


def test_cli_reference_matches_the_commands():
    page = ROOT / "docs" / "cli.md"
    written = page.read_text(encoding="utf-8") if page.exists() else ""
    if written != markdown():
        pytest.fail(f"docs/cli.md differs from the commands' help: regenerate it with `{REGENERATE}`", pytrace=False)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for a page's headings (lower case, punctuation dropped, spaces as hyphens,
    repeats numbered), outside fenced code."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            candidate, n = slug, 0
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_links_between_pages_resolve(page):
    broken = []
    for target in LINK.findall(CODE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {', '.join(broken)}"


def test_the_readme_test_command_is_what_ci_runs():
    """CI runs `.ci/run`, whose command must stay the README's (a fresh machine's set-up runs the same)."""
    ci = next(line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if "pytest" in line)
    assert ci in (ROOT / "README.md").read_text(encoding="utf-8"), ".ci/run's command differs from the README's"
