"""Request accounting in one place: how each request ended, the parts of streamed requests' first audio, how long a
request holds a row (a busy server's Retry-After), frames made, and each served request's own figures. The engine
thread writes it; `/health`, `/metrics` (rvqtts.serving.metrics), the log and a stream's last event read it."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from rvqtts.serving.metrics import ServerMetrics
from rvqtts.synthesis.settings import Synthesis

log = logging.getLogger("rvqtts.serving")

OUTCOMES = ("served", "failed", "cancelled", "refused_busy")  # how a request ends
FIRST_AUDIO_PARTS = ("queue", "prefill", "frames", "decoder")


@dataclass
class RequestClock:
    """When a request came, took a row and sent its first audio (perf_counter seconds), and whether it shared calls."""

    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_audio: float | None = None  # streamed only
    shared: bool = False


class Accounting:
    """One server's requests, counted. `live()` gives the engine's rows and queue at a scrape:
    {"speaking": n, "queued": n, "rows": n}."""

    def __init__(self, live: Callable[[], dict]):
        self.counts = {outcome: 0 for outcome in OUTCOMES} | {"batched": 0}
        # streamed requests served and their first audio's parts, summed (a load test takes means between two reads)
        self.first_audio = {"streamed": 0} | {part: 0.0 for part in FIRST_AUDIO_PARTS}
        self._held_seconds, self._held = 0.0, 0  # the mean time a request held a row, over how many
        self._lock = threading.Lock()
        self._live = live
        self.metrics = ServerMetrics(self._state)

    def ended(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1

    def left_row(self, clock: RequestClock) -> None:
        """A request left its row, however it ended."""
        held = time.perf_counter() - clock.started
        with self._lock:
            self._held += 1
            self._held_seconds += (held - self._held_seconds) / self._held

    def retry_after(self, rounds: float) -> int:
        """Whole seconds until a refused request may find room: `rounds` times a request's mean time in a row."""
        return max(1, math.ceil(self._held_seconds * rounds))

    def served(self, index: int, clock: RequestClock, synthesis: Synthesis, streamed: bool) -> dict:
        """Count a served request (before its client hears the end: a scrape after it sees it) and log its first
        audio's parts; returns its own figures (a stream's last event): docs/server.md, "The request"."""
        now = time.perf_counter()
        split = {"queue": round(clock.started - clock.submitted, 3), **synthesis.seconds.first_audio_split}
        log.info("request %d: first audio after %s s", index, " + ".join(f"{v} {k}" for k, v in split.items()))
        with self._lock:
            if streamed:
                self.first_audio["streamed"] += 1
                for part, seconds in split.items():
                    self.first_audio[part] += seconds
            self.counts["served"] += 1
            self.counts["batched"] += clock.shared
        self.metrics.request_time.observe(now - clock.submitted)
        if clock.first_audio is not None:
            self.metrics.first_audio.observe(clock.first_audio - clock.submitted)
        return request_figures(clock, synthesis, now)

    def frames_made(self, rows: int) -> None:
        self.metrics.frames_made(rows)

    def record(self) -> dict:
        """What /health shows: the counts and the first audio's parts, summed."""
        with self._lock:
            first_audio = {name: round(value, 3) for name, value in self.first_audio.items()}
            return {**self.counts, "first_audio_seconds": first_audio}

    def _state(self) -> dict:
        """What /metrics reads at a scrape."""
        with self._lock:
            outcomes, shared = {outcome: self.counts[outcome] for outcome in OUTCOMES}, self.counts["batched"]
        return {"outcomes": outcomes, "shared": shared, **self._live()}


def request_figures(clock: RequestClock, synthesis: Synthesis, now: float) -> dict:
    """A served request's figures: its first audio after arrival (streamed), its audio's and its whole time's
    seconds, the real-time factor of its synthesis (compute seconds per audio second, as `synth` reports it) and
    the code predictor's codes per call."""
    audio_seconds = synthesis.audio.size / synthesis.sample_rate
    first_audio = None if clock.first_audio is None else round(clock.first_audio - clock.submitted, 3)
    return {
        "sample_rate": synthesis.sample_rate,
        "first_audio_seconds": first_audio,
        "audio_seconds": round(audio_seconds, 3),
        "seconds": round(now - clock.submitted, 3),
        "real_time_factor": round(synthesis.seconds.wall / audio_seconds, 4) if audio_seconds else None,
        "codes_per_call": round(synthesis.stats.codes_per_call, 4),
    }
