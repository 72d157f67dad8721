"""The server's engine: the model's one thread, running one frame loop over `--batch-size` rows that takes requests
from a bounded queue as rows free up, and hands each one's audio to the event loop through its Job."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from rvqtts.engine.loop.frame_loop import Stopped
from rvqtts.serving.accounting import Accounting, RequestClock
from rvqtts.serving.errors import FELL_BEHIND, ReaderGone, SpeechError, engine_stopped
from rvqtts.serving.options import ServerOptions
from rvqtts.serving.speech_request import SpeechRequest, encode
from rvqtts.serving.voices import VoiceStore, voice_files
from rvqtts.support.audio import pcm16, wav_header
from rvqtts.support.memory import memory_record
from rvqtts.synthesis.batch_size import fitting_slots
from rvqtts.synthesis.pipeline import speak
from rvqtts.synthesis.settings import Line, Synthesis

log = logging.getLogger("rvqtts.serving")

BUSY_RETRY_SECONDS = 0.05  # how often a session's next sentence retries a full queue


@dataclass
class Job:
    """A request in the engine: its output reaches the event loop through `items` (bytes, then None at the end,
    or the exception that ended it); `cancelled` stops it at the next frame. A stream's unread audio is counted on
    the event loop: past `unsent_limit` bytes the job is cancelled (its row freed; the engine never waits for a
    reader) and `behind` is set, which cuts its reader's connection. `figures`: a served request's own
    (rvqtts.serving.accounting.request_figures), set before its end is sent."""

    request: SpeechRequest
    loop: asyncio.AbstractEventLoop
    unsent_limit: int
    engine_alive: Callable[[], bool]
    behind: asyncio.Event = field(default_factory=asyncio.Event)
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    clock: RequestClock = field(default_factory=RequestClock)
    figures: dict | None = None
    unsent: int = 0  # bytes of streamed audio sent by the engine and not yet taken by the client (event loop only)

    def send(self, item: bytes | Exception | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the event loop has closed: nobody is listening
            self.cancelled.set()

    def _put(self, item: bytes | Exception | None) -> None:
        if isinstance(item, bytes) and self.request.stream:
            if self.behind.is_set():
                return  # cut: nobody will read it
            self.unsent += len(item)
            if self.unsent > self.unsent_limit:
                self.cancelled.set()
                self.behind.set()
                item = ReaderGone(FELL_BEHIND)
        self.items.put_nowait(item)

    def took(self, item: bytes) -> None:
        if self.request.stream:
            self.unsent -= len(item)


class SpeechEngine:
    """The model's one thread: one frame loop over `batch_size` rows (rvqtts.synthesis.pipeline.speak) that takes
    requests from a bounded queue in the order they came, each as soon as a row is free (at the next frame), streamed
    and whole alike, each with its own seed and sampling settings: they share the calls of both loops, and each one's
    audio is the one it gets alone where the kernels keep rows invariant (which `--batch-size auto` requires). A
    request leaves its row when it ends, or at the next frame when its client has gone."""

    def __init__(self, synth, options: ServerOptions):
        self.synth = synth
        self.options = options
        self._waiting: deque[Job] = deque()
        self._tasks: deque[tuple[Callable[[], object], Future]] = deque()  # run on the engine thread between frames
        self._speaking: dict[int, Job] = {}  # by index among the lines the loop took (touched by the engine only)
        self._taken = 0  # lines this run of the loop took: `speak`'s index of the next
        self._changed = threading.Condition()
        self._closing = False
        self.row_slots = fitting_slots(synth, options.batch_size)  # what one request's row may hold
        self.accounting = Accounting(self._rows)
        # voices uploaded over the API: a Base model's, kept in --voices
        folder = options.voices_dir
        self.voice_store = VoiceStore(folder, synth.tts, synth.cloned) if folder and synth.kind == "base" else None
        synth.codec.warm_up(options.pacing)  # the decoder's cold start out of the first request's first audio
        self._thread = threading.Thread(target=self._serve, name="rvqtts-engine", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self._speaking)

    @property
    def alive(self) -> bool:
        """The engine thread runs (it may be finishing its last requests)."""
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """The engine takes requests: its thread runs and the server is not stopping (GET /ready)."""
        return self._thread.is_alive() and not self._closing

    def voices(self) -> list[str]:
        """The `voice` values this model takes: its speakers, or (Base models) the voice files' names."""
        if self.synth.kind == "base":
            return sorted(voice_files(self.options.voices_dir))
        return list(self.synth.speakers)

    def submit(self, request: SpeechRequest, behind: asyncio.Event | None = None) -> Job:
        """The request queued for a row; SpeechError 503 where the queue is full (with when to retry) or the engine
        has stopped. `behind`: the event that cuts the reader of its stream (a session's, shared by its sentences)."""
        job = self._queued(request, behind)
        if job is None:
            self.accounting.ended("refused_busy")
            with self._changed:
                rounds = (len(self._waiting) + 1) / self.options.batch_size
            wait = self.accounting.retry_after(rounds)
            raise SpeechError(
                503,
                f"the server is busy ({self.options.queue_size} requests waiting): retry in {wait} s",
                code="server_busy",
                headers={"Retry-After": str(wait)},
            )
        return job

    async def submit_when_free(self, request: SpeechRequest, behind: asyncio.Event) -> Job:
        """The request queued once the queue has room: a WebSocket session's sentence waits its turn (backpressure)
        instead of being refused, so a session's text is never dropped."""
        while (job := self._queued(request, behind)) is None:
            await asyncio.sleep(BUSY_RETRY_SECONDS)
        return job

    def _queued(self, request: SpeechRequest, behind: asyncio.Event | None) -> Job | None:
        """The request's job, queued; None where the queue is full."""
        bytes_per_second = 2 * self.synth.sample_rate
        job = Job(
            request,
            asyncio.get_running_loop(),
            int(self.options.max_unsent_seconds * bytes_per_second),
            self._thread.is_alive,
            behind or asyncio.Event(),
        )
        with self._changed:
            if not self.ready:
                raise engine_stopped()
            if len(self._waiting) >= self.options.queue_size:
                return None
            self._waiting.append(job)
            self._changed.notify()
        return job

    def health(self) -> dict:
        """What GET /health shows: the rows and queue now, the requests counted, the memory held."""
        return {
            "status": "ok",
            "model": self.options.model_name,
            "busy": self.busy,
            "batch_size": self.options.batch_size,
            **self._rows(),
            **self.accounting.record(),
            **memory_record(),
            # what the engine keeps between requests and grows by use, inside rss_mib (the rest is the loaded model)
            "caches_mib": self.synth.cache_mib(),
        }

    def _rows(self) -> dict:
        with self._changed:
            return {"speaking": len(self._speaking), "queued": len(self._waiting), "rows": self.options.batch_size}

    def between_frames(self, task: Callable[[], object]) -> Future:
        """Run `task` on the engine thread between two frames (at once while it idles): the model's own thread, so
        that nothing else runs on its device meanwhile (a GPU's graph capture included). Its result or error comes
        through the future; SpeechError 503 where the engine has stopped."""
        future: Future = Future()
        with self._changed:
            if not self.ready:
                raise engine_stopped()
            self._tasks.append((task, future))
            self._changed.notify()
        return future

    def _run_tasks(self) -> None:
        while True:
            with self._changed:
                if not self._tasks:
                    return
                task, future = self._tasks.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(task())
                except Exception as error:  # the task's caller hears of it
                    future.set_exception(error)

    def _frame_ended(self, rows: int) -> None:
        """Once after each frame of the loop, on the engine thread: its rows' frames counted, and the tasks waiting
        for a frame's end run."""
        self.accounting.frames_made(rows)
        self._run_tasks()

    def close(self) -> None:
        """Stop the engine thread once the jobs queued before are done."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join()

    def _serve(self) -> None:
        """Speak requests until closed; a failure that stops every row (NaN or inf, a failing call) fails the
        requests in them, and the loop starts again for the next, numbering its lines from 0 as `speak` does."""
        while True:
            self._taken = 0
            try:
                for index, item in speak(
                    self.synth,
                    self._lines(),
                    self.options.chunk_chars,
                    self.options.batch_size,
                    stopped=self._stopped,
                    joins_per_frame=self.options.joins_per_frame or None,
                    between_frames=self._frame_ended,
                ):
                    self._answer(index, item)
                return
            except Exception as error:  # each client in a row hears of it
                # a string, not the error: a handler that keeps records must not keep its frames (the loop's tensors)
                log.error(
                    f"the frame loop failed ({type(error).__name__}: {error}): its {len(self._speaking)} requests fail"
                )
                for job in self._speaking.values():
                    self.accounting.ended("failed")
                    job.send(error)
                self._speaking.clear()

    def _lines(self) -> Iterator[Line | None]:
        """The frame loop's live source: the next waiting request's line, None while none waits and rows are at work,
        waiting while none is at work; it ends when the engine closes with nothing left to speak."""
        while True:
            self._run_tasks()
            with self._changed:
                while not (self._waiting or self._speaking or self._tasks):
                    if self._closing:
                        return
                    self._changed.wait()
                if self._tasks:
                    continue
                job = self._waiting.popleft() if self._waiting else None
            if job is None:
                yield None
            elif job.cancelled.is_set():  # its client left while it waited
                self.accounting.ended("cancelled")
            else:
                yield self._taking(job)

    def _taking(self, job: Job) -> Line:
        """A row takes `job`: it is timed from here and speaks in calls shared with the others in rows."""
        job.clock.started = time.perf_counter()
        with self._changed:
            self._speaking[self._taken] = job
        self._taken += 1
        if len(self._speaking) > 1:
            for speaking in self._speaking.values():
                speaking.clock.shared = True
        if job.request.stream and job.request.response_format == "wav":
            job.send(wav_header(self.synth.sample_rate))
        return job.request.line

    def _stopped(self, index: int) -> bool:
        return index not in self._speaking or self._speaking[index].cancelled.is_set()

    def _answer(self, index: int, item: np.ndarray | Synthesis | Exception) -> None:
        """Send a request its audio as it comes (streamed) or whole, or its failure; count it when it ends."""
        job = self._speaking[index]
        if isinstance(item, np.ndarray):
            if item.size and job.request.stream:
                job.clock.first_audio = job.clock.first_audio or time.perf_counter()
                job.send(pcm16(item))
            return
        with self._changed:
            del self._speaking[index]
        self.accounting.left_row(job.clock)
        if isinstance(item, Stopped):
            self.accounting.ended("cancelled")
        elif isinstance(item, Exception):
            self.accounting.ended("failed")
            job.send(item)
        else:
            if not job.request.stream:
                job.send(encode(item.audio, self.synth.sample_rate, job.request.response_format))
            job.figures = self.accounting.served(index, job.clock, item, job.request.stream)
            job.send(None)
