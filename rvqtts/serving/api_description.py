"""The HTTP API described as OpenAPI 3.1 (GET /openapi.json, read by /docs and by client generators), made from the
models the request parser validates against (rvqtts.serving.request_parsing), so the description and the checks are
one source. The WebSocket's protocol is described beside it in docs/server.md, "Text in pieces"."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pydantic import BaseModel, Field

from rvqtts.serving.options import ServerOptions
from rvqtts.serving.request_parsing import SpeechBody, VoiceForm
from rvqtts.serving.speech_request import RESPONSE_FORMATS


class ErrorDetail(BaseModel):
    message: str = Field(description="What was wrong and what to send instead.")
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx).")
    param: str | None = Field(description="The field that was wrong, where one was.")
    code: str | None = Field(description="A stable name for the error, e.g. server_busy, invalid_api_key.")


class ErrorBody(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class VoiceList(BaseModel):
    """What a request may ask for."""

    model: str
    kind: str = Field(description="custom_voice, base or voice_design.")
    voices: list[str] = Field(description="The `voice` values taken: speakers, or a Base model's voice files.")
    languages: list[str]
    instructions: bool = Field(description="Whether the model takes `instructions`.")
    uploads: bool = Field(description="Whether voices may be uploaded and deleted here (a Base model with --voices).")


class Voice(BaseModel):
    """An uploaded voice."""

    object: str = "voice"
    name: str
    mode: str | None = Field(None, description="icl (with its transcript) or x-vector-only.")
    seconds: float | None = Field(None, description="The recording's length.")
    deleted: bool | None = None


MODELS = (SpeechBody, VoiceForm, ErrorBody, VoiceList, Voice)


def api_description(options: ServerOptions) -> dict:
    """The OpenAPI document of a server started with `options`."""
    schemas: dict = {}
    for model in MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    security = {"securitySchemes": {"key": {"type": "http", "scheme": "bearer"}}} if options.api_key else {}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rvqtts serve",
            "version": _version(),
            "description": "The OpenAI audio API over a Qwen3-TTS model (docs/server.md). Model: "
            f"{options.model_name}. Text in pieces over the WebSocket /v1/audio/speech/stream: docs/server.md.",
        },
        "paths": _paths(),
        "components": {"schemas": schemas, **security},
        **({"security": [{"key": []}]} if options.api_key else {}),
    }


def _paths() -> dict:
    audio = {media_type: {"schema": {"type": "string", "format": "binary"}} for media_type in RESPONSE_FORMATS.values()}
    audio["text/event-stream"] = {"schema": {"type": "string"}}
    open_route = {"security": []}  # answered without the key
    return {
        "/v1/audio/speech": {
            "post": {
                "summary": "Speak a text: the audio whole, streamed, or as server-sent events",
                "requestBody": {"required": True, "content": _json("SpeechBody")},
                "responses": {"200": {"description": "The audio", "content": audio}, **_errors(400, 413, 415, 503)},
            }
        },
        "/v1/audio/voices": {
            "get": {"summary": "The voices and languages", "responses": _ok("VoiceList")},
            "post": {
                "summary": "Upload a voice (a Base model with --voices)",
                "requestBody": {"required": True, "content": {"multipart/form-data": _schema("VoiceForm")}},
                "responses": {**_ok("Voice"), **_errors(400, 409, 413, 415)},
            },
        },
        "/v1/audio/voices/{name}": {
            "delete": {
                "summary": "Delete an uploaded voice",
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {**_ok("Voice"), **_errors(400, 404)},
            }
        },
        "/v1/models": {"get": {"summary": "The one model served", "responses": {"200": {"description": "A list"}}}},
        "/health": {
            "get": {"summary": "Counts, rows, memory", "responses": {"200": {"description": "ok"}}, **open_route}
        },
        "/ready": {
            "get": {
                "summary": "Whether requests are taken (a load balancer's health check)",
                "responses": {"200": {"description": "ready"}, **_errors(503)},
                **open_route,
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus's text format", "responses": {"200": {"description": "ok"}}, **open_route}
        },
    }


def _schema(name: str) -> dict:
    return {"schema": {"$ref": f"#/components/schemas/{name}"}}


def _json(name: str) -> dict:
    return {"application/json": _schema(name)}


def _ok(name: str) -> dict:
    return {"200": {"description": "OK", "content": _json(name)}}


def _errors(*statuses: int) -> dict:
    return {
        str(status): {"description": "Refused: error.message says why", "content": _json("ErrorBody")}
        for status in statuses
    }


def _version() -> str:
    try:
        return version("rvqtts")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "0.0.0"
