"""`rvqtts serve`: the OpenAI audio API (and text in pieces over a WebSocket) over one loaded Synthesizer, whose one
engine thread takes requests from a bounded queue into the rows of one frame loop. Requests, responses, errors and
the limits on what a client may hold: docs/server.md."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from urllib.parse import urlsplit

import numpy as np
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rvqtts.engine.loop.frame_loop import Stopped
from rvqtts.engine.model.sampling import NonFiniteError
from rvqtts.engine.speculative.online import keep_learned
from rvqtts.qwen.cloning import VoiceError, VoiceSource
from rvqtts.qwen.codec import StreamPacing
from rvqtts.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rvqtts.serving.metrics import ServerMetrics
from rvqtts.serving.voices import MAX_UPLOAD_BYTES, VoiceConflict, VoiceStore, voice_files
from rvqtts.support.audio import AUDIO_FORMATS, audio_bytes, pcm16, wav_header
from rvqtts.support.memory import memory_record
from rvqtts.synthesis.batch_size import fitting_slots
from rvqtts.synthesis.pipeline import row_slots, speak
from rvqtts.synthesis.settings import GenerationSettings, Line, Synthesis
from rvqtts.synthesis.text import chunk_text, complete_sentences

log = logging.getLogger("rvqtts.serving.server")

RESPONSE_FORMATS = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
}
STREAMED_FORMATS = ("wav", "pcm")  # made as the samples come; the others are whole files
# GenerationSettings' fields, taken from the body as they are named there, with the numbers each takes
SAMPLING_FIELDS = {f.name: int if f.type.startswith("int") else (int, float) for f in fields(GenerationSettings)}
MAX_BODY_BYTES = 1 << 20  # a request body, and a WebSocket message (a bigger one closes its session with 1009)
POLL_SECONDS = 0.5  # how often a wait on the engine checks that the engine thread lives and the client is there
STALLED_READER_SECONDS = 30.0  # a client that takes none of its audio this long is gone (a player reads every second)
PROBES = ("/health", "/ready", "/metrics")  # always answered, whatever the load: load balancers and scrapers ask
SESSION_SENTENCES_IN_ENGINE = 2  # a WebSocket session's sentences in the engine at once (one speaking, the next ready)
BUSY_RETRY_SECONDS = 0.05  # how often a session's next sentence retries a full queue
MESSAGE_CHARS_PER_MAX_CHARS = 4  # a WebSocket text message: at most 4 x --max-chars characters
UNSPOKEN_CHARS_PER_MAX_CHARS = 16  # a session's text not yet given to the engine: at most 16 x --max-chars


class SpeechError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def engine_stopped() -> SpeechError:
    return SpeechError(
        503,
        "the server's engine has stopped (its log says why): retry once the server is restarted (GET /ready)",
        code="engine_stopped",
    )


@dataclass(frozen=True)
class ServerOptions:
    """How the server answers: the model name it reports, the key it asks for, the voice files it may read,
    the longest input, the waiting requests it holds, the text chunking `synth` uses, how many requests may share
    the calls of both loops (rows) and how many take rows before each frame, how streamed audio is paced; and what a
    client may hold: the browser origins served besides the server's own, the requests and sessions at once, a
    stream's unread audio, and how long a stopping server lets requests finish."""

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


@dataclass(frozen=True)
class SpeechRequest:
    """One request, checked: what to say, in which voice and how to sample it (its line: a one-line run's, utterance
    0, with its own seed and settings, so its audio is `rvqtts synth`'s; streamed, its pacing), and how to send it."""

    line: Line
    response_format: str
    events: bool = False  # streamed as server-sent events (`stream_format: "sse"`), else as the audio itself

    @property
    def stream(self) -> bool:
        return self.line.stream is not None


class ReaderGone(Exception):
    """A client that fell too far behind its stream (--max-unsent-seconds) or took none of it for
    STALLED_READER_SECONDS: its connection is closed."""


FELL_BEHIND = "it fell behind its audio by more than --max-unsent-seconds"


@dataclass
class Job:
    """A request in the engine: its output reaches the event loop through `items` (bytes, then None at the end,
    or the exception that ended it); `cancelled` stops it at the next frame. A stream's unread audio is counted on
    the event loop: past `unsent_limit` bytes the job is cancelled (its row freed; the engine never waits for a
    reader) and `behind` is set, which cuts its reader's connection."""

    request: SpeechRequest
    loop: asyncio.AbstractEventLoop
    unsent_limit: int
    engine_alive: Callable[[], bool]
    behind: asyncio.Event = field(default_factory=asyncio.Event)
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when a row took it
    first_audio: float | None = None  # when its first audio was sent (streamed)
    shared: bool = False  # spoken in calls with another request
    unsent: int = 0  # bytes of streamed audio sent by the engine and not yet taken by the client (event loop only)

    def send(self, item: bytes | Exception | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            self.cancelled.set()

    def _put(self, item: bytes | Exception | None) -> None:
        if isinstance(item, bytes) and self.request.stream:
            if self.behind.is_set():
                return  # cut: nobody will read it
            self.unsent += len(item)
            if self.unsent > self.unsent_limit:
                self.cancelled.set()
                self.behind.set()
                item = ReaderGone(FELL_BEHIND)
        self.items.put_nowait(item)

    def took(self, item: bytes) -> None:
        if self.request.stream:
            self.unsent -= len(item)


class SpeechEngine:
    """The model's one thread: one frame loop over `batch_size` rows (rvqtts.synthesis.pipeline.speak) that takes
    requests from a bounded queue in the order they came, each as soon as a row is free (at the next frame), streamed
    and whole alike, each with its own seed and sampling settings: they share the calls of both loops, and each one's
    audio is the one it gets alone where the kernels keep rows invariant (which `--batch-size auto` requires). A
    request leaves its row when it ends, or at the next frame when its client has gone."""

    def __init__(self, synth, options: ServerOptions):
        self.synth = synth
        self.options = options
        self.counts = {"served": 0, "failed": 0, "cancelled": 0, "refused_busy": 0, "batched": 0}
        # streamed requests served and their first audio's parts, summed (a load test takes means between two reads)
        self.first_audio = {"streamed": 0, "queue": 0.0, "prefill": 0.0, "frames": 0.0, "decoder": 0.0}
        self._waiting: deque[Job] = deque()
        self._tasks: deque[tuple[Callable[[], object], Future]] = deque()  # run on the engine thread between frames
        self._speaking: dict[int, Job] = {}  # by index among the lines the loop took (touched by the engine only)
        self._taken = 0  # lines this run of the loop took: `speak`'s index of the next
        self._changed = threading.Condition()
        self._closing = False
        self.row_slots = fitting_slots(synth, options.batch_size)  # what one request's row may hold
        self._seconds, self._timed = 0.0, 0  # the mean time a request held a row (Retry-After), over how many
        self.metrics = ServerMetrics(self._metrics_state)
        # voices uploaded over the API: a Base model's, kept in --voices
        folder = options.voices_dir
        self.voice_store = VoiceStore(folder, synth.tts, synth.cloned) if folder and synth.kind == "base" else None
        synth.codec.warm_up(options.pacing)  # the decoder's cold start out of the first request's first audio
        self._thread = threading.Thread(target=self._serve, name="rvqtts-engine", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._speaking)

    @property
    def alive(self) -> bool:
        """The engine thread runs (it may be finishing its last requests)."""
        return self._thread.is_alive()

    def voices(self) -> list[str]:
        """The `voice` values this model takes: its speakers, or (Base models) the voice files' names."""
        if self.synth.kind == "base":
            return sorted(voice_files(self.options.voices_dir))
        return list(self.synth.speakers)

    @property
    def ready(self) -> bool:
        """The engine takes requests: its thread runs and the server is not stopping (GET /ready)."""
        return self._thread.is_alive() and not self._closing

    def submit(self, request: SpeechRequest, behind: asyncio.Event | None = None) -> Job:
        """The request queued for a row; SpeechError 503 where the queue is full (with when to retry) or the engine
        has stopped. `behind`: the event that cuts the reader of its stream (a session's, shared by its sentences)."""
        job = self._queued(request, behind)
        if job is None:
            with self._changed:
                self.counts["refused_busy"] += 1
                rounds = (len(self._waiting) + 1) / self.options.batch_size
            wait = max(1, math.ceil(self._seconds * rounds))
            raise SpeechError(
                503,
                f"the server is busy ({self.options.queue_size} requests waiting): retry in {wait} s",
                code="server_busy",
                headers={"Retry-After": str(wait)},
            )
        return job

    async def submit_when_free(self, request: SpeechRequest, behind: asyncio.Event) -> Job:
        """The request queued once the queue has room: a WebSocket session's sentence waits its turn (backpressure)
        instead of being refused, so a session's text is never dropped."""
        while (job := self._queued(request, behind)) is None:
            await asyncio.sleep(BUSY_RETRY_SECONDS)
        return job

    def _queued(self, request: SpeechRequest, behind: asyncio.Event | None) -> Job | None:
        """The request's job, queued; None where the queue is full."""
        bytes_per_second = 2 * self.synth.sample_rate
        job = Job(
            request,
            asyncio.get_running_loop(),
            int(self.options.max_unsent_seconds * bytes_per_second),
            self._thread.is_alive,
            behind or asyncio.Event(),
        )
        with self._changed:
            if not self.ready:
                raise engine_stopped()
            if len(self._waiting) >= self.options.queue_size:
                return None
            self._waiting.append(job)
            self._changed.notify()
        return job

    def health(self) -> dict:
        return {
            "status": "ok",
            "model": self.options.model_name,
            "busy": self.busy,
            "speaking": len(self._speaking),
            "queued": len(self._waiting),
            "batch_size": self.options.batch_size,
            **self.counts,
            **memory_record(),
            # what the engine keeps between requests and grows by use, inside rss_mib (the rest is the loaded model)
            "caches_mib": self.synth.cache_mib(),
            "first_audio_seconds": {name: round(value, 3) for name, value in self.first_audio.items()},
        }

    def between_frames(self, task: Callable[[], object]) -> Future:
        """Run `task` on the engine thread between two frames (at once while it idles): the model's own thread, so
        that nothing else runs on its device meanwhile (a GPU's graph capture included). Its result or error comes
        through the future; SpeechError 503 where the engine has stopped."""
        future: Future = Future()
        with self._changed:
            if not self.ready:
                raise engine_stopped()
            self._tasks.append((task, future))
            self._changed.notify()
        return future

    def _run_tasks(self) -> None:
        while True:
            with self._changed:
                if not self._tasks:
                    return
                task, future = self._tasks.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(task())
                except Exception as error:  # the task's caller hears of it
                    future.set_exception(error)

    def _frame_made(self) -> None:
        """Each row's frame, on the engine thread: counted, and the tasks waiting for a frame's end run."""
        self.metrics.frame_made()
        self._run_tasks()

    def _metrics_state(self) -> dict:
        """What /metrics reads of the engine at a scrape."""
        with self._changed:
            counts, queued = dict(self.counts), len(self._waiting)
        return {"counts": counts, "speaking": len(self._speaking), "queued": queued, "rows": self.options.batch_size}

    def close(self) -> None:
        """Stop the engine thread once the jobs queued before are done."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()

    def _serve(self) -> None:
        """Speak requests until closed; a failure that stops every row (NaN or inf, a failing call) fails the
        requests in them, and the loop starts again for the next, numbering its lines from 0 as `speak` does."""
        while True:
            self._taken = 0
            try:
                lines, rows = self._lines(), self.options.batch_size
                for index, item in speak(
                    self.synth,
                    lines,
                    self.options.chunk_chars,
                    rows,
                    on_frame=lambda prefix, codes: self._frame_made(),
                    stopped=self._stopped,
                    joins_per_frame=self.options.joins_per_frame or None,
                ):
                    self._answer(index, item)
                return
            except Exception as error:  # each client in a row hears of it
                # a string, not the error: a handler that keeps records must not keep its frames (the loop's tensors)
                log.error(
                    f"the frame loop failed ({type(error).__name__}: {error}): its {len(self._speaking)} requests fail"
                )
                for job in self._speaking.values():
                    self.counts["failed"] += 1
                    job.send(error)
                self._speaking.clear()

    def _lines(self) -> Iterator[Line | None]:
        """The frame loop's live source: the next waiting request's line, None while none waits and rows are at work,
        waiting while none is at work; it ends when the engine closes with nothing left to speak."""
        while True:
            self._run_tasks()
            with self._changed:
                while not (self._waiting or self._speaking or self._tasks):
                    if self._closing:
                        return
                    self._changed.wait()
                if self._tasks:
                    continue
                job = self._waiting.popleft() if self._waiting else None
            if job is None:
                yield None
            elif job.cancelled.is_set():  # its client left while it waited
                self.counts["cancelled"] += 1
            else:
                job.started = time.perf_counter()
                self._speaking[self._taken] = job
                self._taken += 1
                if len(self._speaking) > 1:
                    for speaking in self._speaking.values():
                        speaking.shared = True
                if job.request.stream and job.request.response_format == "wav":
                    job.send(wav_header(self.synth.sample_rate))
                yield job.request.line

    def _stopped(self, index: int) -> bool:
        return index not in self._speaking or self._speaking[index].cancelled.is_set()

    def _answer(self, index: int, item: np.ndarray | Synthesis | Exception) -> None:
        """Send a request its audio as it comes (streamed) or whole, or its failure; count it when it ends."""
        job = self._speaking[index]
        if isinstance(item, np.ndarray):
            if item.size and job.request.stream:
                job.first_audio = job.first_audio or time.perf_counter()
                job.send(pcm16(item))
            return
        del self._speaking[index]
        held = time.perf_counter() - job.started
        self._timed += 1
        self._seconds += (held - self._seconds) / self._timed
        if isinstance(item, Stopped):
            self.counts["cancelled"] += 1
        elif isinstance(item, Exception):
            self.counts["failed"] += 1
            job.send(item)
        else:
            if not job.request.stream:
                job.send(encode(item.audio, self.synth.sample_rate, job.request.response_format))
            split = {"queue": round(job.started - job.submitted, 3), **item.seconds.first_audio_split}
            log.info("request %d: first audio after %s s", index, " + ".join(f"{v} {k}" for k, v in split.items()))
            if job.request.stream:
                self.first_audio["streamed"] += 1
                for part, seconds in split.items():
                    self.first_audio[part] += seconds
            self.counts["served"] += 1  # counted before its client hears the end: a scrape after it sees it
            self.counts["batched"] += job.shared
            self.metrics.request_time.observe(time.perf_counter() - job.submitted)
            if job.first_audio is not None:
                self.metrics.first_audio.observe(job.first_audio - job.submitted)
            job.send(None)


def encode(audio: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """A whole response: the bytes `rvqtts synth` writes to a file of that suffix, or its raw PCM."""
    if response_format == "pcm":
        return pcm16(audio)
    return audio_bytes(audio, sample_rate, AUDIO_FORMATS[f".{response_format}"])


def parse_speech_request(body: object, engine: SpeechEngine) -> SpeechRequest:
    """The request in `body` (JSON), checked as `rvqtts synth` checks its options; SpeechError saying what
    to send otherwise."""
    synth, options = engine.synth, engine.options
    if not isinstance(body, dict):
        raise SpeechError(400, "the body must be a JSON object with at least `input` and `voice`")
    text = _string(body, "input")
    if text is None or not text.strip():
        raise SpeechError(400, "`input` is empty: give the text to speak", "input")
    _within_max_chars(options, "input", text)
    _string(body, "model")  # accepted whatever it names: the server has one model (GET /v1/models)
    response_format, stream, sse = _response_fields(body)
    seed = _seed(body)
    instruct = _within_max_chars(options, "instructions", _string(body, "instruct") or _string(body, "instructions"))
    language = _string(body, "language", "auto")
    speaker, voice_file = _voice(body.get("voice"), synth, engine)
    values = _sampling_fields(body, synth.default_max_frames)
    try:
        settings = GenerationSettings(**values)
        line = Line(
            text=text,
            speaker=speaker,
            language=language,
            instruct=instruct,
            clone=voice_file and VoiceSource(voice=voice_file),
            utterance=0,
            seed=seed,
            settings=settings,
            stream=options.pacing if stream else None,
        )
        line = synth.voiced(line)  # a voice file read once
    except (ValueError, TypeError) as error:  # VoiceError included
        raise SpeechError(400, str(error)) from None
    slots = row_slots(synth, line, options.chunk_chars)
    if slots > engine.row_slots:
        raise SpeechError(
            400,
            f"this input with max_frames {settings.max_frames} would hold {slots} cache positions in its row, more "
            f"than the {engine.row_slots} each of this server's {options.batch_size} rows may hold in its memory: "
            "ask for fewer max_frames or send the input in parts",
            "max_frames",
        )
    return SpeechRequest(line, response_format, sse)


def _string(body: dict, name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise SpeechError(400, f"`{name}` must be a string", name)
    return value


def _within_max_chars(options: ServerOptions, name: str, value: str | None) -> str | None:
    if value is not None and len(value) > options.max_chars:
        raise SpeechError(
            413,
            f"`{name}` has {len(value)} characters, more than this server's {options.max_chars} (--max-chars): "
            "send it in parts",
            name,
            "input_too_long",
        )
    return value


def _response_fields(body: dict) -> tuple[str, bool, bool]:
    """(response_format, streamed, as server-sent events) of a request, checked."""
    response_format = _string(body, "response_format", "wav")
    if response_format not in RESPONSE_FORMATS:
        raise SpeechError(
            400,
            f"response_format {response_format!r} is not one rvqtts makes: choose {', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    stream_format = _string(body, "stream_format")
    if stream_format not in (None, "audio", "sse"):
        raise SpeechError(400, f"stream_format {stream_format!r} is not served: choose audio or sse", "stream_format")
    stream = body.get("stream", stream_format is not None)
    if not isinstance(stream, bool):
        raise SpeechError(400, "`stream` must be true or false", "stream")
    if stream_format and not stream:
        raise SpeechError(400, f"stream_format {stream_format} streams: leave `stream` out or true", "stream")
    if stream and response_format not in STREAMED_FORMATS:
        raise SpeechError(
            400, f"{response_format} is not streamed here: ask for wav or pcm to stream", "response_format"
        )
    return response_format, stream, stream_format == "sse"


def _seed(body: dict) -> int:
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpeechError(400, "`seed` must be a whole number", "seed")
    if not 0 <= seed < 2**63:
        raise SpeechError(400, f"`seed` must be between 0 and 2**63 - 1, got {seed}", "seed")
    return seed


def _sampling_fields(body: dict, max_frames: int) -> dict:
    """The request's sampling settings (GenerationSettings' fields), each of its kind; `max_frames` at most the
    model's limit."""
    values = {name: body.get(name) for name in SAMPLING_FIELDS}
    for name, value in values.items():
        kinds = SAMPLING_FIELDS[name]
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise SpeechError(400, f"`{name}` must be a {'whole ' if kinds is int else ''}number", name)
    if values["max_frames"] is not None and values["max_frames"] > max_frames:
        raise SpeechError(
            400, f"max_frames {values['max_frames']} is over this model's limit of {max_frames} frames", "max_frames"
        )
    return values


def _voice(value: object, synth, engine: SpeechEngine) -> tuple[str | None, Path | None]:
    """(speaker, voice file) for a request's `voice`: a built-in speaker (any case) on a CustomVoice model, a
    voice file's name from --voices on a Base model; a VoiceDesign model is voiced by `instructions` alone."""
    if isinstance(value, dict):  # OpenAI's custom voices: {"id": "..."}
        value = value.get("id")
    if value is not None and not isinstance(value, str):
        raise SpeechError(400, "`voice` must be a string", "voice")
    if synth.kind == "voice_design":
        return None, None
    if synth.kind == "base":
        files = voice_files(engine.options.voices_dir)
        if value in files:
            return None, files[value]
        where = (
            f"the voice files in {engine.options.voices_dir}: {', '.join(files) or 'none yet'}"
            if engine.options.voices_dir
            else "none: start the server with --voices DIR (voice files from rvqtts synth --save-voice)"
        )
        raise SpeechError(400, f"voice {value!r} is not served; this Base model's voices are {where}", "voice")
    available = engine.voices()
    if value is None or value.lower() not in available:
        raise SpeechError(
            400, f"voice {value!r} is not one of this model's speakers: choose {', '.join(available)}", "voice"
        )
    return value.lower(), None


def is_json(content_type: str | None) -> bool:
    """A JSON body's media type (any parameters, e.g. charset). Only JSON is taken: a browser page of another site
    may send text/plain or a form to any address without asking (no CORS preflight), but not JSON."""
    return (content_type or "").partition(";")[0].strip().lower() == "application/json"


def json_value(data: bytes | str) -> object:
    """`data` parsed as JSON; ValueError for anything that is not, nesting too deep for Python included."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def check_origin(connection: Request | WebSocket, options: ServerOptions) -> None:
    """SpeechError 403 where the connection's Origin may not go on (`origin_allowed`)."""
    origin = connection.headers.get("origin")
    if not origin_allowed(origin, connection.headers.get("host"), options.allowed_origins):
        raise SpeechError(403, f"origin {origin} is not served: start the server with --allow-origin {origin}")


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a WebSocket handshake may go on: no Origin (a program, not a browser), the server's own (the Host
    the client connected to), or one listed with --allow-origin ("*": any). Browsers let any page open a WebSocket to
    any address, the user's own machine included, and CORS does not stop them: the Origin check does."""
    if origin is None or "*" in allowed or origin.lower() in allowed:
        return True
    try:
        return host is not None and urlsplit(origin).netloc.lower() == host.lower()
    except ValueError:  # not a URL
        return False


async def json_body(request: Request) -> object:
    """The request's JSON body, at most 1 MiB; SpeechError 415, 413 or 400 saying what to send instead."""
    if not is_json(request.headers.get("content-type")):
        raise SpeechError(
            415,
            "the body must be JSON: send it with the header `Content-Type: application/json`",
            code="unsupported_media_type",
        )
    body = b"".join([chunk async for chunk in limited_body(request, MAX_BODY_BYTES)])
    try:
        return json_value(body)
    except ValueError:
        raise SpeechError(400, "the body is not JSON: send a JSON object with `input` and `voice`") from None


async def limited_body(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks, counted as they come so that the cap holds for a chunked body (no Content-Length) too;
    SpeechError 413 past `limit` bytes."""
    too_large = SpeechError(413, f"the request body is over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise too_large
        yield chunk


async def voice_form(request: Request, options: ServerOptions) -> tuple[str, bytes, str, str | None]:
    """An uploaded voice's form (multipart/form-data, as vllm-omni takes it): `name`, `audio_sample` (the
    recording's file) and optionally `ref_text` (its transcript); SpeechError saying what to send otherwise. A form
    is what a page of another site may post without asking, so one whose Origin is not served is refused."""
    check_origin(request, options)
    media_type = (request.headers.get("content-type") or "").partition(";")[0].strip().lower()
    if media_type != "multipart/form-data":
        raise SpeechError(
            415,
            "send the voice as multipart/form-data: `name`, `audio_sample` (the recording's file) and `ref_text` "
            "(its transcript; without it the voice is cloned from the audio alone)",
            code="unsupported_media_type",
        )
    stream = limited_body(request, MAX_UPLOAD_BYTES + MAX_BODY_BYTES)  # the file and the form's other fields
    try:
        form = await MultiPartParser(request.headers, stream, max_files=1, max_fields=8).parse()
    except MultiPartException as error:
        raise SpeechError(400, f"the form cannot be read: {error.message}") from None
    try:
        sample, name, ref_text = form.get("audio_sample"), form.get("name"), form.get("ref_text")
        if not isinstance(sample, UploadFile):
            raise SpeechError(
                400, "`audio_sample` must be the recording's file (a .wav, .flac or .ogg)", "audio_sample"
            )
        if not isinstance(name, str) or (ref_text is not None and not isinstance(ref_text, str)):
            raise SpeechError(400, "`name` (and `ref_text` where given) must be text fields", "name")
        recording = await sample.read()
    finally:
        await form.close()
    _within_max_chars(options, "ref_text", ref_text)  # spoken before every request's text, in ICL mode
    if len(recording) > MAX_UPLOAD_BYTES:
        raise SpeechError(413, f"the recording is over {MAX_UPLOAD_BYTES} bytes", "audio_sample", "request_too_large")
    return name, recording, sample.filename or "the recording", ref_text


class ConnectionLimit:
    """ASGI middleware: at most `limit` requests and WebSocket sessions at once (--max-connections); each holds
    memory and maybe a row, so past it a new one gets 503 at once instead of piling up. /health and /ready are
    always answered."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.open = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        if self.open >= self.limit:
            refused = SpeechError(
                503,
                f"the server has {self.limit} requests and sessions open, its limit (--max-connections): retry soon",
                code="too_many_connections",
                headers={"Retry-After": "1"},
            ).response()
            if scope["type"] == "websocket":
                return await WebSocket(scope, receive, send).send_denial_response(refused)
            return await refused(scope, receive, send)
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


class CutStream(StreamingResponse):
    """A streamed response that ends as an error where its audio is cut short (the synthesis failed, the reader fell
    more than --max-unsent-seconds behind or took nothing for STALLED_READER_SECONDS): it returns without HTTP's
    final chunk, so the connection is closed and the client sees a broken body, never a clean but short one. However
    it ends, its job is cancelled, which frees its row at the next frame."""

    def __init__(self, job: Job, pieces: AsyncIterator[bytes], media_type: str):
        super().__init__(pieces, media_type=media_type)
        self.job = job

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(lambda message: _sent(self.job.behind, send(message)))
        except ReaderGone as error:
            log.warning("a streamed request's connection is closed: %s", str(error))
        except SpeechError as error:
            log.error("a streamed request ended early: %s", error.message)
        finally:
            self.job.cancelled.set()


async def _sent(behind: asyncio.Event, sending: Coroutine) -> None:
    """`sending` (a message to a client) awaited, unless the client falls behind or takes nothing for
    STALLED_READER_SECONDS first: ReaderGone. The engine never waits for a client; this is where a client that does
    not read is let go."""
    if behind.is_set():
        sending.close()
        raise ReaderGone(FELL_BEHIND)
    sent, cut = asyncio.ensure_future(sending), asyncio.ensure_future(behind.wait())
    try:
        await asyncio.wait({sent, cut}, timeout=STALLED_READER_SECONDS, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut.cancel()
        if not sent.done():
            sent.cancel()
    if not sent.done() or sent.cancelled():
        raise ReaderGone(
            FELL_BEHIND if behind.is_set() else f"it took none of its audio for {STALLED_READER_SECONDS:g} s"
        )
    sent.result()


def authorize(request: Request | WebSocket, api_key: str | None) -> None:
    """Refuse (401) a request without the server's API key, where it has one."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
        raise SpeechError(
            401,
            "a valid API key is needed: send the header `Authorization: Bearer KEY` with the key the server "
            "was started with (--api-key)",
            code="invalid_api_key",
        )


async def _refused(request: Request, error: SpeechError) -> Response:
    return error.response()


async def _http_error(request: Request, error: HTTPException) -> Response:
    return JSONResponse(
        SpeechError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").body(),
        status_code=error.status_code,
    )


def _middleware(options: ServerOptions) -> list[Middleware]:
    """The connection limit, and CORS for the allowed origins' browser apps (outermost: its headers on every
    answer, refusals included)."""
    middleware = [Middleware(ConnectionLimit, limit=options.max_connections)]
    if options.allowed_origins:
        cors = Middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
        )
        middleware.insert(0, cors)
    return middleware


def create_app(engine: SpeechEngine) -> Starlette:
    """The ASGI application (Starlette) over `engine`."""
    options = engine.options

    def authorize_request(request: Request | WebSocket) -> None:
        authorize(request, options.api_key)

    async def speech(request: Request) -> Response:
        authorize_request(request)
        speech_request = parse_speech_request(await json_body(request), engine)
        job = engine.submit(speech_request)
        media_type = RESPONSE_FORMATS[speech_request.response_format]
        if speech_request.events:
            return CutStream(job, _events(job), "text/event-stream")
        if speech_request.stream:
            return CutStream(job, _streamed(job), media_type)
        parts = await _collected(job, request)
        return Response(b"".join(parts), media_type=media_type)

    async def models(request: Request) -> Response:
        authorize_request(request)
        entry = {"id": options.model_name, "object": "model", "created": 0, "owned_by": "rvqtts"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def voices(request: Request) -> Response:
        authorize_request(request)
        return JSONResponse({"model": options.model_name, "kind": engine.synth.kind, "voices": engine.voices()})

    def voice_store() -> VoiceStore:
        if engine.voice_store is None:
            why = (
                f"this is a {engine.synth.kind} model: only a Base model clones voices"
                if engine.synth.kind != "base"
                else "the server keeps none: start it with --voices DIR"
            )
            raise SpeechError(400, f"voices cannot be uploaded or deleted here: {why}", code="voices_not_kept")
        return engine.voice_store

    async def upload_voice(request: Request) -> Response:
        authorize_request(request)
        store = voice_store()
        name, recording, filename, ref_text = await voice_form(request, options)
        encoding = partial(store.add, name, recording, filename, ref_text)
        try:  # encoded by the engine between frames: the event loop goes on answering meanwhile
            voice, seconds = await engine_result(engine.between_frames(encoding), engine)
        except VoiceConflict as error:
            raise SpeechError(409, str(error), "name", "voice_exists") from None
        except VoiceError as error:
            raise SpeechError(400, str(error), "audio_sample") from None
        mode = "icl" if voice.icl else "x-vector-only"
        return JSONResponse({"object": "voice", "name": name, "mode": mode, "seconds": round(seconds, 3)})

    async def delete_voice(request: Request) -> Response:
        authorize_request(request)
        name = request.path_params["name"]
        try:
            removed = voice_store().remove(name)
        except VoiceError as error:
            raise SpeechError(400, str(error), "name") from None
        if not removed:
            raise SpeechError(404, f"no voice named {name!r}: GET /v1/audio/voices lists them", "name", "no_voice")
        return JSONResponse({"object": "voice", "name": name, "deleted": True})

    async def health(request: Request) -> Response:
        return JSONResponse(engine.health())

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    async def ready(request: Request) -> Response:
        if not engine.ready:
            raise engine_stopped()
        return JSONResponse({"status": "ready"})

    async def text_session(websocket: WebSocket) -> None:
        try:
            authorize_request(websocket)
            check_origin(websocket, options)
        except SpeechError as error:  # refused before the handshake: the client sees HTTP 403
            await websocket.close(code=1008, reason=error.message[:120])
            return
        await websocket.accept()
        await TextSession(websocket, engine).run()

    routes = [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", text_session),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/audio/voices", voices, methods=["GET"]),
        Route("/v1/audio/voices", upload_voice, methods=["POST"]),
        Route("/v1/audio/voices/{name}", delete_voice, methods=["DELETE"]),
        Route("/v1/voices", voices, methods=["GET"]),  # the name before /v1/audio/voices, kept
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {SpeechError: _refused, HTTPException: _http_error}
    return Starlette(
        routes=routes, middleware=_middleware(options), exception_handlers=handlers, lifespan=_keeping_learned
    )


@contextlib.asynccontextmanager
async def _keeping_learned(app: Starlette) -> AsyncIterator[None]:
    """At shutdown, once requests have drained: what the online tree choice learned, kept (uvicorn ends a SIGTERM by
    raising the signal again, which runs no exit handler)."""
    yield
    keep_learned()


async def _next(job: Job, client_gone: Callable[[], Awaitable[bool]] | None = None) -> bytes | None:
    """The job's next piece of audio, None at its end; its failure raised as the server's error. No wait is
    unbounded: every POLL_SECONDS without a piece it checks that the engine thread lives (503 where it died: nothing
    would come) and, given `client_gone`, that the client is still there (None where it left: the job is cancelled)."""
    while True:
        try:
            item = await asyncio.wait_for(job.items.get(), POLL_SECONDS)
            break
        except asyncio.TimeoutError:
            if not job.engine_alive():
                raise engine_stopped() from None
            if client_gone is not None and await client_gone():
                job.cancelled.set()
                return None
    if isinstance(item, ReaderGone):
        raise item
    if isinstance(item, NonFiniteError):
        raise SpeechError(500, str(item), code="non_finite")
    if isinstance(item, Exception):
        raise SpeechError(500, f"synthesis failed: {type(item).__name__}: {item}", code="synthesis_failed")
    if item is not None:
        job.took(item)
    return item


async def engine_result(future: Future, engine: SpeechEngine) -> object:
    """What a task run between frames returned (its error raised); no wait is unbounded: 503 where the engine
    thread has died meanwhile."""
    waited = asyncio.wrap_future(future)
    while True:
        try:
            return await asyncio.wait_for(asyncio.shield(waited), POLL_SECONDS)
        except asyncio.TimeoutError:
            if not engine.alive:
                raise engine_stopped() from None


async def _streamed(job: Job) -> AsyncIterator[bytes]:
    """A streamed body: each piece as the engine makes it (a failure raised: CutStream cuts the body)."""
    while (item := await _next(job)) is not None:
        yield item


async def _events(job: Job) -> AsyncIterator[bytes]:
    """A streamed body as OpenAI's server-sent events: a `speech.audio.delta` event per piece (its bytes in base64),
    then `speech.audio.done`, or an `error` event where the synthesis failed after the status was sent."""

    def event(data: dict) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    try:
        while (item := await _next(job)) is not None:
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(item).decode()})
        yield event({"type": "speech.audio.done"})
    except SpeechError as error:
        yield event({"type": "error", **error.body()})


async def _collected(job: Job, request: Request) -> list[bytes]:
    """A whole body; a client that goes away while it is made cancels the job."""
    parts: list[bytes] = []
    try:
        while (item := await _next(job, request.is_disconnected)) is not None:
            parts.append(item)
        return parts
    except asyncio.CancelledError:  # the server is stopping
        job.cancelled.set()
        raise


class TextSession:
    """A WebSocket session that takes text in pieces (an LLM's words as they come) and speaks each sentence as soon
    as it is whole, as a streamed PCM request with the session's fields; the audio goes back in order, each
    sentence's between a `sentence` and a `sentence.done` event (docs/server.md, "Text in pieces"). No text is
    dropped: the session keeps SESSION_SENTENCES_IN_ENGINE sentences in the engine and the rest itself, in order,
    waiting its turn where the engine's queue is full; what it holds is bounded (a message, its unspoken text)."""

    def __init__(self, websocket: WebSocket, engine: SpeechEngine):
        self.websocket, self.engine = websocket, engine
        self.fields: dict = {}
        self.written = ""  # text after the last whole sentence
        self.unspoken = 0  # characters taken and not yet given to the engine, `written` included
        self.sentences = 0  # sentences taken, numbered from 0
        self.waiting: asyncio.Queue = asyncio.Queue()  # (index, text, fields) to give the engine, None at the end
        self.spoken: asyncio.Queue = asyncio.Queue()  # (index, text, its job or why it was refused), None at the end
        self.in_engine = asyncio.Semaphore(SESSION_SENTENCES_IN_ENGINE)
        self.behind = asyncio.Event()  # set where its reader falls behind one of its sentences' audio
        self.jobs: list[Job] = []
        limit = engine.options.max_chars
        self.message_limit = MESSAGE_CHARS_PER_MAX_CHARS * limit
        self.unspoken_limit = UNSPOKEN_CHARS_PER_MAX_CHARS * limit

    async def run(self) -> None:
        """Receive until `done`, then close once every sentence's audio is sent; a client gone (or cut for not
        reading) frees the rows of its sentences."""
        tasks = [asyncio.create_task(work()) for work in (self._receive, self._give, self._send)]
        receiver, _, sender = tasks
        try:
            done, _ = await asyncio.wait({receiver, sender}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
            await sender
            await self.websocket.close()
        except (WebSocketDisconnect, OSError):  # the client went away
            pass
        except ReaderGone as error:
            log.warning("a WebSocket session is closed: %s", str(error))
            await self.websocket.close(code=1008, reason="fell behind its audio: read it as it comes")
        finally:
            for task in tasks:
                task.cancel()
            for job in self.jobs:
                job.cancelled.set()

    def _checked(self, changes: dict, text: str) -> SpeechRequest:
        body = {**changes, "input": text, "stream": True, "response_format": "pcm"}
        return parse_speech_request(body, self.engine)

    async def _error(self, error: SpeechError, **extra) -> None:
        await self.websocket.send_json({"type": "error", **extra, **error.body()})

    def _take(self, text: str) -> None:
        """Whole sentences of text in order, each cut to --max-chars where it is longer."""
        for piece in chunk_text(text, self.engine.options.max_chars):
            self.unspoken += len(piece)
            self.waiting.put_nowait((self.sentences, piece, self.fields))
            self.sentences += 1

    async def _receive(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            text = message.get("text")
            if text is not None and len(text) > self.message_limit:
                await self._error(
                    SpeechError(
                        413,
                        f"a message of {len(text)} characters is more than this server takes at once "
                        f"({self.message_limit}): send the text in smaller pieces",
                        code="message_too_long",
                    )
                )
                continue
            try:
                event = json_value(text) if text is not None else None
            except ValueError:
                event = None
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "session":
                changes = {name: value for name, value in event.items() if name != "type"}
                try:
                    self._checked(changes, "Checked.")
                    self.fields = changes
                except SpeechError as error:
                    await self._error(error)
            elif kind == "text" and isinstance(event.get("text"), str):
                await self._add(event["text"])
            elif kind in ("flush", "done"):
                self._take(self.written)
                self.unspoken -= len(self.written)
                self.written = ""
                if kind == "done":
                    self.waiting.put_nowait(None)
                    return
            else:
                message = 'send JSON messages: {"type": "session", ...fields}, {"type": "text", "text": ...}, '
                message += '{"type": "flush"} or {"type": "done"}'
                await self._error(SpeechError(400, message))

    async def _add(self, text: str) -> None:
        """Text added to the session: its whole sentences taken; refused where the session holds too much unspoken."""
        if self.unspoken + len(text) > self.unspoken_limit:
            await self._error(
                SpeechError(
                    413,
                    f"this session holds {self.unspoken} characters not yet spoken; {len(text)} more would be over its "
                    f"{self.unspoken_limit}: wait for sentence.done events before sending more text",
                    code="session_text_too_long",
                )
            )
            return
        whole, rest = complete_sentences(self.written + text)
        self.unspoken -= len(self.written)
        self.written = ""
        for sentence in whole:
            self._take(sentence)
        if len(rest) > self.engine.options.max_chars:  # no sentence end in sight: speak it as it stands
            self._take(rest)
            rest = ""
        self.written = rest
        self.unspoken += len(rest)

    async def _give(self) -> None:
        """The sentences to the engine in order, SESSION_SENTENCES_IN_ENGINE at a time, each waiting for room."""
        while (entry := await self.waiting.get()) is not None:
            index, text, fields = entry
            await self.in_engine.acquire()
            self.unspoken -= len(text)
            try:
                outcome = await self.engine.submit_when_free(self._checked(fields, text), self.behind)
                self.jobs.append(outcome)
            except SpeechError as error:
                outcome = error
            self.spoken.put_nowait((index, text, outcome))
        self.spoken.put_nowait(None)

    async def _send(self) -> None:
        """The session's audio in the order its sentences came: an `error` event for one refused or failed."""
        while (entry := await self.spoken.get()) is not None:
            index, text, job = entry
            try:
                if isinstance(job, SpeechError):
                    raise job
                await self.websocket.send_json({"type": "sentence", "index": index, "text": text})
                while (item := await _next(job)) is not None:
                    await _sent(self.behind, self.websocket.send_bytes(item))
                await self.websocket.send_json({"type": "sentence.done", "index": index})
            except SpeechError as error:
                await self._error(error, index=index)
            finally:
                self.in_engine.release()
        await self.websocket.send_json({"type": "done"})


def uvicorn_settings(options: ServerOptions) -> dict:
    """uvicorn's settings that bound what a client holds: a WebSocket message of at most MAX_BODY_BYTES (a bigger one
    closes its session with 1009), and the seconds a stopping server (SIGTERM) gives requests in flight to finish."""
    return {"ws_max_size": MAX_BODY_BYTES, "timeout_graceful_shutdown": options.drain_seconds}


def serve(synth, options: ServerOptions, host: str = "127.0.0.1", port: int = 8880, quiet: bool = False) -> None:
    """Serve `synth` over HTTP until interrupted (uvicorn): on SIGTERM or Ctrl-C it stops taking connections, lets
    the requests in flight finish for up to --drain-seconds, cuts the rest (their clients see an error) and exits."""
    import uvicorn

    handler = logging.StreamHandler()  # the engine's log beside uvicorn's, in its shape
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False
    engine = SpeechEngine(synth, options)
    try:
        uvicorn.run(
            create_app(engine),
            host=host,
            port=port,
            log_level="warning" if quiet else "info",
            **uvicorn_settings(options),
        )
    finally:
        engine.close()
