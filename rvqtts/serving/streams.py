"""A job's audio on its way to the client: taken from the engine piece by piece (no wait unbounded), sent as the
audio itself, as OpenAI's server-sent events, or whole; a client that does not read is let go, and a stream cut short
ends as a broken body, never as a clean but short one."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from concurrent.futures import Future
from typing import AsyncIterator, Awaitable, Callable, Coroutine

from starlette.requests import Request
from starlette.responses import StreamingResponse

from rvqtts.engine.model.sampling import NonFiniteError
from rvqtts.serving.engine import Job, SpeechEngine
from rvqtts.serving.errors import FELL_BEHIND, ReaderGone, SpeechError, engine_stopped

log = logging.getLogger("rvqtts.serving")

POLL_SECONDS = 0.5  # how often a wait on the engine checks that the engine thread lives and the client is there
STALLED_READER_SECONDS = 30.0  # a client that takes none of its audio this long is gone (a player reads every second)


class CutStream(StreamingResponse):
    """A streamed response that ends as an error where its audio is cut short (the synthesis failed, the reader fell
    more than --max-unsent-seconds behind or took nothing for STALLED_READER_SECONDS): it returns without HTTP's
    final chunk, so the connection is closed and the client sees a broken body, never a clean but short one. However
    it ends, its job is cancelled, which frees its row at the next frame."""

    def __init__(self, job: Job, pieces: AsyncIterator[bytes], media_type: str, headers: dict | None = None):
        super().__init__(pieces, media_type=media_type, headers=headers)
        self.job = job

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(lambda message: sent(self.job.behind, send(message)))
        except ReaderGone as error:
            log.warning("a streamed request's connection is closed: %s", str(error))
        except SpeechError as error:
            log.error("a streamed request ended early: %s", error.message)
        finally:
            self.job.cancelled.set()


async def sent(behind: asyncio.Event, sending: Coroutine) -> None:
    """`sending` (a message to a client) awaited, unless the client falls behind or takes nothing for
    STALLED_READER_SECONDS first: ReaderGone. The engine never waits for a client; this is where a client that does
    not read is let go."""
    if behind.is_set():
        sending.close()
        raise ReaderGone(FELL_BEHIND)
    done, cut = asyncio.ensure_future(sending), asyncio.ensure_future(behind.wait())
    try:
        await asyncio.wait({done, cut}, timeout=STALLED_READER_SECONDS, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut.cancel()
        if not done.done():
            done.cancel()
    if not done.done() or done.cancelled():
        raise ReaderGone(
            FELL_BEHIND if behind.is_set() else f"it took none of its audio for {STALLED_READER_SECONDS:g} s"
        )
    done.result()


async def next_piece(job: Job, client_gone: Callable[[], Awaitable[bool]] | None = None) -> bytes | None:
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


async def audio_pieces(job: Job) -> AsyncIterator[bytes]:
    """A streamed body: each piece as the engine makes it (a failure raised: CutStream cuts the body)."""
    while (item := await next_piece(job)) is not None:
        yield item


async def audio_events(job: Job) -> AsyncIterator[bytes]:
    """A streamed body as OpenAI's server-sent events: a `speech.audio.delta` event per piece (its bytes in base64),
    then `speech.audio.done` with the request's figures (`stats`), or an `error` event where the synthesis failed
    after the status was sent."""

    def event(data: dict) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    try:
        while (item := await next_piece(job)) is not None:
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(item).decode()})
        yield event({"type": "speech.audio.done", "stats": job.figures})
    except SpeechError as error:
        yield event({"type": "error", **error.body()})


async def whole_audio(job: Job, request: Request) -> bytes:
    """A whole body; a client that goes away while it is made cancels the job."""
    parts: list[bytes] = []
    try:
        while (item := await next_piece(job, request.is_disconnected)) is not None:
            parts.append(item)
        return b"".join(parts)
    except asyncio.CancelledError:  # the server is stopping
        job.cancelled.set()
        raise
