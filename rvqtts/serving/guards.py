"""What stands between a connection and the engine, as ASGI middleware and checks: the API key (checked once, for
every route but the open ones), the number of requests and sessions at once, browser origins (CORS and the
WebSocket's Origin check), JSON only, and bodies of bounded size. docs/server.md, "Limits"."""

from __future__ import annotations

import hmac
from typing import AsyncIterator
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.websockets import WebSocket

from rvqtts.serving.errors import SpeechError
from rvqtts.serving.options import ServerOptions

MAX_BODY_BYTES = 1 << 20  # a request body, and a WebSocket message (a bigger one closes its session with 1009)
PROBES = ("/health", "/ready", "/metrics")  # always answered, whatever the load: load balancers and scrapers ask
OPEN_PATHS = (*PROBES, "/", "/openapi.json", "/docs")  # answered without the key: the page asks for it itself
OPEN_FOLDERS = ("/page/",)
# what a browser app of an allowed origin may read of an answer: when to retry, the audio's rate, a request's figures
EXPOSED_HEADERS = [
    "Retry-After",
    "X-Sample-Rate",
    "X-Audio-Seconds",
    "X-Seconds",
    "X-Real-Time-Factor",
    "X-Codes-Per-Call",
]


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_FOLDERS)


class KeyCheck:
    """ASGI middleware: with --api-key, every route but the open ones (probes, the page, the API's description)
    needs `Authorization: Bearer KEY`; a request without it gets 401, a WebSocket handshake is refused (HTTP 403)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.api_key is None or is_open(scope["path"]):
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "a valid API key is needed"})
        refused = SpeechError(
            401,
            "a valid API key is needed: send the header `Authorization: Bearer KEY` with the key the server "
            "was started with (--api-key)",
            code="invalid_api_key",
        )
        await refused.response()(scope, receive, send)


class ConnectionLimit:
    """ASGI middleware: at most `limit` requests and WebSocket sessions at once (--max-connections); each holds
    memory and maybe a row, so past it a new one gets 503 at once instead of piling up. The probes are always
    answered."""

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


def middleware(options: ServerOptions) -> list[Middleware]:
    """CORS for the allowed origins' browser apps (outermost: its headers on every answer, refusals included), the
    connection limit, then the key."""
    layers = [Middleware(ConnectionLimit, limit=options.max_connections), Middleware(KeyCheck, api_key=options.api_key)]
    if options.allowed_origins:
        cors = Middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=EXPOSED_HEADERS,
        )
        layers.insert(0, cors)
    return layers


def is_json(content_type: str | None) -> bool:
    """A JSON body's media type (any parameters, e.g. charset). Only JSON is taken: a browser page of another site
    may send text/plain or a form to any address without asking (no CORS preflight), but not JSON."""
    return (content_type or "").partition(";")[0].strip().lower() == "application/json"


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
