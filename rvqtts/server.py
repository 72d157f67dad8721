"""`rvqtts serve`: the OpenAI audio API over one loaded Synthesizer.

`POST /v1/audio/speech` takes OpenAI's fields (`model`, `input`, `voice`, `response_format`, `speed`,
`instructions`, `stream_format`) and rvqtts's own (`language`, `instruct`, `seed`, `stream` and the sampling
settings); `GET /v1/models`, `GET /v1/voices` and `GET /health` say what is served. One engine thread owns the
model and takes requests from a bounded queue (full: 503 with Retry-After) into the rows of one frame loop as rows
free up (`--batch-size` rows), streamed and whole alike, sharing the calls of both loops; a whole response is the
bytes `rvqtts synth` writes for the same text, voice, seed and settings. A streamed response carries its first
audio after one frame and then every 4 frames, as `synth --stream` makes it, as the audio itself or as OpenAI's
server-sent events; a client that goes away frees its row within a frame.
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
from typing import AsyncIterator, Iterator

import numpy as np

from rvqtts.audio import AUDIO_FORMATS, audio_bytes, pcm16, wav_header
from rvqtts.batch_size import fitting_slots
from rvqtts.cloning import VoiceSource
from rvqtts.engine.frame_loop import Stopped
from rvqtts.engine.sampling import NonFiniteError
from rvqtts.memory import memory_record
from rvqtts.pipeline import row_slots, speak
from rvqtts.settings import GenerationSettings, Line, StreamPacing, Synthesis
from rvqtts.text import complete_sentences

log = logging.getLogger("rvqtts.server")

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
    the longest input, the waiting requests it holds, the text chunking `synth` uses, how many requests may share
    the calls of both loops (rows), and how streamed audio is paced."""

    model_name: str
    api_key: str | None = None
    voices_dir: Path | None = None
    max_chars: int = 4096
    queue_size: int = 8
    chunk_chars: float | None = 240
    batch_size: int = 1
    pacing: StreamPacing = StreamPacing()


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


@dataclass
class Job:
    """A request in the engine: its output reaches the event loop through `items` (bytes, then None at the end,
    or the exception that ended it); `cancelled` stops it at the next frame."""

    request: SpeechRequest
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when a row took it
    shared: bool = False  # spoken in calls with another request

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
    """The model's one thread: one frame loop over `batch_size` rows (rvqtts.pipeline.speak) that takes requests
    from a bounded queue in the order they came, each as soon as a row is free (at the next frame), streamed and
    whole alike, each with its own seed and sampling settings: they share the calls of both loops, and each one's
    audio is the one it gets alone where the kernels keep rows invariant (which `--batch-size auto` requires). A
    request leaves its row when it ends, or at the next frame when its client has gone."""

    def __init__(self, synth, options: ServerOptions):
        self.synth = synth
        self.options = options
        self.counts = {"served": 0, "failed": 0, "cancelled": 0, "refused_busy": 0, "batched": 0}
        # streamed requests served and their first audio's parts, summed (a load test takes means between two reads)
        self.first_audio = {"streamed": 0, "queue": 0.0, "prefill": 0.0, "frames": 0.0, "decoder": 0.0}
        self._waiting: deque[Job] = deque()
        self._speaking: dict[int, Job] = {}  # by index among the lines the loop took (touched by the engine only)
        self._taken = 0  # lines the loop took
        self._changed = threading.Condition()
        self._closing = False
        self.row_slots = fitting_slots(synth, options.batch_size)  # what one request's row may hold
        self._seconds, self._timed = 0.0, 0  # the mean time a request held a row (Retry-After), over how many
        synth.codec.warm_up(options.pacing)  # the decoder's cold start out of the first request's first audio
        self._thread = threading.Thread(target=self._serve, name="rvqtts-engine", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._speaking)

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
                rounds = (len(self._waiting) + 1) / self.options.batch_size
                wait = max(1, math.ceil(self._seconds * rounds))
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
            "speaking": len(self._speaking),
            "queued": len(self._waiting),
            "batch_size": self.options.batch_size,
            **self.counts,
            **memory_record(),
            # what the engine keeps between requests and grows by use, inside rss_mib (the rest is the loaded model)
            "caches_mib": self.synth.cache_mib(),
            "first_audio_seconds": {name: round(value, 3) for name, value in self.first_audio.items()},
        }

    def close(self) -> None:
        """Stop the engine thread once the jobs queued before are done."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()

    def _serve(self) -> None:
        """Speak requests until closed; a failure that stops every row (NaN or inf) fails the requests in them, and
        the loop starts again for the next."""
        while True:
            try:
                lines, rows = self._lines(), self.options.batch_size
                for index, item in speak(
                    self.synth, lines, GenerationSettings(), self.options.chunk_chars, rows, stopped=self._stopped
                ):
                    self._answer(index, item)
                return
            except Exception as error:  # each client in a row hears of it
                for job in self._speaking.values():
                    self.counts["failed"] += 1
                    job.send(error)
                self._speaking.clear()

    def _lines(self) -> Iterator[Line | None]:
        """The frame loop's live source: the next waiting request's line, None while none waits and rows are at work,
        waiting while none is at work; it ends when the engine closes with nothing left to speak."""
        while True:
            with self._changed:
                while not self._waiting and not self._speaking:
                    if self._closing:
                        return
                    self._changed.wait()
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
            split = {"queue": round(job.started - job.submitted, 3), **item.seconds["first_audio_split"]}
            log.info("request %d: first audio after %s s", index, " + ".join(f"{v} {k}" for k, v in split.items()))
            if job.request.stream:
                self.first_audio["streamed"] += 1
                for part, seconds in split.items():
                    self.first_audio[part] += seconds
            job.send(None)
            self.counts["served"] += 1
            self.counts["batched"] += job.shared


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

    def within_max_chars(name: str, value: str | None) -> str | None:
        if value is not None and len(value) > options.max_chars:
            raise SpeechError(
                413,
                f"`{name}` has {len(value)} characters, more than this server's {options.max_chars} (--max-chars): "
                "send it in parts",
                name,
                "input_too_long",
            )
        return value

    text = string("input")
    if text is None or not text.strip():
        raise SpeechError(400, "`input` is empty: give the text to speak", "input")
    within_max_chars("input", text)
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
    if not 0 <= seed < 2**63:
        raise SpeechError(400, f"`seed` must be between 0 and 2**63 - 1, got {seed}", "seed")
    instruct = within_max_chars("instructions", string("instruct") or string("instructions"))
    language = string("language", "auto")
    speaker, voice_file = _voice(body.get("voice"), synth, engine)
    values = {name: body.get(name) for name in SAMPLING_FIELDS}
    for name, value in values.items():
        kinds = SAMPLING_FIELDS[name]
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise SpeechError(400, f"`{name}` must be a {'whole ' if kinds is int else ''}number", name)
    limit = synth.default_max_frames
    if values["max_frames"] is not None and values["max_frames"] > limit:
        raise SpeechError(
            400, f"max_frames {values['max_frames']} is over this model's limit of {limit} frames", "max_frames"
        )
    try:
        settings = GenerationSettings(**values)
        clone = voice_file and VoiceSource(voice=voice_file)
        line = Line(
            text,
            speaker,
            language,
            instruct,
            clone,
            0,
            seed,
            settings=settings,
            stream=options.pacing if stream else None,
        )
        line = synth.voiced(line)  # a voice file read once
    except (ValueError, TypeError) as error:  # VoiceError included
        raise SpeechError(400, str(error)) from None
    slots = row_slots(synth, line, settings, options.chunk_chars)
    if slots > engine.row_slots:
        raise SpeechError(
            400,
            f"this input with max_frames {settings.max_frames} would hold {slots} cache positions in its row, more "
            f"than the {engine.row_slots} each of this server's {options.batch_size} rows may hold in its memory: "
            "ask for fewer max_frames or send the input in parts",
            "max_frames",
        )
    return SpeechRequest(line, response_format, stream_format == "sse")


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
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket

    options = engine.options

    def authorize(request: Request | WebSocket) -> None:
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

    async def text_session(websocket: WebSocket) -> None:
        try:
            authorize(websocket)
        except SpeechError as error:  # refused before the handshake: the client sees HTTP 403
            await websocket.close(code=1008, reason=error.message[:120])
            return
        await websocket.accept()
        await _speak_text(websocket, engine)

    routes = [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", text_session),
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
        log.error("a streamed request ended early: %s", error.message)
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


async def _speak_text(websocket, engine: SpeechEngine) -> None:
    """A WebSocket session that takes text in pieces (an LLM's words as they come) and speaks each sentence as soon
    as it is whole, as a streamed PCM request with the session's fields; the audio goes back in order, each
    sentence's between a `sentence` and a `sentence.done` event (docs/server.md, "Text in pieces")."""
    from starlette.websockets import WebSocketDisconnect

    fields: dict = {}
    written, spoken, jobs = "", 0, []
    sentences: asyncio.Queue = asyncio.Queue()  # (index, text, its job or why it was refused), None at the end

    def checked(changes: dict, text: str) -> SpeechRequest:
        return parse_speech_request({**changes, "input": text, "stream": True, "response_format": "pcm"}, engine)

    def submit(text: str) -> None:
        nonlocal spoken
        text = " ".join(text.split())
        try:
            outcome = engine.submit(checked(fields, text))
            jobs.append(outcome)
        except SpeechError as error:
            outcome = error
        sentences.put_nowait((spoken, text, outcome))
        spoken += 1

    sender = asyncio.create_task(_send_sentences(websocket, sentences))
    try:
        while True:
            try:
                event = json.loads(await websocket.receive_text())
            except (ValueError, KeyError):  # not JSON, or a binary message
                event = None
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "session":
                changes = {name: value for name, value in event.items() if name != "type"}
                try:
                    checked(changes, "Checked.")
                    fields = changes
                except SpeechError as error:
                    await websocket.send_json({"type": "error", **error.body()})
            elif kind == "text" and isinstance(event.get("text"), str):
                whole, written = complete_sentences(written + event["text"])
                for sentence in whole:
                    submit(sentence)
                if len(written) > engine.options.max_chars:  # no sentence end in sight: speak it as it stands
                    submit(written)
                    written = ""
            elif kind in ("flush", "done"):
                if written.strip():
                    submit(written)
                written = ""
                if kind == "done":
                    break
            else:
                message = 'send JSON messages: {"type": "session", ...fields}, {"type": "text", "text": ...}, '
                message += '{"type": "flush"} or {"type": "done"}'
                await websocket.send_json({"type": "error", **SpeechError(400, message).body()})
        sentences.put_nowait(None)
        await sender
        await websocket.close()
    except WebSocketDisconnect:
        pass
    finally:
        for job in jobs:  # a session that ends early frees its rows
            job.cancelled.set()
        sender.cancel()


async def _send_sentences(websocket, sentences: asyncio.Queue) -> None:
    """The session's audio in the order its sentences came: an `error` event for one refused or failed."""
    while (entry := await sentences.get()) is not None:
        index, text, job = entry
        try:
            if isinstance(job, SpeechError):
                raise job
            await websocket.send_json({"type": "sentence", "index": index, "text": text})
            while (item := await _next(job)) is not None:
                await websocket.send_bytes(item)
            await websocket.send_json({"type": "sentence.done", "index": index})
        except SpeechError as error:
            await websocket.send_json({"type": "error", "index": index, **error.body()})
    await websocket.send_json({"type": "done"})


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
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.close()
