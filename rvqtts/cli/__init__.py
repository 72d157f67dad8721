"""The `rvqtts` command line: a thin layer over the library, one module per command group.

Exit codes: 0 done; 1 some utterances of a batch failed (the rest were written), or the model produced
NaN or inf; 2 bad input, with nothing written. Standard output carries only audio (`-o -`) or the listing
asked for; everything for people goes to standard error.
"""

from __future__ import annotations

import typer

from rvqtts.cli import bench, models, read, serve, synth, tuning  # noqa: F401,I001  (each registers its commands, in help order)
from rvqtts.cli.common import app


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"rvqtts {version('rvqtts')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show rvqtts's version and exit."
    ),
) -> None:
    """Fast, exact Qwen3-TTS synthesis with RVQ position-aware speculative decoding."""


def main() -> None:
    app(prog_name="rvqtts")
