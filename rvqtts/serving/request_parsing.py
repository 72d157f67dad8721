"""What a client sends, read and checked: a speech request's JSON body (also a WebSocket session's fields) and an
uploaded voice's form. Their fields, types, ranges and descriptions are declared once, as pydantic models: the
parser validates against them and /openapi.json (rvqtts.serving.api_description) is made from them. A refusal says,
in the client's terms, which field was wrong and what to send."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from rvqtts.engine.model.sampling import MAX_TEMPERATURE
from rvqtts.qwen.cloning import VoiceSource
from rvqtts.serving.engine import SpeechEngine
from rvqtts.serving.errors import SpeechError
from rvqtts.serving.guards import MAX_BODY_BYTES, check_origin, is_json, limited_body
from rvqtts.serving.options import ServerOptions
from rvqtts.serving.speech_request import RESPONSE_FORMATS, STREAMED_FORMATS, SpeechRequest
from rvqtts.serving.voices import MAX_UPLOAD_BYTES, NAME, voice_files
from rvqtts.support.stretch import MAX_SPEED, MIN_SPEED
from rvqtts.synthesis.pipeline import row_slots
from rvqtts.synthesis.settings import REPETITION_PENALTY_RANGE, GenerationSettings, Line

SAMPLING_FIELDS = tuple(GenerationSettings.__dataclass_fields__)  # taken from the body as they are named there
KINDS = {"voice": 'a name, or {"id": NAME}', "audio_sample": "the recording's file (a .wav, .flac or .ogg)"}
CHECKED = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")  # JSON's own types; unknown fields ignored


class VoiceId(BaseModel):
    """OpenAI's custom voice: {"id": NAME}."""

    model_config = CHECKED
    id: str


class SpeechBody(BaseModel):
    """POST /v1/audio/speech: OpenAI's fields and rvqtts's (docs/server.md, "The request")."""

    model_config = CHECKED
    input: str = Field(description="The text to speak, at most --max-chars characters (413 past it).")
    voice: str | VoiceId | None = Field(
        None,
        description="A CustomVoice model's speaker (any case), or a Base model's voice file name in --voices; "
        "a VoiceDesign model is voiced by `instructions`. GET /v1/audio/voices lists them.",
    )
    model: str | None = Field(None, description="Accepted, whatever it names: the server has one model.")
    response_format: Literal[tuple(RESPONSE_FORMATS)] = Field(
        "wav", description=f"The audio's format; only {' and '.join(STREAMED_FORMATS)} stream."
    )
    stream: bool | None = Field(None, description="Send the audio as it is made (default: true with stream_format).")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="`audio`: the audio itself; `sse`: OpenAI's server-sent events, the last with the figures."
    )
    instructions: str | None = Field(None, description="A style instruction, or a VoiceDesign model's voice.")
    instruct: str | None = Field(None, description="`instructions` under qwen-tts's name.")
    language: str = Field("auto", description="As `rvqtts synth --language`: auto, english, chinese, ...")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="The noise's seed: the same seed, the same audio.")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="Both loops' (0: greedy).")
    top_k: int | None = Field(None, ge=0, description="Both loops' (0: off).")
    top_p: float | None = Field(None, gt=0, le=1, description="Both loops'.")
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1], description="The talker's."
    )
    max_frames: int | None = Field(None, ge=1, description="Each text chunk's frames at most (80 ms each).")
    predictor_temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="The code predictor's.")
    predictor_top_k: int | None = Field(None, ge=0, description="The code predictor's.")
    predictor_top_p: float | None = Field(None, gt=0, le=1, description="The code predictor's.")
    speed: float | None = Field(None, ge=MIN_SPEED, le=MAX_SPEED, description="Played that many times faster.")


class VoiceForm(BaseModel):
    """POST /v1/audio/voices, as multipart/form-data (docs/server.md, "Voices")."""

    model_config = CHECKED
    name: str = Field(
        pattern=f"^{NAME.pattern}$", description="1 to 64 letters, digits, '_' or '-', starting with either."
    )
    audio_sample: bytes = Field(
        json_schema_extra={"format": "binary"},
        description=f"The recording's file: .wav, .flac or .ogg, at most {MAX_UPLOAD_BYTES} bytes, 60 s.",
    )
    ref_text: str | None = Field(None, description="Its transcript; without it the voice is cloned from the audio.")


def parse_speech_request(body: object, engine: SpeechEngine) -> SpeechRequest:
    """The request in `body` (JSON), checked as `rvqtts synth` checks its options; SpeechError saying what
    to send otherwise."""
    synth, options = engine.synth, engine.options
    if not isinstance(body, dict):
        raise SpeechError(400, "the body must be a JSON object with at least `input` and `voice`")
    fields = validated(SpeechBody, body)
    if not fields.input.strip():
        raise SpeechError(400, "`input` is empty: give the text to speak", "input")
    within_max_chars(options, "input", fields.input)
    instruct = within_max_chars(options, "instructions", fields.instruct or fields.instructions)
    stream = _streamed(fields)
    settings = _settings(fields, synth.default_max_frames)
    speaker, voice_file = _voice(fields.voice, engine)
    try:
        line = Line(
            text=fields.input,
            speaker=speaker,
            language=fields.language,
            instruct=instruct,
            clone=voice_file and VoiceSource(voice=voice_file),
            utterance=0,
            seed=fields.seed,
            settings=settings,
            stream=options.pacing if stream else None,
        )
        line = synth.voiced(line)  # a voice file read once
    except (ValueError, TypeError) as error:  # VoiceError included
        raise SpeechError(400, str(error)) from None
    _check_row(engine, line)
    return SpeechRequest(line, fields.response_format, fields.stream_format == "sse")


def validated(model: type[BaseModel], values: dict) -> BaseModel:
    """`values` as `model`; SpeechError 400 naming the first field that is wrong and what it takes."""
    try:
        return model.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else None
        raise SpeechError(400, refusal(model, name, first), name) from None


def refusal(model: type[BaseModel], name: str | None, error: dict) -> str:
    """A validation error in the client's terms, from the field's declaration."""
    kind, given = error["type"], error.get("input")
    field = model.model_fields.get(name)
    if kind == "missing":
        return f"`{name}` is missing: {field.description}"
    if kind == "literal_error":
        return f"{name} {given!r} is not one rvqtts takes: choose {error['ctx']['expected']}"
    if kind in ("int_type", "int_from_float"):
        return f"`{name}` must be a whole number"
    if kind == "float_type":
        return f"`{name}` must be a number"
    if kind == "finite_number":
        return f"`{name}` must be a finite number"
    if kind == "bool_type":
        return f"`{name}` must be true or false"
    if kind in ("string_type", "model_type", "model_attributes_type", "bytes_type"):
        return f"`{name}` must be {KINDS.get(name, 'text')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"`{name}` must be {value_range(field)}, got {given}"
    return f"`{name}` {given!r}: {field.description if field else error['msg']}"


def value_range(field) -> str:
    """A numeric field's range in words, from its declared bounds."""
    bounds = {type(rule).__name__.lower(): rule for rule in field.metadata}
    low = f"at least {bounds['ge'].ge}" if "ge" in bounds else f"more than {bounds['gt'].gt}" if "gt" in bounds else ""
    high = f"at most {bounds['le'].le}" if "le" in bounds else ""
    return " and ".join(part for part in (low, high) if part)


def within_max_chars(options: ServerOptions, name: str, value: str | None) -> str | None:
    if value is not None and len(value) > options.max_chars:
        raise SpeechError(
            413,
            f"`{name}` has {len(value)} characters, more than this server's {options.max_chars} (--max-chars): "
            "send it in parts",
            name,
            "input_too_long",
        )
    return value


def _streamed(fields: SpeechBody) -> bool:
    """Whether the request streams, its fields agreeing."""
    stream = fields.stream if fields.stream is not None else fields.stream_format is not None
    if fields.stream_format and not stream:
        raise SpeechError(400, f"stream_format {fields.stream_format} streams: leave `stream` out or true", "stream")
    if stream and fields.response_format not in STREAMED_FORMATS:
        raise SpeechError(
            400, f"{fields.response_format} is not streamed here: ask for wav or pcm to stream", "response_format"
        )
    return stream


def _settings(fields: SpeechBody, max_frames: int) -> GenerationSettings:
    """The request's sampling settings; `max_frames` at most the model's limit."""
    if fields.max_frames is not None and fields.max_frames > max_frames:
        raise SpeechError(
            400, f"max_frames {fields.max_frames} is over this model's limit of {max_frames} frames", "max_frames"
        )
    try:
        return GenerationSettings(**{name: getattr(fields, name) for name in SAMPLING_FIELDS})
    except ValueError as error:
        raise SpeechError(400, str(error)) from None


def _voice(value: str | VoiceId | None, engine: SpeechEngine) -> tuple[str | None, object]:
    """(speaker, voice file) for a request's `voice`: a built-in speaker (any case) on a CustomVoice model, a
    voice file's name from --voices on a Base model; a VoiceDesign model is voiced by `instructions` alone."""
    name = value.id if isinstance(value, VoiceId) else value
    kind, folder = engine.synth.kind, engine.options.voices_dir
    if kind == "voice_design":
        return None, None
    if kind == "base":
        files = voice_files(folder)
        if name in files:
            return None, files[name]
        where = (
            f"the voice files in {folder}: {', '.join(files) or 'none yet'}"
            if folder
            else "none: start the server with --voices DIR (voice files from rvqtts synth --save-voice)"
        )
        raise SpeechError(400, f"voice {name!r} is not served; this Base model's voices are {where}", "voice")
    available = engine.voices()
    if name is None or name.lower() not in available:
        raise SpeechError(
            400, f"voice {name!r} is not one of this model's speakers: choose {', '.join(available)}", "voice"
        )
    return name.lower(), None


def _check_row(engine: SpeechEngine, line: Line) -> None:
    """SpeechError 400 where the line would hold more cache positions than a row may."""
    slots = row_slots(engine.synth, line, engine.options.chunk_chars)
    if slots > engine.row_slots:
        raise SpeechError(
            400,
            f"this input with max_frames {line.settings.max_frames} would hold {slots} cache positions in its row, "
            f"more than the {engine.row_slots} each of this server's {engine.options.batch_size} rows may hold in its "
            "memory: ask for fewer max_frames or send the input in parts",
            "max_frames",
        )


def json_value(data: bytes | str) -> object:
    """`data` parsed as JSON; ValueError for anything that is not, nesting too deep for Python included."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


async def json_body(request: Request) -> object:
    """The request's JSON body, at most MAX_BODY_BYTES; SpeechError 415, 413 or 400 saying what to send instead."""
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


async def voice_form(request: Request, options: ServerOptions) -> tuple[VoiceForm, str]:
    """An uploaded voice's form (multipart/form-data, as vllm-omni takes it: VoiceForm) and its file's name;
    SpeechError saying what to send otherwise. A form is what a page of another site may post without asking, so one
    whose Origin is not served is refused."""
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
        sample = form.get("audio_sample")
        fields = {name: form.get(name) for name in ("name", "ref_text") if form.get(name) is not None}
        filename = sample.filename if isinstance(sample, UploadFile) else None
        fields["audio_sample"] = await sample.read() if isinstance(sample, UploadFile) else sample
    finally:
        await form.close()
    if fields["audio_sample"] is not None and len(fields["audio_sample"]) > MAX_UPLOAD_BYTES:
        raise SpeechError(413, f"the recording is over {MAX_UPLOAD_BYTES} bytes", "audio_sample", "request_too_large")
    checked = validated(VoiceForm, {name: value for name, value in fields.items() if value is not None})
    within_max_chars(options, "ref_text", checked.ref_text)  # spoken before every request's text, in ICL mode
    return checked, filename or "the recording"
