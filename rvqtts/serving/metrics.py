"""What `rvqtts serve` shows at GET /metrics, in Prometheus's text format (prometheus_client): requests by how they
ended, streamed requests' first audio and served requests' whole time as histograms, rows busy, the queue, frames
made and their rate over the last seconds, and the process's memory and CPU time. The counts are the server's
accounting's (rvqtts.serving.accounting; `/health` shows them too): a collector reads them at each scrape.
docs/server.md, "Metrics"."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest as exposition_of
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# seconds: a lone request's first audio is a few tenths, a burst's a few seconds, a whole answer up to minutes
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)
RATE_SECONDS = 10.0  # frames per second: over this many last seconds
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """One server's metrics in a registry of its own (a process may run several servers: the tests do). `state`
    gives the requests by how they ended and the rows at scrape time:
    {"outcomes": {outcome: n}, "shared": n, "speaking": n, "queued": n, "rows": n}."""

    def __init__(self, state: Callable[[], dict]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.first_audio = Histogram(
            "rvqtts_first_audio_seconds",
            "Streamed requests served: from arrival to the first audio sent",
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.request_time = Histogram(
            "rvqtts_request_seconds",
            "Requests served: from arrival to the last audio sent",
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.frames = Counter("rvqtts_frames", "Frames made (80 ms of audio each), every row's", registry=self.registry)
        self._recent: deque[tuple[float, int]] = deque()  # (when, rows' frames) of each frame of the last RATE_SECONDS
        self._lock = threading.Lock()
        self.registry.register(_EngineCollector(state, self.frames_per_second))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open files

    def frames_made(self, rows: int) -> None:
        """A frame of the loop, made by `rows` rows, as the engine makes it."""
        self.frames.inc(rows)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, rows))
            self._forget(now)

    def frames_per_second(self) -> float:
        """Rows' frames made per second over the last RATE_SECONDS."""
        with self._lock:
            self._forget(time.monotonic())
            return sum(rows for _, rows in self._recent) / RATE_SECONDS

    def _forget(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_SECONDS:
            self._recent.popleft()

    def exposition(self) -> bytes:
        """The scrape's body (CONTENT_TYPE)."""
        return exposition_of(self.registry)


class _EngineCollector(Collector):
    """The engine's counts and rows, read as a scrape asks."""

    def __init__(self, state: Callable[[], dict], frames_per_second: Callable[[], float]):
        self.state, self.frames_per_second = state, frames_per_second

    def collect(self) -> Iterator[Metric]:
        state = self.state()
        requests = CounterMetricFamily("rvqtts_requests", "Requests by how they ended", labels=["outcome"])
        for outcome, count in state["outcomes"].items():
            requests.add_metric([outcome], count)
        yield requests
        yield CounterMetricFamily(
            "rvqtts_requests_shared", "Requests served in calls shared with another", value=state["shared"]
        )
        gauges = {
            "rvqtts_rows_busy": ("Rows speaking a request now", state["speaking"]),
            "rvqtts_rows": ("Rows the frame loop has (--batch-size)", state["rows"]),
            "rvqtts_queue_length": ("Requests waiting for a row", state["queued"]),
            "rvqtts_frames_per_second": (f"Frames made per second over the last {RATE_SECONDS:g} s", None),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=self.frames_per_second() if value is None else value)
