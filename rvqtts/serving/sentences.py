"""Text taken in pieces (an LLM's words as they come) and spoken sentence by sentence, in order, whatever carries
it: the WebSocket session (rvqtts.serving.text_session) and Wyoming's streamed text (rvqtts.serving.wyoming_server)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from rvqtts.serving.engine import Job, SpeechEngine
from rvqtts.serving.errors import SpeechError
from rvqtts.serving.request_parsing import parse_speech_request
from rvqtts.serving.speech_request import SpeechRequest
from rvqtts.synthesis.text import chunk_text, complete_sentences

SENTENCES_IN_ENGINE = 2  # a text's sentences in the engine at once (one speaking, the next ready)
UNSPOKEN_CHARS_PER_MAX_CHARS = 16  # text taken and not yet given to the engine: at most 16 x --max-chars


class SpokenSentences:
    """Each sentence spoken as soon as it is whole (or cut at --max-chars where no end is in sight), as a streamed PCM
    request with the fields in force when it was taken. No text is dropped: SENTENCES_IN_ENGINE are in the engine and
    the rest kept here, in order, each waiting its turn where the engine's queue is full; the text kept is bounded.
    `give` runs as a task; `in_order` gives each sentence's job (or why it was refused) in the order taken."""

    def __init__(self, engine: SpeechEngine, behind: asyncio.Event):
        self.engine, self.behind = engine, behind  # `behind`: set where the reader falls behind a sentence's audio
        self.fields: dict = {}
        self.written = ""  # text after the last whole sentence
        self.unspoken = 0  # characters taken and not yet given to the engine, `written` included
        self.taken = 0  # sentences taken, numbered from 0
        self.waiting: asyncio.Queue = asyncio.Queue()  # (index, text, fields) to give the engine, None at the end
        self.spoken: asyncio.Queue = asyncio.Queue()  # (index, text, its job or why it was refused), None at the end
        self.in_engine = asyncio.Semaphore(SENTENCES_IN_ENGINE)
        self.jobs: list[Job] = []
        self.unspoken_limit = UNSPOKEN_CHARS_PER_MAX_CHARS * engine.options.max_chars

    def request(self, fields: dict, text: str) -> SpeechRequest:
        """A sentence's request, checked (SpeechError saying what is wrong)."""
        return parse_speech_request({**fields, "input": text, "stream": True, "response_format": "pcm"}, self.engine)

    def use(self, fields: dict) -> None:
        """The request fields of the sentences taken from now on, checked first (SpeechError, the fields unchanged)."""
        self.request(fields, "Checked.")
        self.fields = fields

    def add(self, text: str, wait_for: str = "the audio already sent") -> None:
        """Text added: its whole sentences taken; SpeechError 413 where too much is unspoken (`wait_for`: what the
        client should wait for before sending more)."""
        if self.unspoken + len(text) > self.unspoken_limit:
            raise SpeechError(
                413,
                f"this session holds {self.unspoken} characters not yet spoken; {len(text)} more would be over its "
                f"{self.unspoken_limit}: wait for {wait_for} before sending more text",
                code="session_text_too_long",
            )
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

    def flush(self) -> None:
        """The text after the last whole sentence taken as one."""
        self.unspoken -= len(self.written)
        self._take(self.written)
        self.written = ""

    def end(self) -> None:
        """No more text: what is left is spoken, then `in_order` ends."""
        self.flush()
        self.waiting.put_nowait(None)

    def _take(self, text: str) -> None:
        """Whole sentences of text in order, each cut to --max-chars where it is longer."""
        for piece in chunk_text(text, self.engine.options.max_chars):
            self.unspoken += len(piece)
            self.waiting.put_nowait((self.taken, piece, self.fields))
            self.taken += 1

    async def give(self) -> None:
        """The sentences to the engine in order, SENTENCES_IN_ENGINE at a time, each waiting for room."""
        while (entry := await self.waiting.get()) is not None:
            index, text, fields = entry
            await self.in_engine.acquire()
            self.unspoken -= len(text)
            try:
                outcome = await self.engine.submit_when_free(self.request(fields, text), self.behind)
                self.jobs.append(outcome)
            except SpeechError as error:
                outcome = error
            self.spoken.put_nowait((index, text, outcome))
        self.spoken.put_nowait(None)

    async def in_order(self) -> AsyncIterator[tuple[int, str, Job | SpeechError]]:
        """(index, text, job or refusal) of each sentence in the order taken; the next is given to the engine once the
        caller is done with one."""
        while (entry := await self.spoken.get()) is not None:
            try:
                yield entry
            finally:
                self.in_engine.release()

    def cancel(self) -> None:
        """Free the rows of every sentence (the client has gone)."""
        for job in self.jobs:
            job.cancelled.set()
