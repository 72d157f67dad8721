"""Text in pieces over a WebSocket (`/v1/audio/speech/stream`): an LLM's words as they come, each sentence spoken as
soon as it is whole, its audio sent back in order. docs/server.md, "Text in pieces"."""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from rvqtts.serving.engine import Job, SpeechEngine
from rvqtts.serving.errors import ReaderGone, SpeechError
from rvqtts.serving.request_parsing import json_value, parse_speech_request
from rvqtts.serving.speech_request import SpeechRequest
from rvqtts.serving.streams import next_piece, sent
from rvqtts.synthesis.text import chunk_text, complete_sentences

log = logging.getLogger("rvqtts.serving")

SESSION_SENTENCES_IN_ENGINE = 2  # a session's sentences in the engine at once (one speaking, the next ready)
MESSAGE_CHARS_PER_MAX_CHARS = 4  # a text message: at most 4 x --max-chars characters
UNSPOKEN_CHARS_PER_MAX_CHARS = 16  # a session's text not yet given to the engine: at most 16 x --max-chars


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
                while (item := await next_piece(job)) is not None:
                    await sent(self.behind, self.websocket.send_bytes(item))
                await self.websocket.send_json({"type": "sentence.done", "index": index})
            except SpeechError as error:
                await self._error(error, index=index)
            finally:
                self.in_engine.release()
        await self.websocket.send_json({"type": "done"})
