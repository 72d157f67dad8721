"""Wyoming (Home Assistant's protocol for local speech engines), beside HTTP on the same engine and rows:
`rvqtts serve --wyoming-port N`. `describe` is answered with the model's voices and languages; `synthesize` streams
`audio-start`, an `audio-chunk` per piece as frames are made, and `audio-stop`; streamed text (`synthesize-start`,
`-chunk`s, `-stop`) is spoken sentence by sentence as the WebSocket speaks it. A client that disconnects frees its
rows. Wyoming has no key: the port is bound to --host. docs/server.md, "Home Assistant (Wyoming)"."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.server import AsyncEventHandler, AsyncTcpServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from rvqtts.serving.engine import Job, SpeechEngine
from rvqtts.serving.errors import ReaderGone, SpeechError
from rvqtts.serving.request_parsing import parse_speech_request
from rvqtts.serving.sentences import SpokenSentences
from rvqtts.serving.streams import next_piece, sent

log = logging.getLogger("rvqtts.serving")

# Qwen3-TTS's languages by the codes Home Assistant names languages with
LANGUAGE_CODES = {
    "chinese": "zh", "english": "en", "japanese": "ja", "korean": "ko", "german": "de", "french": "fr",
    "russian": "ru", "portuguese": "pt", "spanish": "es", "italian": "it",
}  # fmt: skip
ATTRIBUTION = Attribution(name="rvqtts (Qwen3-TTS)", url="https://github.com/QwenLM/Qwen3-TTS")


def info(engine: SpeechEngine) -> Info:
    """`describe`'s answer: one program whose voices are the model's (speakers, or a Base model's voice files)."""
    codes = [LANGUAGE_CODES[name] for name in engine.synth.languages if name in LANGUAGE_CODES]
    voices = [
        TtsVoice(name=name, attribution=ATTRIBUTION, installed=True, description=name, version=None, languages=codes)
        for name in engine.voices()
    ]
    program = TtsProgram(
        name="rvqtts",
        attribution=ATTRIBUTION,
        installed=True,
        description=f"Qwen3-TTS {engine.options.model_name}",
        version=None,
        voices=voices,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program])


def request_fields(voice: SynthesizeVoice | None, engine: SpeechEngine) -> dict:
    """A Wyoming voice as a speech request's fields: its name (else the first voice) and its language (a code such
    as en or en-US, else auto)."""
    voices = engine.voices()
    name = voice.name if voice and voice.name else (voices[0] if voices else None)
    code = (voice.language or "").replace("_", "-").split("-")[0].lower() if voice else ""
    language = next((language for language, known in LANGUAGE_CODES.items() if known == code), "auto")
    return {"voice": name, "language": language}


class WyomingHandler(AsyncEventHandler):
    """One Wyoming client's connection, speaking one request at a time. Speaking runs as a task beside the reading,
    so that a client gone is seen at once (its rows freed), whatever is being spoken."""

    def __init__(self, engine: SpeechEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__(reader, writer)
        self.engine = engine
        self.behind = asyncio.Event()
        self.sentences: SpokenSentences | None = None  # streamed text, between synthesize-start and its end
        self.speaking: asyncio.Task | None = None
        self.job: Job | None = None  # a `synthesize`'s request in the engine

    async def handle_event(self, event: Event) -> bool:
        try:
            await self._handle(event)
        except SpeechError as error:
            await self._error(error)
        return True

    async def _error(self, error: SpeechError) -> None:
        await self.write_event(Error(text=error.message, code=error.code or str(error.status)).event())

    async def _handle(self, event: Event) -> None:
        if Describe.is_type(event.type):
            await self.write_event(info(self.engine).event())
        elif Synthesize.is_type(event.type) and self.sentences is None:  # while streaming: sent for old clients only
            request = Synthesize.from_event(event)
            self._speak(self._speak_whole(request.text, request_fields(request.voice, self.engine)))
        elif SynthesizeStart.is_type(event.type):
            sentences = SpokenSentences(self.engine, self.behind)
            sentences.use(request_fields(SynthesizeStart.from_event(event).voice, self.engine))
            self._speak(self._speak_sentences(sentences))
            self.sentences = sentences
        elif SynthesizeChunk.is_type(event.type) and self.sentences is not None:
            self.sentences.add(SynthesizeChunk.from_event(event).text)
        elif SynthesizeStop.is_type(event.type) and self.sentences is not None:
            self.sentences.end()

    def _speak(self, work) -> None:
        """Speak `work` as a task; SpeechError 409 while the connection speaks another request."""
        if self.speaking is not None and not self.speaking.done():
            work.close()
            raise SpeechError(
                409, "this connection is speaking: send the next request after its audio-stop", code="busy"
            )
        self.speaking = asyncio.create_task(self._reported(work))

    async def _reported(self, work) -> None:
        """A task's failure told to the client as Wyoming's error event (the connection stays)."""
        try:
            await work
        except SpeechError as error:
            await self._error(error)
        except (ReaderGone, ConnectionError) as error:
            log.warning("a Wyoming client is let go: %s", error)
            self.writer.close()

    async def _speak_whole(self, text: str, fields: dict) -> None:
        """`synthesize`: the text as one streamed request, as `POST /v1/audio/speech` with `stream` speaks it."""
        body = {**fields, "input": text, "stream": True, "response_format": "pcm"}
        self.job = self.engine.submit(parse_speech_request(body, self.engine), self.behind)
        await self._audio_start()
        await self._audio(self.job)
        await self.write_event(AudioStop().event())

    async def _speak_sentences(self, sentences: SpokenSentences) -> None:
        """Streamed text: one audio stream of its sentences in order, then `synthesize-stopped`; a sentence refused
        or failed ends it (the rest are not spoken)."""
        giving = asyncio.create_task(sentences.give())
        try:
            await self._audio_start()
            async for _, _, job in sentences.in_order():
                if isinstance(job, SpeechError):
                    raise job
                await self._audio(job)
            await self.write_event(AudioStop().event())
            await self.write_event(SynthesizeStopped().event())
        finally:
            giving.cancel()  # no sentence is given to the engine after this
            sentences.cancel()
            if self.sentences is sentences:
                self.sentences = None

    async def _audio_start(self) -> None:
        rate = self.engine.synth.sample_rate
        await self.write_event(AudioStart(rate=rate, width=2, channels=1).event())

    async def _audio(self, job: Job) -> None:
        rate = self.engine.synth.sample_rate
        while (piece := await next_piece(job)) is not None:
            chunk = AudioChunk(rate=rate, width=2, channels=1, audio=piece)
            await sent(self.behind, self.write_event(chunk.event()))

    async def disconnect(self) -> None:
        """The client has gone: its request leaves its rows at the next frame."""
        if self.speaking is not None:
            self.speaking.cancel()
        if self.job is not None:
            self.job.cancelled.set()
        if self.sentences is not None:
            self.sentences.cancel()


async def start_wyoming(engine: SpeechEngine, host: str, port: int) -> AsyncTcpServer:
    """The Wyoming server, listening on host:port in the running event loop (the HTTP server's)."""
    server = AsyncTcpServer(host, port)
    await server.start(partial(WyomingHandler, engine))
    return server
