"""The command-line reference, `docs/cli.md`, rendered from the Typer app itself.

The page is generated so that it cannot drift from the commands: `tests/test_docs.py` compares the file with
`markdown()`. It walks the Click tree the app builds and writes every command's usage, help and options in
a fixed form: no terminal width, no rich markup, nothing read from the machine, and only the attributes
that Click and Typer have long had (Typer 0.29 carries its own copy of Click, so nothing here checks
classes).

Regenerate with `python -m rvqtts.cli.reference > docs/cli.md`.
"""

from __future__ import annotations

from typing import Any

import typer

from rvqtts.cli import app

REGENERATE = "python -m rvqtts.cli.reference > docs/cli.md"


def _paragraphs(text: str | None) -> list[str]:
    """Help text as paragraphs of one line each (Click's `\\f` ends what is shown, `\\b` lines are dropped)."""
    if not text:
        return []
    kept = "\n".join(line for line in text.split("\f")[0].splitlines() if line.strip() != "\b")
    return [" ".join(block.split()) for block in kept.split("\n\n") if block.strip()]


def _cell(text: str) -> str:
    """Text fit for one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _is_option(param: Any) -> bool:
    return param.param_type_name == "option"


def _names(param: Any) -> str:
    if not _is_option(param):
        return f"`{param.name.upper()}`"
    return " / ".join(", ".join(f"`{name}`" for name in names) for names in (param.opts, param.secondary_opts) if names)


def _default(param: Any) -> str:
    if param.required:
        return "required"
    default = param.default
    if _is_option(param) and param.is_flag:
        if param.secondary_opts:
            return f"`{param.opts[0] if default else param.secondary_opts[0]}`"
        return "on" if default else "off"
    if default is None or default == "" or param.show_default is False:
        return ""
    return f"`{default}`"


def _table(params: list[Any]) -> list[str]:
    shown = [param for param in params if not getattr(param, "hidden", False)]
    if not shown:
        return []
    rows = [f"| {_names(param)} | {_default(param)} | {_cell(getattr(param, 'help', None) or '')} |" for param in shown]
    return ["| argument or option | default | meaning |", "|---|---|---|", *rows, ""]


def _usage(path: str, command: Any) -> str:
    pieces = [path, "[OPTIONS]"]
    for param in command.params:
        if not _is_option(param) and not getattr(param, "hidden", False):
            name = param.name.upper()
            pieces.append(name if param.required else f"[{name}]")
    if hasattr(command, "commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def _walk(path: str, command: Any) -> list[tuple[str, Any]]:
    """The command and every visible command below it, depth first, in the order they were added (the
    order of `--help`)."""
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            found += _walk(f"{path} {name}", sub)
    return found


def markdown() -> str:
    """`docs/cli.md`: every command's usage, help and options, from the app's own definitions."""
    commands = _walk("rvqtts", typer.main.get_command(app))
    intro = (
        f"Generated from the commands' own help by `{REGENERATE}`; `tests/test_docs.py` fails when this "
        "page and the commands differ, so edit the help in `rvqtts/cli/`, not this page. Every command "
        "also takes `--help`."
    )
    lines = ["# The rvqtts command line", "", intro, ""]
    for path, command in commands[1:]:
        summary = _paragraphs(command.short_help or command.help)[:1]
        lines.append(f"- [`{path}`](#{path.replace(' ', '-')}){': ' + summary[0] if summary else ''}")
    lines.append("")
    for path, command in commands:
        lines += [f"{'#' * min(path.count(' ') + 2, 4)} `{path}`", "", "```text", _usage(path, command), "```", ""]
        for paragraph in _paragraphs(command.help):
            lines += [paragraph, ""]
        lines += _table(command.params)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
