"""`rvqtts serve`: the OpenAI audio API over one loaded Synthesizer.

`POST /v1/audio/speech` takes OpenAI's fields (`model`, `input`, `voice`, `response_format`, `speed`,
`instructions`, `stream_format`) and rvqtts's own (`language`, `instruct`, `seed`, `stream` and the sampling
settings); `GET /v1/models`, `GET /v1/voices` and `GET /health` say what is served. One engine thread owns the
model and takes requests from a bounded queue (full: 503 with Retry-After): whole ones waiting together share
the calls of both loops (`--batch-size`), a streamed one is spoken alone, and a response is the bytes
`rvqtts synth` writes for the same text, voice and seed. A streamed response carries audio every 4 frames as
`synth --stream` makes it, as the audio itself or as OpenAI's server-sent events; a client that goes away stops its
streamed request within a frame.
Errors are JSON in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from rvqtts.audio import AUDIO_FORMATS, audio_bytes, pcm16, wav_header
from rvqtts.cloning import VoiceSource
from rvqtts.engine.sampling import NonFiniteError
from rvqtts.memory import memory_record
from rvqtts.settings import GenerationSettings, Line
from rvqtts.synthesis import STREAM_FRAMES  # frames per streamed chunk, as `rvqtts synth --stream` (320 ms)

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
MAX_BODY_BYTES = 1 << 20


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


@dataclass(frozen=True)
class ServerOptions:
    """How the server answers: the model name it reports, the key it asks for, the voice files it may read,
    the longest input, the waiting requests it holds, the text chunking `synth` uses, and how many whole
    requests may share the calls of both loops."""

    model_name: str
    api_key: str | None = None
    voices_dir: Path | None = None
    max_chars: int = 4096
    queue_size: int = 8
    chunk_chars: float | None = 240
    batch_size: int = 1


@dataclass(frozen=True)
class SpeechRequest:
    """One request, checked: what to say and in which voice (its line: a one-line run's, utterance 0, with its own
    seed, so its audio is `rvqtts synth`'s), how to sample, and how to send it."""

    line: Line
    settings: GenerationSettings
    response_format: str
    stream: bool
    events: bool = False  # streamed as server-sent events (`stream_format: "sse"`), else as the audio itself


class Cancelled(Exception):
    """The client went away: its request stops at the next frame."""


@dataclass
class Job:
    """A request in the engine: its output reaches the event loop through `items` (bytes, then None at the end,
    or the exception that ended it); `cancelled` stops it."""

    request: SpeechRequest
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, item: bytes | Exception | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            self.cancelled.set()


def voice_files(folder: Path | None) -> dict[str, Path]:
    """The voice files a request may name: `NAME.safetensors` directly in `folder` (a link out of it is
    not one). A request's voice is only ever looked up here, never joined to a path."""
    if folder is None:
        return {}
    root = folder.resolve()
    return {p.stem: p for p in sorted(root.glob("*.safetensors")) if p.is_file() and p.resolve().parent == root}


class SpeechEngine:
    """The model's one thread: it takes jobs from a bounded queue in the order they came. A streamed job is
    spoken alone (its audio sent as it is made); a whole one takes the waiting whole jobs of the same sampling
    settings with it, up to `batch_size`, and they are spoken together, a row each in every call of both loops
    (`Synthesizer.synthesize_many` for both, each with its own seed: its audio is the one it gets alone where the
    kernels keep rows invariant, which `--batch-size auto` requires)."""

    def __init__(self, synth, options: ServerOptions):
        self.synth = synth
        self.options = options
        self.busy = False
        self.counts = {"served": 0, "failed": 0, "cancelled": 0, "refused_busy": 0, "batched": 0}
        self._waiting: deque[Job] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._seconds, self._timed = 0.0, 0  # the mean time a request held the engine (Retry-After), over how many
        self._thread = threading.Thread(target=self._serve, name="rvqtts-engine", daemon=True)
        self._thread.start()

    def voices(self) -> list[str]:
        """The `voice` values this model takes: its speakers, or (Base models) the voice files' names."""
        if self.synth.kind == "base":
            return sorted(voice_files(self.options.voices_dir))
        return list(self.synth.speakers)

    def submit(self, request: SpeechRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        with self._changed:
            if len(self._waiting) >= self.options.queue_size:
                self.counts["refused_busy"] += 1
                wait = max(1, math.ceil(self._seconds * (len(self._waiting) + 1)))
                raise SpeechError(
                    503,
                    f"the server is busy ({self.options.queue_size} requests waiting): retry in {wait} s",
                    code="server_busy",
                    headers={"Retry-After": str(wait)},
                )
            self._waiting.append(job)
            self._changed.notify()
        return job

    def health(self) -> dict:
        return {
            "status": "ok",
            "model": self.options.model_name,
            "busy": self.busy,
            "queued": len(self._waiting),
            "batch_size": self.options.batch_size,
            **self.counts,
            **memory_record(),
            # what the engine keeps between requests and grows by use, inside rss_mib (the rest is the loaded model)
            "caches_mib": self.synth.cache_mib(),
        }

    def close(self) -> None:
        """Stop the engine thread once the jobs queued before are done."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()

    def _next_group(self) -> list[Job] | None:
        """The next job and the waiting jobs that can share its calls (None: the engine is closing)."""
        with self._changed:
            while not self._waiting:
                if self._closing:
                    return None
                self._changed.wait()
            first = self._waiting.popleft()
            group = [first]
            if not first.request.stream:
                for job in list(self._waiting):
                    if len(group) >= self.options.batch_size:
                        break
                    if not job.request.stream and job.request.settings == first.request.settings:
                        self._waiting.remove(job)
                        group.append(job)
            return group

    def _serve(self) -> None:
        while (group := self._next_group()) is not None:
            for job in group:
                if job.cancelled.is_set():
                    self.counts["cancelled"] += 1
            group = [job for job in group if not job.cancelled.is_set()]
            if not group:
                continue
            self.busy, begun = True, time.perf_counter()
            try:
                self._speak(group)
            finally:
                self.busy = False
                share = (time.perf_counter() - begun) / len(group)  # each request's share of the time
                for _ in group:
                    self._timed += 1
                    self._seconds += (share - self._seconds) / self._timed

    def _speak(self, group: list[Job]) -> None:
        """Jobs spoken together, a row each (`Synthesizer.synthesize_many`; one job: alone), a streamed one's audio
        sent as it is made. A job alone whose client left stops at the next frame; one in a group runs on with it
        (its audio unsent)."""
        synth, first = self.synth, group[0].request
        stream = first.stream  # a streamed job is grouped alone

        def on_frame(*_: object) -> None:
            if len(group) == 1 and group[0].cancelled.is_set():
                raise Cancelled

        lines = [job.request.line for job in group]
        if stream and first.response_format == "wav":
            group[0].send(wav_header(synth.sample_rate))
        answered: set[int] = set()
        try:
            for index, outcome in synth.synthesize_many(
                lines,
                settings=first.settings,
                chunk_chars=self.options.chunk_chars,
                batch_size=len(group),
                stream_frames=STREAM_FRAMES if stream else None,
                on_frame=on_frame,
            ):
                job = group[index]
                if isinstance(outcome, np.ndarray):
                    if outcome.size:
                        job.send(pcm16(outcome))
                    continue
                answered.add(index)
                if isinstance(outcome, Exception):
                    self.counts["failed"] += 1
                    job.send(outcome)
                    continue
                if not stream:
                    job.send(encode(outcome.audio, synth.sample_rate, job.request.response_format))
                job.send(None)
                self.counts["served"] += 1
                self.counts["batched"] += len(group) > 1
        except Cancelled:
            self.counts["cancelled"] += 1
        except Exception as error:  # NaN or inf, which stops every row: each client hears of it
            for index, job in enumerate(group):
                if index not in answered:
                    self.counts["failed"] += 1
                    job.send(error)


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

    def string(name: str, default: str | None = None) -> str | None:
        value = body.get(name, default)
        if value is not None and not isinstance(value, str):
            raise SpeechError(400, f"`{name}` must be a string", name)
        return value

    text = string("input")
    if text is None or not text.strip():
        raise SpeechError(400, "`input` is empty: give the text to speak", "input")
    if len(text) > options.max_chars:
        raise SpeechError(
            413,
            f"`input` has {len(text)} characters, more than this server's {options.max_chars} (--max-chars): "
            "send it in parts",
            "input",
            "input_too_long",
        )
    string("model")  # accepted whatever it names: the server has one model (GET /v1/models)
    response_format = string("response_format", "wav")
    if response_format not in RESPONSE_FORMATS:
        raise SpeechError(
            400,
            f"response_format {response_format!r} is not one rvqtts makes: choose {', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    stream_format = string("stream_format")
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
    speed = body.get("speed", 1.0)
    if speed != 1.0:
        raise SpeechError(400, f"speed {speed!r}: rvqtts speaks at the model's own pace (1.0 only)", "speed")
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpeechError(400, "`seed` must be a whole number", "seed")
    instruct = string("instruct") or string("instructions")
    language = string("language", "auto")
    speaker, voice_file = _voice(body.get("voice"), synth, engine)
    values = {name: body.get(name) for name in SAMPLING_FIELDS}
    for name, value in values.items():
        kinds = SAMPLING_FIELDS[name]
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise SpeechError(400, f"`{name}` must be a {'whole ' if kinds is int else ''}number", name)
    line = Line(text, speaker, language, instruct, voice_file and VoiceSource(voice=voice_file), utterance=0, seed=seed)
    try:
        settings = GenerationSettings(**values)
        line = synth.voiced(line)  # a voice file read once
    except (ValueError, TypeError) as error:  # VoiceError included
        raise SpeechError(400, str(error)) from None
    return SpeechRequest(line, settings, response_format, stream, stream_format == "sse")


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


def create_app(engine: SpeechEngine):
    """The ASGI application (Starlette) over `engine`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    options = engine.options

    def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), options.api_key.encode()):
            raise SpeechError(
                401,
                "a valid API key is needed: send the header `Authorization: Bearer KEY` with the key the server "
                "was started with (--api-key)",
                code="invalid_api_key",
            )

    async def speech(request: Request) -> Response:
        authorize(request)
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise SpeechError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
        try:
            body = await request.json()
        except ValueError:
            raise SpeechError(400, "the body is not JSON: send a JSON object with `input` and `voice`") from None
        speech_request = parse_speech_request(body, engine)
        job = engine.submit(speech_request)
        media_type = RESPONSE_FORMATS[speech_request.response_format]
        if speech_request.events:
            return StreamingResponse(_events(job), media_type="text/event-stream")
        if speech_request.stream:
            return StreamingResponse(_streamed(job), media_type=media_type)
        parts = await _collected(job, request)
        return Response(b"".join(parts), media_type=media_type)

    async def models(request: Request) -> Response:
        authorize(request)
        entry = {"id": options.model_name, "object": "model", "created": 0, "owned_by": "rvqtts"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def voices(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"model": options.model_name, "kind": engine.synth.kind, "voices": engine.voices()})

    async def health(request: Request) -> Response:
        return JSONResponse(engine.health())

    async def refused(request: Request, error: SpeechError) -> Response:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def http_error(request: Request, error: HTTPException) -> Response:
        return JSONResponse(
            SpeechError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").body(),
            status_code=error.status_code,
        )

    routes = [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/voices", voices, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={SpeechError: refused, HTTPException: http_error})


async def _next(job: Job) -> bytes | None:
    """The job's next piece of audio, None at its end; its failure raised as the server's error."""
    item = await job.items.get()
    if isinstance(item, NonFiniteError):
        raise SpeechError(500, str(item), code="non_finite")
    if isinstance(item, Exception):
        raise SpeechError(500, f"synthesis failed: {type(item).__name__}: {item}", code="synthesis_failed")
    return item


async def _streamed(job: Job) -> AsyncIterator[bytes]:
    """A streamed body: each piece as the engine makes it. However it ends (a client gone, the server
    stopping), the job is cancelled, which stops the engine at its next frame."""
    try:
        while (item := await _next(job)) is not None:
            yield item
    except SpeechError as error:  # the status is sent: end the body early, and say why in the server's log
        logging.getLogger("rvqtts.server").error("a streamed request ended early: %s", error.message)
    finally:
        job.cancelled.set()


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
    finally:
        job.cancelled.set()


async def _collected(job: Job, request) -> list[bytes]:
    """A whole body; a client that goes away while it is made cancels the job."""
    parts: list[bytes] = []
    try:
        while True:
            try:
                item = await asyncio.wait_for(_next(job), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return parts
                continue
            if item is None:
                return parts
            parts.append(item)
    except asyncio.CancelledError:  # the server is stopping
        job.cancelled.set()
        raise


def serve(synth, options: ServerOptions, host: str = "127.0.0.1", port: int = 8880, quiet: bool = False) -> None:
    """Serve `synth` over HTTP until interrupted (uvicorn)."""
    import uvicorn

    engine = SpeechEngine(synth, options)
    try:
        uvicorn.run(
            create_app(engine),
            host=host,
            port=port,
            log_level="warning" if quiet else "info",
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.close()
