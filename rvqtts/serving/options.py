"""How one `rvqtts serve` answers and what its clients may hold: the options `rvqtts/cli/serve.py` reads from the
command line (docs/server.md, "Limits" and "Concurrency")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rvqtts.qwen.codec import StreamPacing


@dataclass(frozen=True)
class ServerOptions:
    """How the server answers: the model name it reports, the key it asks for, the voice files it may read,
    the longest input, the waiting requests it holds, the text chunking `synth` uses, how many requests may share
    the calls of both loops (rows) and how many take rows before each frame, how streamed audio is paced; and what a
    client may hold: the browser origins served besides the server's own, the requests and sessions at once, a
    stream's unread audio, and how long a stopping server lets requests finish; where Wyoming is served, if it is."""

    model_name: str
    api_key: str | None = None
    voices_dir: Path | None = None
    max_chars: int = 4096
    queue_size: int = 8
    chunk_chars: float | None = 240
    batch_size: int = 1
    pacing: StreamPacing = StreamPacing()
    allowed_origins: tuple[str, ...] = ()
    max_connections: int = 64
    max_unsent_seconds: float = 300.0  # longer than --max-chars takes to speak: a real-time player is never cut
    # requests that take rows before each frame (0: every free row): a burst's first two are heard after their own
    # prefills and one frame, not after all the others' prefills (docs/server.md "Concurrency")
    joins_per_frame: int = 2
    drain_seconds: int = 30
    wyoming_address: tuple[str, int] | None = None  # (host, port) where Wyoming is served beside HTTP
