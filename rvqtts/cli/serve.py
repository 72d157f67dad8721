"""`rvqtts serve`: the OpenAI audio API on a model loaded once (rvqtts.serving.app; docs/server.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import typer

from rvqtts.cli.common import (
    DECODER_DTYPE_HELP,
    DEFAULT_MODEL,
    DEVICE_HELP,
    DTYPE_HELP,
    FIRST_STREAM_FRAMES_HELP,
    MODEL_HELP,
    OFFSETS_HELP,
    STREAM_FRAMES_HELP,
    TREE_HELP,
    WEIGHTS_HELP,
    app,
    batch_rows,
    check_stream_frames,
    fail,
    load_synthesizer,
    refused,
    say,
)


@app.command()
def serve(
    model: str = typer.Option(DEFAULT_MODEL, help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface; then set --api-key)."),
    port: int = typer.Option(8880, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(
        None,
        envvar="RVQTTS_API_KEY",
        help="Key every request must send (Authorization: Bearer KEY); default: none asked.",
    ),
    voices: Optional[Path] = typer.Option(
        None,
        help="Base models: a folder of voice files (NAME.safetensors, from rvqtts synth --save-voice or uploaded to "
        "POST /v1/audio/voices); a request's voice names one. Nothing outside it is read.",
    ),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    decoder_dtype: str = typer.Option("auto", help=DECODER_DTYPE_HELP),
    weights: str = typer.Option("native", help=WEIGHTS_HELP),
    spec: bool = typer.Option(True, "--spec/--no-spec", help="Speculative inner loop (default) or the plain one."),
    tree: str = typer.Option("auto", help=TREE_HELP),
    offsets: Optional[Path] = typer.Option(None, help=OFFSETS_HELP),
    queue_size: int = typer.Option(
        8, help="Requests held waiting for a row while the rows are full; more get 503 (Retry-After)."
    ),
    max_chars: int = typer.Option(4096, help="Longest input in characters (OpenAI's limit); longer gets 413."),
    chunk_chars: int = typer.Option(240, help="Long input is spoken in chunks of about this many characters."),
    batch_size: str = typer.Option(
        "auto",
        help="Requests spoken at once, a row each in every call of both loops (streamed or whole, any sampling "
        "settings), each taking a row as soon as one is free; auto: the size measured best on this machine and model "
        "where the kernels keep rows invariant (each response then the one it gets alone), else 1.",
    ),
    joins_per_frame: int = typer.Option(
        2,
        help="Waiting requests that take free rows before each frame (0: all of them): a burst's first ones are heard "
        "after their own prefills and a frame, not after every other's prefill; 0 gives more requests a minute and "
        "later first audio.",
    ),
    first_stream_frames: int = typer.Option(1, help=FIRST_STREAM_FRAMES_HELP),
    stream_frames: int = typer.Option(4, help=STREAM_FRAMES_HELP),
    allow_origin: list[str] = typer.Option(
        [],
        help="A browser origin (https://app.example.com, repeatable; '*': any) whose pages may use the API (CORS) and "
        "the WebSocket; the server's own origin and programs (no Origin header) always may.",
    ),
    max_connections: int = typer.Option(
        64, help="Requests and WebSocket sessions at once (/health, /ready and /metrics aside); more get 503."
    ),
    max_unsent_seconds: float = typer.Option(
        300.0,
        help="Seconds of streamed audio a client may leave unread; one further behind is disconnected and its row "
        "freed (the engine never waits for a client).",
    ),
    drain_seconds: int = typer.Option(
        30, help="On SIGTERM or Ctrl-C: seconds the requests in flight get to finish before they are cut."
    ),
    wyoming_port: Optional[int] = typer.Option(
        None,
        help="Also speak Wyoming (Home Assistant's protocol for local voices) on this port, on the same engine; it is "
        "bound to --host and asks no key (pip install -e '.[serve]' brings the wyoming package).",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log warnings and errors only."),
) -> None:
    """Serve the OpenAI audio API (POST /v1/audio/speech) on one model loaded once.

    Install the server's packages first: pip install -e '.[serve]' in rvqtts's checkout. Requests are taken in
    the order they came, each into a row of the running calls as soon as one is free (--batch-size rows).
    A whole (not streamed) response is, byte for byte, rvqtts synth's file for the same text, voice, seed and
    options; a streamed one has the same length and its samples are that file's up to float rounding (at most
    one 16-bit step apart in the tests; text chunks of up to 300 frames, as synth --stream).
    """
    _check_sizes(port, queue_size, max_chars, chunk_chars, max_connections, max_unsent_seconds, drain_seconds)
    if joins_per_frame < 0:
        fail(f"--joins-per-frame must be 0 (every free row) or more, got {joins_per_frame}")
    check_stream_frames(first_stream_frames, stream_frames)
    _check_wyoming(wyoming_port, port, host, api_key, quiet)
    origins = tuple(map(checked_origin, allow_origin))
    try:
        import prometheus_client  # noqa: F401
        import pydantic  # noqa: F401
        import python_multipart  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        fail(
            "rvqtts serve needs its web packages: pip install -e '.[serve]' "
            "(from rvqtts's checkout folder; rvqtts is not on PyPI)"
        )
    voices = _checked_voices_folder(model, voices)
    from rvqtts.qwen.codec import StreamPacing
    from rvqtts.serving.app import serve as run_server
    from rvqtts.serving.options import ServerOptions
    from rvqtts.synthesis.batch_size import choose_batch_size

    rows = batch_rows(batch_size)
    synthesizer = load_synthesizer(
        model, quiet, device, dtype, decoder_dtype, weights, spec, tree, offsets, batch_size=rows
    )
    if rows is None:
        rows, source = choose_batch_size(synthesizer, queue_size + 1, progress=lambda m: say(m, quiet))
        say(f"--batch-size auto: {rows} ({source})", quiet)
    options = ServerOptions(
        model_name=Path(model).name or model,
        api_key=api_key,
        voices_dir=voices,
        max_chars=max_chars,
        queue_size=queue_size,
        chunk_chars=chunk_chars,
        batch_size=rows,
        pacing=StreamPacing(first_stream_frames, stream_frames),
        allowed_origins=origins,
        max_connections=max_connections,
        max_unsent_seconds=max_unsent_seconds,
        drain_seconds=drain_seconds,
        joins_per_frame=joins_per_frame,
        wyoming_address=None if wyoming_port is None else (host, wyoming_port),
    )
    endpoints = "POST /v1/audio/speech; GET /v1/audio/voices, /health, /metrics; the page at /, the API at /docs"
    say(f"serving {model} on http://{host}:{port}/v1 ({endpoints})", quiet)
    run_server(synthesizer, options, host, port, quiet)


def _check_sizes(
    port: int, queue_size: int, max_chars: int, chunk_chars: int, connections: int, unsent: float, drain: int
) -> None:
    """The server's numeric options, each within its range (one line naming it otherwise)."""
    if not 1 <= port <= 65535:
        fail(f"--port must be between 1 and 65535, got {port}")
    if queue_size < 1 or max_chars < 1:
        fail(f"--queue-size and --max-chars must be at least 1, got {queue_size} and {max_chars}")
    if chunk_chars < 20:
        fail(f"--chunk-chars must be at least 20, got {chunk_chars}")
    if connections < 1 or unsent <= 0 or drain < 0:
        fail(
            "--max-connections must be at least 1, --max-unsent-seconds over 0 and --drain-seconds at least 0, got "
            f"{connections}, {unsent} and {drain}"
        )


def _check_wyoming(wyoming_port: Optional[int], port: int, host: str, api_key: Optional[str], quiet: bool) -> None:
    """--wyoming-port: a free port of its own, the wyoming package installed; a warning where it opens a keyless
    port beside a keyed API to the network."""
    if wyoming_port is None:
        return
    if not 1 <= wyoming_port <= 65535 or wyoming_port == port:
        fail(f"--wyoming-port must be between 1 and 65535 and not --port ({port}), got {wyoming_port}")
    try:
        import wyoming  # noqa: F401
    except ImportError:
        fail("--wyoming-port needs the wyoming package: pip install -e '.[serve]' (from rvqtts's checkout folder)")
    if api_key is not None and host not in ("127.0.0.1", "localhost", "::1"):
        say(f"warning: Wyoming asks no key: port {wyoming_port} on {host} speaks for anyone who reaches it", False)


def _checked_voices_folder(model: str, voices: Optional[Path]) -> Optional[Path]:
    """--voices: a folder, for a Base model only (the model's kind read from its config)."""
    from rvqtts.qwen.checkpoints import ModelLoadError, model_voices

    with refused(ModelLoadError):
        kind = model_voices(model).kind
    if voices is None:
        return None
    voices = voices.expanduser()
    if kind != "base":
        fail(f"--voices is for Base models (voice cloning); this model is {kind}: its voices are built in")
    if not voices.is_dir():
        fail(f"--voices {voices}: no such folder")
    return voices


def checked_origin(origin: str) -> str:
    """An --allow-origin as browsers send it (scheme://host[:port], lower case, no path), or '*'."""
    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        fail(f"--allow-origin {origin}: give a browser origin, scheme://host[:port] (https://app.example.com), or '*'")
    return f"{parts.scheme}://{parts.netloc}".lower()
