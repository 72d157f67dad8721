"""What the command groups share: the app, one-line failures and notices, progress, tables and JSON,
output-path checks, and loading a model on the chosen device and dtype."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Optional

import typer

# Plain (click) help: no "<bool>" placeholders after switches, and it reads the same in a pipe or a log.
HELP_STYLE = dict(no_args_is_help=True, rich_markup_mode=None)
app = typer.Typer(
    help="Fast, exact Qwen3-TTS synthesis with RVQ position-aware speculative decoding.",
    add_completion=False,
    pretty_exceptions_enable=False,
    **HELP_STYLE,
)

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
MODEL_HELP = (
    "Hub id or local folder of a Qwen3-TTS 12 Hz model: CustomVoice, Base (a cloned voice) or VoiceDesign (rvqtts "
    "voices says which)."
)
FIRST_STREAM_FRAMES_HELP = "Frames in the first streamed piece (1: first audio soonest)."
STREAM_FRAMES_HELP = "Frames per later streamed piece (12.5 frames = 1 s; 4 = 320 ms)."
DEVICE_HELP = (
    "auto (cuda, then mps, then cpu), cpu, cuda or mps. cuda and mps have not been validated (rvqtts prints a notice "
    "that says so when it runs on them); --device cpu chooses the CPU."
)
DTYPE_HELP = (
    "auto (bfloat16 on cuda, float16 on mps; on a CPU the cheaper of bfloat16 and float32 for one frame's linear maps "
    "at the lines a call carries (--batch-size N), measured once; with RVQTTS_CHOICES=fixed, bfloat16 where the CPU "
    "multiplies it natively, else float32; the speech decoder's own, --decoder-dtype), float32, bfloat16 or float16 "
    "(for every component)."
)
DECODER_DTYPE_HELP = (
    "The speech decoder's dtype: auto (--dtype's where it is given; under --dtype auto on a CPU the cheaper of float32 "
    "and bfloat16 for a frame of decoding, measured once per machine and decoder: its bfloat16 ran 31x slower on an "
    "AVX2-only AMD EPYC, 14-36x on a Zen 4 capped at AVX2), float32, bfloat16 or float16."
)
TREE_HELP = (
    "Draft tree: auto (the tree size decided online from this model's acceptance, counted as it speaks, and this "
    "machine's call costs; 0, the plain loop, where no tree pays; with --backend coreml, the best N measured for the "
    "device), a node budget N (a shipped tree) or a tree file."
)
OFFSETS_HELP = "Draft offsets file; default: shipped offsets matching the model, else zero offsets."
WEIGHTS_HELP = (
    "native (the dtype's own), int8: the linear maps of both loops' layers and heads as 8-bit weights with "
    "per-channel scales (W8A16), or int4: 4-bit weights in groups of 128 inputs with a scale and zero each (W4A16; "
    "it changes the model more than int8). CPUs only; both change the model (docs/engine.md, docs/benchmarks.md)."
)


def fail(message: str) -> None:
    """One line on stderr and exit code 2: the input was wrong, nothing was written."""
    typer.echo(f"rvqtts: error: {message}", err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def refused(*errors: type[Exception], prefix: str = ""):
    """Any of `errors` raised inside ends the command as `fail(prefix + its message)` does."""
    try:
        yield
    except errors as error:
        fail(f"{prefix}{error}")


def say(message: str | None, quiet: bool = False) -> None:
    """`message` on stderr as one of rvqtts's lines, unless quiet or there is none (None or empty)."""
    if message and not quiet:
        typer.echo(f"rvqtts: {message}", err=True)


def check_stream_frames(first: int, frames: int) -> None:
    """--first-stream-frames and --stream-frames, checked before torch loads (rvqtts.synthesis.settings.StreamPacing's
    rule)."""
    if first < 1 or frames < 1:
        fail(f"--first-stream-frames and --stream-frames must be at least 1, got {first}, {frames}")


def ensure_writable(path: Optional[Path], folder: bool = False) -> None:
    """Fail with one line, before any model work, unless a file can be written at `path` (or, with
    `folder`, into the folder `path`; None: nothing to check); nothing is left behind by the check."""
    from rvqtts.support.files import OutputPathError, check_writable

    if path is not None:
        with refused(OutputPathError):
            check_writable(path, folder)


def check_new_file(path: Path, suffix: str, force: bool = False) -> None:
    """Fail with one line unless `path` ends in `suffix`, is new (or `force`) and can be written."""
    if path.suffix != suffix:
        fail(f"{path}: the file name must end in {suffix}")
    if path.exists() and not force:
        fail(f"{path} already exists: --force replaces it")
    ensure_writable(path)


def json_option(help: str = "Write the figures as JSON."):
    """`--json FILE`, checked writable (before any model work) where given."""

    def checked(path: Optional[Path]) -> Optional[Path]:
        ensure_writable(path)
        return path

    return typer.Option(None, "--json", help=help, callback=checked)


def check_coreml(compute_units: str, precision: str) -> None:
    """Fail with one line unless Core ML can run here with these settings."""
    from rvqtts.engine.backends.coreml import COMPUTE_UNITS, PRECISIONS, CoreMLError, coremltools, require_macos

    with refused(CoreMLError):
        require_macos()
        coremltools()
    if compute_units not in COMPUTE_UNITS:
        fail(f"unknown --compute-units {compute_units!r}: choose {', '.join(COMPUTE_UNITS)}")
    if precision not in PRECISIONS:
        fail(f"unknown --coreml-precision {precision!r}: choose {' or '.join(PRECISIONS)}")


def progress_bar(quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    # A bar only helps on a terminal; in a log file it would leave blank lines behind.
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )


def stderr_console():
    """A rich console on stderr, at least 110 columns wide (also when stderr is a file)."""
    from rich.console import Console

    console = Console(stderr=True)
    console.width = max(console.width, 110)
    return console


def show_stats(rows: list[tuple[str, dict]], quiet: bool) -> None:
    """`rvqtts synth`'s table of (name, record) rows on stderr, unless quiet."""
    from rvqtts.support.report import stats_table

    if not quiet:
        stderr_console().print(stats_table(rows))


def write_stats(path: Optional[Path], entries: list[dict], total: dict | None = None, **extra: object) -> None:
    """`rvqtts synth --stats-json`: per-utterance records, their total (`total`, else their sums), `extra`
    sections, and the process's memory (resident now and at its peak; on a Ray run, the driver's)."""
    from rvqtts.support.files import write_json
    from rvqtts.support.memory import memory_record
    from rvqtts.support.report import total_record

    if path is not None:
        total = total or total_record(entries)
        write_json(path, {"utterances": entries, "total": total, **extra, "memory": memory_record()})


def publish(result: dict, json_out: Optional[Path], table: Callable[[dict], object], quiet: bool, **fields) -> None:
    """A command's figures with `fields` added: to `json_out` if given, and as `table(result)` on stderr unless
    quiet."""
    from rvqtts.support.files import write_json

    result.update(fields)
    if json_out is not None:
        write_json(json_out, result)
    if not quiet:
        stderr_console().print(table(result))


def load_synthesizer(model: str, quiet: bool = False, *choices, **named):
    """The engine `choices` and `named` (rvqtts.synthesis.loader.EngineChoices's fields, in order or by name) describe
    for `model`, its notices said unless quiet (which dtypes `auto` chose and why, a device not validated, the tree
    policy); fails with one line on a bad model, device, dtype, tree or offsets, the model checked from its config
    before the weights load."""
    from transformers.utils import logging as hf_logging

    from rvqtts.qwen.checkpoints import ModelLoadError
    from rvqtts.synthesis.loader import EngineChoices
    from rvqtts.synthesis.synthesizer import Synthesizer

    hf_logging.set_verbosity_error()
    with refused(ModelLoadError, ValueError):
        return Synthesizer.load(model, EngineChoices(*choices, **named), on_notice=lambda line: say(line, quiet))


def list_of_ints(value: str, option: str, least: int = 1) -> list[int]:
    try:
        numbers = sorted({int(v) for v in value.split(",")})
    except ValueError:
        fail(f"{option} must be comma-separated whole numbers, got {value!r}")
    if not numbers or numbers[0] < least:
        fail(f"{option} must be at least {least}, got {value!r}")
    return numbers


def batch_rows(value: str) -> int | None:
    """--batch-size's rows (None: auto), or a failure saying what to give."""
    if value == "auto":
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        fail(f"--batch-size must be auto or a whole number of at least 1, got {value!r}")
    return rows
