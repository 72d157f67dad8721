"""`rvqtts bench serve`: a load test of a running `rvqtts serve`: requests from concurrent clients over HTTP,
with each request's time to first audio and total time, the server's account of where a streamed request's first
audio went, the throughput, and the server's resident memory before and after."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rich.table import Table

from rvqtts.support.report import titled_table

if TYPE_CHECKING:
    import httpx

WAV_HEADER_BYTES = 44  # a streamed WAV's header comes first; audio is what follows it
SPLIT = ("queue", "prefill", "frames", "decoder")  # a first audio's parts, as the server's /health sums them


def percentile(values: list[float], share: float) -> float:
    """The `share` quantile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def load_test(
    url: str,
    texts: list[str],
    requests: int,
    clients: int,
    stream: bool = True,
    api_key: str | None = None,
    fields: dict | None = None,
    stagger: float = 0.0,
) -> dict:
    """Send `requests` speech requests (texts in turn, seed = request number) from `clients` threads, each
    client sending its share one after another, client c starting `stagger` x c seconds after the first (0: all at
    once, so that requests of one length run in step and join in bursts); every request must succeed."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    before = httpx.get(f"{url}/health", timeout=30).json()

    def client(share: list[int]) -> list[dict]:
        time.sleep(stagger * share[0] if share else 0)
        with httpx.Client(base_url=url, headers=headers, timeout=None) as http:
            return [
                _timed_request(http, number, _speech_body(texts, number, stream, fields), stream) for number in share
            ]

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [r for rs in pool.map(client, [list(range(c, requests, clients)) for c in range(clients)]) for r in rs]
    wall = time.perf_counter() - started
    after = httpx.get(f"{url}/health", timeout=30).json()
    return {
        "url": url,
        "requests": requests,
        "clients": clients,
        "stagger_seconds": stagger,
        "stream": stream,
        "wall_seconds": round(wall, 3),
        "requests_per_minute": round(60 * requests / wall, 2),
        **_latencies(done),
        # the server's own account of a streamed request's first audio, its parts' means over this run
        "first_audio_split": _first_audio_split(before, after),
        **_server_memory(before, after),
    }


def _speech_body(texts: list[str], number: int, stream: bool, fields: dict | None) -> dict:
    """Request `number`'s body: the texts in turn, its number as the seed, and the caller's other `fields`."""
    return {"input": texts[number % len(texts)], "seed": number, "stream": stream, **(fields or {})}


def _timed_request(http: httpx.Client, number: int, body: dict, stream: bool) -> dict:
    """One speech request's time to its first audio (`stream`: the first byte past a streamed WAV's header), total
    time and size; a request that fails raises, saying why."""
    started, first, size = time.perf_counter(), None, 0
    with http.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"request {number}: HTTP {response.status_code}: {response.text[:300]}")
        for piece in response.iter_bytes():
            size += len(piece)
            if first is None and size > (WAV_HEADER_BYTES if stream else 0):
                first = time.perf_counter() - started
    return {"first_audio_seconds": first, "seconds": time.perf_counter() - started, "bytes": size}


def _latencies(done: list[dict]) -> dict:
    """The requests' times to first audio and total times, median and 95th percentile."""
    firsts, totals = [r["first_audio_seconds"] for r in done], [r["seconds"] for r in done]
    return {
        "first_audio_p50": round(statistics.median(firsts), 3),
        "first_audio_p95": round(percentile(firsts, 0.95), 3),
        "total_p50": round(statistics.median(totals), 3),
        "total_p95": round(percentile(totals, 0.95), 3),
    }


def _first_audio_split(before: dict, after: dict) -> dict | None:
    """The mean parts of the streamed requests' first audio over the run, from the sums the server's /health
    gave before and after it (None: no streamed request, or a server before 2026-12-05, which gives none)."""
    told = before.get("first_audio_seconds"), after.get("first_audio_seconds")
    if not all(told):
        return None
    streamed = told[1]["streamed"] - told[0]["streamed"]
    return {part: round((told[1][part] - told[0][part]) / streamed, 3) for part in SPLIT} if streamed else None


def _server_memory(before: dict, after: dict) -> dict:
    """The server's resident memory before and after the run, and what it reports it keeps between requests
    (its KV caches, voices) inside it."""
    return {
        "server_rss_mib_before": before.get("rss_mib"),
        "server_rss_mib_after": after.get("rss_mib"),
        "server_caches_mib_before": round(sum(before.get("caches_mib", {}).values()), 3),
        "server_caches_mib_after": round(sum(after.get("caches_mib", {}).values()), 3),
    }


def serve_table(result: dict) -> Table:
    """`rvqtts bench serve`: a load test's latencies, throughput and the server's memory."""
    mode = "streamed" if result["stream"] else "whole"
    table = titled_table(
        f"{result['requests']} {mode} requests from {result['clients']} clients to {result['url']}"
        + (f", starting {result['stagger_seconds']} s apart" if result["stagger_seconds"] else ""),
        ("first audio p50 s", "p95 s", "its mean parts s", "total p50 s", "p95 s", "requests / min", "server RSS MiB",
         "its caches MiB"),
    )  # fmt: skip
    split = result["first_audio_split"]
    table.add_row(
        f"{result['first_audio_p50']:.3f}",
        f"{result['first_audio_p95']:.3f}",
        " + ".join(f"{split[part]:.3f} {part}" for part in SPLIT) if split else "-",
        f"{result['total_p50']:.3f}",
        f"{result['total_p95']:.3f}",
        f"{result['requests_per_minute']:.1f}",
        f"{result['server_rss_mib_before']} -> {result['server_rss_mib_after']}",
        f"{result['server_caches_mib_before']} -> {result['server_caches_mib_after']}",
    )
    return table
