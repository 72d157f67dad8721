"""The docs that can go stale: docs/cli.md against the commands, and the links between the Markdown pages; and
the limits that keep the code and the reference pages short enough to read."""

from __future__ import annotations

import ast
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


MAX_FUNCTION_LINES = 60  # from `def` to the function's last line, its docstring included (decorators not counted)
LONG_FUNCTIONS_ALLOWED = ("cli/",)  # typer commands: their options and help
FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def test_no_function_is_over_sixty_lines():
    """Long functions are split into small named steps (prefill, decode one token, ...), so each reads at once."""
    long = []
    for path in sorted((ROOT / "rvqtts").rglob("*.py")):
        relative = path.relative_to(ROOT / "rvqtts").as_posix()
        if relative.startswith(LONG_FUNCTIONS_ALLOWED):
            continue
        functions = (n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, FUNCTION))
        for node in functions:
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"rvqtts/{relative}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_the_benchmarks_page_stays_a_reference():
    """docs/benchmarks.md says how things are now; superseded measurements go to docs/history/benchmarks.md."""
    lines = len((ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines())
    assert lines < 500, f"docs/benchmarks.md has {lines} lines: move past measurements to docs/history/benchmarks.md"
