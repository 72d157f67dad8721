"""Text in pieces over a WebSocket (`/v1/audio/speech/stream`): an LLM's words as they come, each sentence spoken as
soon as it is whole, its audio sent back in order. docs/server.md, "Text in pieces"."""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from rvqtts.serving.engine import SpeechEngine
from rvqtts.serving.errors import ReaderGone, SpeechError
from rvqtts.serving.request_parsing import json_value
from rvqtts.serving.sentences import SpokenSentences
from rvqtts.serving.streams import next_piece, sent

log = logging.getLogger("rvqtts.serving")

MESSAGE_CHARS_PER_MAX_CHARS = 4  # a text message: at most 4 x --max-chars characters
MESSAGES = 'send JSON messages: {"type": "session", ...fields}, {"type": "text", "text": ...}, {"type": "flush"} or '
MESSAGES += '{"type": "done"}'


class TextSession:
    """A WebSocket session that takes text in pieces and speaks each sentence as soon as it is whole
    (SpokenSentences), with the session's fields; the audio goes back in order, each sentence's between a `sentence`
    and a `sentence.done` event. What it holds is bounded (a message, its unspoken text)."""

    def __init__(self, websocket: WebSocket, engine: SpeechEngine):
        self.websocket = websocket
        self.sentences = SpokenSentences(engine, asyncio.Event())
        self.message_limit = MESSAGE_CHARS_PER_MAX_CHARS * engine.options.max_chars

    async def run(self) -> None:
        """Receive until `done`, then close once every sentence's audio is sent; a client gone (or cut for not
        reading) frees the rows of its sentences."""
        tasks = [asyncio.create_task(work()) for work in (self._receive, self.sentences.give, self._send)]
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
            self.sentences.cancel()

    async def _error(self, error: SpeechError, **extra) -> None:
        await self.websocket.send_json({"type": "error", **extra, **error.body()})

    async def _receive(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            try:
                if self._take(message.get("text")):
                    return
            except SpeechError as error:
                await self._error(error)

    def _take(self, text: str | None) -> bool:
        """One message taken (SpeechError where it is refused); True at `done`."""
        if text is not None and len(text) > self.message_limit:
            raise SpeechError(
                413,
                f"a message of {len(text)} characters is more than this server takes at once ({self.message_limit}): "
                "send the text in smaller pieces",
                code="message_too_long",
            )
        try:
            event = json_value(text) if text is not None else None
        except ValueError:
            event = None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "session":
            self.sentences.use({name: value for name, value in event.items() if name != "type"})
        elif kind == "text" and isinstance(event.get("text"), str):
            self.sentences.add(event["text"], wait_for="sentence.done events")
        elif kind == "flush":
            self.sentences.flush()
        elif kind == "done":
            self.sentences.end()
            return True
        else:
            raise SpeechError(400, MESSAGES)
        return False

    async def _send(self) -> None:
        """The session's audio in the order its sentences came: an `error` event for one refused or failed."""
        async for index, text, job in self.sentences.in_order():
            try:
                if isinstance(job, SpeechError):
                    raise job
                await self.websocket.send_json({"type": "sentence", "index": index, "text": text})
                while (item := await next_piece(job)) is not None:
                    await sent(self.sentences.behind, self.websocket.send_bytes(item))
                await self.websocket.send_json({"type": "sentence.done", "index": index})
            except SpeechError as error:
                await self._error(error, index=index)
        await self.websocket.send_json({"type": "done"})
