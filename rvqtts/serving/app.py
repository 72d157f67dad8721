"""`rvqtts serve`'s application: the routes of the OpenAI audio API, the WebSocket, the voices, the probes, the web
page and the API's description, over one SpeechEngine (`app.state.engine`), and `serve`, which runs it with uvicorn
(and Wyoming beside it, where asked). docs/server.md."""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from pathlib import Path
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from rvqtts.engine.speculative.online import keep_learned
from rvqtts.qwen.cloning import VoiceError
from rvqtts.serving.api_description import api_description
from rvqtts.serving.engine import SpeechEngine
from rvqtts.serving.errors import SpeechError, engine_stopped
from rvqtts.serving.guards import MAX_BODY_BYTES, check_origin, middleware
from rvqtts.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rvqtts.serving.options import ServerOptions
from rvqtts.serving.request_parsing import json_body, parse_speech_request, voice_form
from rvqtts.serving.speech_request import RESPONSE_FORMATS
from rvqtts.serving.streams import CutStream, audio_events, audio_pieces, engine_result, whole_audio
from rvqtts.serving.text_session import TextSession
from rvqtts.serving.voices import VoiceConflict, VoiceStore

log = logging.getLogger("rvqtts.serving")

PAGE = Path(__file__).parent / "page"  # the web page's files, shipped in the package
# the page runs its own scripts and styles only, talks to its own server, and is framed by no other site
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; media-src 'self' blob:; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
}


def engine_of(connection: Request | WebSocket) -> SpeechEngine:
    return connection.app.state.engine


async def speech(request: Request) -> Response:
    """POST /v1/audio/speech: the audio whole, streamed, or as server-sent events."""
    engine = engine_of(request)
    speech_request = parse_speech_request(await json_body(request), engine)
    job = engine.submit(speech_request)
    media_type = RESPONSE_FORMATS[speech_request.response_format]
    headers = {"X-Sample-Rate": str(engine.synth.sample_rate)}
    if speech_request.events:
        return CutStream(job, audio_events(job), "text/event-stream", headers)
    if speech_request.stream:
        return CutStream(job, audio_pieces(job), media_type, headers)
    audio = await whole_audio(job, request)
    figures = job.figures or {}
    headers |= {
        f"X-{name.replace('_', '-').title()}": str(figures[name]) for name in WHOLE_FIGURES if figures.get(name)
    }
    return Response(audio, media_type=media_type, headers=headers)


WHOLE_FIGURES = ("audio_seconds", "seconds", "real_time_factor", "codes_per_call")  # a whole response's headers


async def models(request: Request) -> Response:
    entry = {"id": engine_of(request).options.model_name, "object": "model", "created": 0, "owned_by": "rvqtts"}
    return JSONResponse({"object": "list", "data": [entry]})


async def voices(request: Request) -> Response:
    """GET /v1/audio/voices: what a request may ask for (the page's choices)."""
    engine = engine_of(request)
    synth = engine.synth
    return JSONResponse(
        {
            "model": engine.options.model_name,
            "kind": synth.kind,
            "voices": engine.voices(),
            "languages": ["auto", *(language for language in synth.languages if language != "auto")],
            "instructions": synth.supports_instruct,
            "uploads": engine.voice_store is not None,
        }
    )


def voice_store(engine: SpeechEngine) -> VoiceStore:
    if engine.voice_store is None:
        why = (
            f"this is a {engine.synth.kind} model: only a Base model clones voices"
            if engine.synth.kind != "base"
            else "the server keeps none: start it with --voices DIR"
        )
        raise SpeechError(400, f"voices cannot be uploaded or deleted here: {why}", code="voices_not_kept")
    return engine.voice_store


async def upload_voice(request: Request) -> Response:
    """POST /v1/audio/voices: a recording encoded (between frames, by the engine) into a voice file."""
    engine = engine_of(request)
    store = voice_store(engine)
    form, filename = await voice_form(request, engine.options)
    encoding = partial(store.add, form.name, form.audio_sample, filename, form.ref_text)
    try:  # encoded by the engine between frames: the event loop goes on answering meanwhile
        voice, seconds = await engine_result(engine.between_frames(encoding), engine)
    except VoiceConflict as error:
        raise SpeechError(409, str(error), "name", "voice_exists") from None
    except VoiceError as error:
        raise SpeechError(400, str(error), "audio_sample") from None
    mode = "icl" if voice.icl else "x-vector-only"
    return JSONResponse({"object": "voice", "name": form.name, "mode": mode, "seconds": round(seconds, 3)})


async def delete_voice(request: Request) -> Response:
    name = request.path_params["name"]
    try:
        removed = voice_store(engine_of(request)).remove(name)
    except VoiceError as error:
        raise SpeechError(400, str(error), "name") from None
    if not removed:
        raise SpeechError(404, f"no voice named {name!r}: GET /v1/audio/voices lists them", "name", "no_voice")
    return JSONResponse({"object": "voice", "name": name, "deleted": True})


async def health(request: Request) -> Response:
    return JSONResponse(engine_of(request).health())


async def metrics(request: Request) -> Response:
    return Response(engine_of(request).accounting.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)


async def ready(request: Request) -> Response:
    if not engine_of(request).ready:
        raise engine_stopped()
    return JSONResponse({"status": "ready"})


async def text_session(websocket: WebSocket) -> None:
    engine = engine_of(websocket)
    try:
        check_origin(websocket, engine.options)
    except SpeechError as error:  # refused before the handshake: the client sees HTTP 403
        await websocket.close(code=1008, reason=error.message[:120])
        return
    await websocket.accept()
    await TextSession(websocket, engine).run()


async def page(request: Request) -> Response:
    return FileResponse(PAGE / "index.html", headers=PAGE_HEADERS)


async def api_docs(request: Request) -> Response:
    return FileResponse(PAGE / "docs.html", headers=PAGE_HEADERS)


async def openapi(request: Request) -> Response:
    return JSONResponse(api_description(engine_of(request).options))


async def refused(request: Request, error: SpeechError) -> Response:
    return error.response()


async def http_error(request: Request, error: HTTPException) -> Response:
    return JSONResponse(
        SpeechError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").body(),
        status_code=error.status_code,
    )


ROUTES = [
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
    Route("/", page, methods=["GET"]),
    Route("/docs", api_docs, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Mount("/page", StaticFiles(directory=PAGE), name="page"),
]


def create_app(engine: SpeechEngine) -> Starlette:
    """The ASGI application (Starlette) over `engine`."""
    app = Starlette(
        routes=ROUTES,
        middleware=middleware(engine.options),
        exception_handlers={SpeechError: refused, HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """Wyoming served beside HTTP on the same event loop, where asked; at shutdown, once requests have drained, it
    stops and what the online tree choice learned is kept (uvicorn ends a SIGTERM by raising the signal again, which
    runs no exit handler)."""
    engine: SpeechEngine = app.state.engine
    address = engine.options.wyoming_address
    wyoming = None
    if address is not None:
        from rvqtts.serving.wyoming_server import start_wyoming

        wyoming = await start_wyoming(engine, *address)
        log.info("Wyoming on tcp://%s:%d (Home Assistant: docs/server.md)", *address)
    try:
        yield
    finally:
        if wyoming is not None:
            await wyoming.stop()
        keep_learned()


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
    settings = dict(host=host, port=port, log_level="warning" if quiet else "info", **uvicorn_settings(options))
    try:
        uvicorn.run(create_app(engine), **settings)
    finally:
        engine.close()
