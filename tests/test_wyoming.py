"""Wyoming (Home Assistant's protocol) through the `wyoming` package's own client, against a server with Wyoming
beside HTTP (`rvqtts serve --wyoming-port`) on the tiny checkpoint: describe names the voices and languages;
synthesize streams audio-start, chunks and audio-stop whose PCM is the HTTP streamed response's for the same request;
streamed text is spoken sentence by sentence as the WebSocket speaks it; a bad voice gets an error event and the
connection goes on; a client gone mid-stream frees its row."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import free_port, running, wait_until
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from rvqtts.synthesis.text import complete_sentences

pytestmark = pytest.mark.timeout(300)
WAIT = 60  # seconds any one wait may take
VOICE = SynthesizeVoice(name="vivian", language="en-US")
PIECES = ["Hello there. How", " are you? I am", " fine"]  # an LLM's words as they come


@pytest.fixture(scope="module")
def wyoming_server(tiny_dir):
    port = free_port()
    with running(tiny_dir, wyoming_address=("127.0.0.1", port)) as (url, _):
        yield url, port


async def exchange(port: int, *events, until: str, stop_after: int | None = None) -> list:
    """Send `events`, then read events until one of type `until` (or, with `stop_after`, disconnect after that many
    audio chunks); the events read."""
    client = AsyncTcpClient("127.0.0.1", port, connect_timeout=WAIT, read_timeout=WAIT)
    await client.connect()
    read, chunks = [], 0
    try:
        for event in events:
            await client.write_event(event.event())
        while (event := await client.read_event()) is not None:
            read.append(event)
            chunks += AudioChunk.is_type(event.type)
            if event.type in (until, "error") or chunks == stop_after:
                break
    finally:
        await client.disconnect()
    return read


def pcm_of(events: list) -> bytes:
    """The PCM of one audio stream: audio-start (24 kHz, 16-bit, mono), its chunks, audio-stop."""
    start, *chunks, stop = events
    assert AudioStart.is_type(start.type) and AudioStop.is_type(stop.type), [e.type for e in events]
    assert (AudioStart.from_event(start).rate, AudioStart.from_event(start).width) == (24000, 2)
    assert all(AudioChunk.is_type(chunk.type) for chunk in chunks)
    return b"".join(AudioChunk.from_event(chunk).audio for chunk in chunks)


def http_pcm(url: str, text: str) -> bytes:
    body = {"input": text, "voice": "vivian", "language": "english", "stream": True, "response_format": "pcm"}
    response = httpx.post(url + "/v1/audio/speech", json=body, timeout=WAIT)
    assert response.status_code == 200, response.text
    return response.content


def test_describe_names_the_voices_and_languages(wyoming_server):
    _, port = wyoming_server
    (answer,) = asyncio.run(exchange(port, Describe(), until="info"))
    program = Info.from_event(answer).tts[0]
    assert program.supports_synthesize_streaming and "vivian" in [voice.name for voice in program.voices]
    assert {"en", "zh"} <= set(program.voices[0].languages)


def test_synthesize_streams_the_http_responses_audio(wyoming_server):
    url, port = wyoming_server
    text = "Hello there, spoken for Home Assistant."
    events = asyncio.run(exchange(port, Synthesize(text=text, voice=VOICE), until="audio-stop"))
    assert len([e for e in events if AudioChunk.is_type(e.type)]) >= 2  # pieces as frames are made
    assert pcm_of(events) == http_pcm(url, text)


def test_streamed_text_is_spoken_sentence_by_sentence(wyoming_server):
    url, port = wyoming_server
    events = [SynthesizeStart(voice=VOICE), *(SynthesizeChunk(text=piece) for piece in PIECES)]
    events += [Synthesize(text="".join(PIECES), voice=VOICE), SynthesizeStop()]  # the first for servers that do not
    # stream text (Home Assistant sends both): ignored while streaming
    read = asyncio.run(exchange(port, *events, until="synthesize-stopped"))
    assert SynthesizeStopped.is_type(read[-1].type) and AudioStop.is_type(read[-2].type)
    whole, rest = complete_sentences("".join(PIECES))
    assert pcm_of(read[:-1]) == b"".join(http_pcm(url, sentence) for sentence in [*whole, rest])


async def refused_then_spoken(port: int) -> tuple[list, list]:
    """On one connection: streamed text in a voice the model lacks, then a synthesize in one it has."""
    client = AsyncTcpClient("127.0.0.1", port, connect_timeout=WAIT, read_timeout=WAIT)
    await client.connect()
    phases: tuple[list, list] = ([], [])
    try:
        for phase, events, until in (
            (
                0,
                [SynthesizeStart(voice=SynthesizeVoice(name="alloy")), SynthesizeChunk(text="Hi. "), SynthesizeStop()],
                "error",
            ),
            (1, [Synthesize(text="Hi.", voice=VOICE)], "audio-stop"),
        ):
            for event in events:
                await client.write_event(event.event())
            while (event := await client.read_event()) is not None:
                phases[phase].append(event)
                if event.type == until:
                    break
    finally:
        await client.disconnect()
    return phases


def test_a_bad_voice_is_an_error_event_and_a_client_gone_frees_its_row(wyoming_server):
    url, port = wyoming_server
    (error,) = asyncio.run(exchange(port, Synthesize(text="Hi.", voice=SynthesizeVoice(name="alloy")), until="error"))
    assert "not one of this model's speakers" in Error.from_event(error).text
    refused, spoken = asyncio.run(refused_then_spoken(port))  # the connection goes on after a refusal
    assert [event.type for event in refused] == ["error"] and pcm_of(spoken) == http_pcm(url, "Hi.")
    cancelled = httpx.get(url + "/health").json()["cancelled"]
    long = Synthesize(text="A long sentence that the client will not wait for. " * 4, voice=VOICE)
    read = asyncio.run(exchange(port, long, until="audio-stop", stop_after=1))
    assert not AudioStop.is_type(read[-1].type)  # left after its first piece
    wait_until(lambda: httpx.get(url + "/health").json()["cancelled"] == cancelled + 1, WAIT, "the row to be freed")
    assert httpx.get(url + "/health").json()["speaking"] == 0
