"""`rvqtts serve` against careless and hostile clients (issue 56): a failing engine, bodies that are not JSON or
too large however sent, browsers of other sites, too many connections, readers that stop reading, a paragraph
sent at once over the WebSocket, and SIGTERM. Each defect here has its test, over loopback on the tiny checkpoint."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import server_process, wait_until
from test_server import FRAMES, WAIT, Gate, running, settled
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from rvqtts.engine.loop.frame_loop import FrameLoop

pytestmark = pytest.mark.timeout(300)
BODY = {"input": "Hello there.", "voice": "vivian", "max_frames": FRAMES}


def fail_next_call(monkeypatch, error: BaseException) -> threading.Event:
    """The frame loop's next inner-loop call (every row's frame) raises `error` once the returned event is set."""
    armed = threading.Event()
    inner_loop = FrameLoop._inner_loop

    def failing(self, prefixes, ready):
        if armed.is_set():
            armed.clear()
            raise error
        return inner_loop(self, prefixes, ready)

    monkeypatch.setattr(FrameLoop, "_inner_loop", failing)
    return armed


def held_and_queued(url: str, engine, gate: Gate, pool: ThreadPoolExecutor) -> list:
    """Two requests' futures: the first held in the engine by `gate`, the second waiting in its queue."""
    held = [pool.submit(httpx.post, url + "/v1/audio/speech", json=BODY, timeout=WAIT)]
    gate.wait_entered("the first request")
    held.append(pool.submit(httpx.post, url + "/v1/audio/speech", json=BODY, timeout=WAIT))
    wait_until(lambda: engine.health()["queued"] == 1, WAIT, "the second request to queue")
    return held


def ws_address(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def test_a_failed_frame_loop_fails_the_requests_sharing_it_visibly_and_the_server_serves_on(tiny_dir, monkeypatch):
    """A whole and a streamed request share a call that raises: the whole one gets a 500 saying why, the streamed
    one (its 200 sent) a body cut without HTTP's final chunk; every later request is served as before the failure
    (the loop that starts again numbers its lines from 0: before, each got `500 synthesis failed: KeyError: 0`)."""
    with running(tiny_dir, batch_size=2) as (url, engine), httpx.Client(base_url=url, timeout=WAIT) as http:
        before = http.post("/v1/audio/speech", json=BODY)
        assert before.status_code == 200
        settled(engine)
        armed = fail_next_call(monkeypatch, RuntimeError("a call failed"))
        gate = Gate(engine, monkeypatch)
        with ThreadPoolExecutor(2) as pool:

            def streamed() -> tuple[int, bytes, Exception | None]:
                with httpx.stream("POST", url + "/v1/audio/speech", json={**BODY, "stream": True}, timeout=WAIT) as r:
                    received = b""
                    try:
                        for piece in r.iter_bytes():
                            received += piece
                    except httpx.HTTPError as error:
                        return r.status_code, received, error
                    return r.status_code, received, None

            try:
                whole = pool.submit(http.post, "/v1/audio/speech", json=BODY)
                gate.wait_entered("the whole request")
                stream = pool.submit(streamed)
                wait_until(lambda: engine.health()["queued"] == 1, WAIT, "the streamed request to queue")
                armed.set()
            finally:
                gate.opened.set()
            whole, (status, received, cut) = whole.result(), stream.result()
        assert whole.status_code == 500 and "RuntimeError: a call failed" in whole.json()["error"]["message"]
        assert status == 200 and isinstance(cut, httpx.RemoteProtocolError), (received[:60], cut)
        after = [http.post("/v1/audio/speech", json=BODY) for _ in range(3)]
        assert [r.content for r in after] == [before.content] * 3
        settled(engine)
        health = http.get("/health").json()
        assert (health["served"], health["failed"], health["speaking"], health["queued"]) == (4, 2, 0, 0)
        assert http.get("/ready").status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point of it
def test_a_dead_engine_thread_fails_every_wait_with_503_and_the_server_is_not_ready(tiny_dir, monkeypatch):
    """The engine thread ends (SystemExit inside a call): the request in it and every later one get 503 within a
    second instead of waiting forever; /ready says 503, /health (liveness) still answers."""
    with running(tiny_dir) as (url, engine), httpx.Client(base_url=url, timeout=WAIT) as http:
        assert http.get("/ready").json() == {"status": "ready"}
        fail_next_call(monkeypatch, SystemExit()).set()
        started = time.monotonic()
        waited = http.post("/v1/audio/speech", json=BODY)
        assert waited.status_code == 503 and waited.json()["error"]["code"] == "engine_stopped"
        assert time.monotonic() - started < 5
        later = http.post("/v1/audio/speech", json=BODY)
        assert later.status_code == 503 and "restarted" in later.json()["error"]["message"]
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_stopped"
        assert http.get("/health").status_code == 200


def test_only_json_bodies_are_taken_and_the_body_cap_holds_without_content_length(tiny_dir):
    """A form or text/plain body (what a page of another site can send without asking) gets 415; JSON with a
    charset is taken; a chunked body over 1 MiB gets 413 however it is cut; JSON nested too deeply is a 400."""

    def chunked(size: int, piece: int = 65536):
        body = json.dumps({**BODY, "instructions": " " * size}).encode()
        for start in range(0, len(body), piece):
            yield body[start : start + piece]

    with running(tiny_dir, max_chars=200) as (url, _), httpx.Client(base_url=url, timeout=WAIT) as http:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": content_type} if content_type else {}
            response = http.post("/v1/audio/speech", content=json.dumps(BODY), headers=headers)
            error = response.json()["error"]
            assert response.status_code == 415 and error["code"] == "unsupported_media_type", content_type
            assert "Content-Type: application/json" in error["message"]
        json_with_charset = {"content-type": "Application/JSON; charset=utf-8"}
        assert http.post("/v1/audio/speech", content=json.dumps(BODY), headers=json_with_charset).status_code == 200
        headers = {"content-type": "application/json"}
        big = http.post("/v1/audio/speech", content=chunked(2 << 20), headers=headers)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert http.post("/v1/audio/speech", content=chunked(100, piece=7), headers=headers).status_code == 200
        nested = http.post("/v1/audio/speech", content="[" * 100_000, headers=headers)
        assert nested.status_code == 400 and "not JSON" in nested.json()["error"]["message"]


def test_websockets_from_other_sites_are_refused_unless_allowed_and_cors_serves_the_allowed(tiny_dir):
    """A browser page of any site can open a WebSocket to the user's machine: one whose Origin is neither the
    server's own (its Host) nor an --allow-origin is refused at the handshake; programs (no Origin) are served. The
    allowed origin also gets CORS answers for the HTTP API; another does not."""
    allowed = "https://app.example"
    with running(tiny_dir, allowed_origins=(allowed,)) as (url, _):
        host = url.removeprefix("http://")
        for origin in (None, f"http://{host}", allowed):
            with connect(ws_address(url), origin=origin) as ws:
                ws.send(json.dumps({"type": "done"}))
                assert json.loads(ws.recv(timeout=WAIT))["type"] == "done", origin
        for origin in ("http://evil.example", f"http://{host}.evil.example", "null", "http://localhost:1"):
            with pytest.raises(InvalidStatus, match="403"):
                connect(ws_address(url), origin=origin).close()
        preflight = {
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type",
        }
        answer = httpx.options(url + "/v1/audio/speech", headers={"origin": allowed, **preflight})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == allowed
        assert "authorization" in answer.headers["access-control-allow-headers"].lower()
        other = httpx.options(url + "/v1/audio/speech", headers={"origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        assert (
            httpx.get(url + "/v1/models", headers={"origin": allowed}).headers["access-control-allow-origin"] == allowed
        )


def test_requests_and_sessions_over_max_connections_get_503_and_the_probes_still_answer(tiny_dir, monkeypatch):
    """Two requests held open (one in the held engine, one queued) fill --max-connections 2: a third request and a
    WebSocket session get 503 at once, /health and /ready answer; once the engine is let go all is served."""
    with running(tiny_dir, max_connections=2) as (url, engine), ThreadPoolExecutor(2) as pool:
        gate = Gate(engine, monkeypatch)
        try:
            held = held_and_queued(url, engine, gate, pool)
            refused = httpx.post(url + "/v1/audio/speech", json=BODY, timeout=WAIT)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections"
            assert refused.headers["retry-after"] == "1"
            with pytest.raises(InvalidStatus, match="503"):
                connect(ws_address(url)).close()
            assert httpx.get(url + "/health").status_code == httpx.get(url + "/ready").status_code == 200
        finally:
            gate.opened.set()
        assert [future.result().status_code for future in held] == [200, 200]
        assert httpx.post(url + "/v1/audio/speech", json=BODY, timeout=WAIT).status_code == 200


def session_events(ws, until: str = "done") -> list[object]:
    """What the server sent, its JSON events parsed and its audio as bytes, up to the event `until`."""
    received: list[object] = []
    while not (received and isinstance(received[-1], dict) and received[-1]["type"] == until):
        message = ws.recv(timeout=WAIT)
        received.append(message if isinstance(message, bytes) else json.loads(message))
    return received


def test_a_paragraph_sent_at_once_is_spoken_whole_and_in_order_while_the_queue_is_full(tiny_dir, monkeypatch):
    """14 sentences in one message, with the engine held and its queue of 2 full of other requests: the session
    waits its turn instead of refusing (before: 2 sentences spoken, `server is busy` for the others), and speaks
    every sentence in order once the engine is let go."""
    sentences = [f"Sentence number {n}." for n in range(14)]
    with running(tiny_dir, queue_size=2, batch_size=1) as (url, engine), ThreadPoolExecutor(2) as pool:
        gate = Gate(engine, monkeypatch)
        try:
            held = held_and_queued(url, engine, gate, pool)
            with connect(ws_address(url)) as ws:
                ws.send(json.dumps({"type": "session", "voice": "vivian", "max_frames": 3}))
                ws.send(json.dumps({"type": "text", "text": " ".join(sentences) + " "}))
                ws.send(json.dumps({"type": "done"}))
                wait_until(lambda: engine.health()["queued"] == 2, WAIT, "the session's first sentence to queue")
                gate.opened.set()
                received = session_events(ws)
        finally:
            gate.opened.set()
        assert [future.result().status_code for future in held] == [200, 200]
    events = [event for event in received if isinstance(event, dict)]
    assert not [event for event in events if event["type"] == "error"], events
    spoken = [(event["index"], event["text"]) for event in events if event["type"] == "sentence"]
    assert spoken == list(enumerate(sentences))
    assert [event["type"] for event in events] == ["sentence", "sentence.done"] * 14 + ["done"]
    assert engine.accounting.counts["refused_busy"] == 0  # a session waits; it is not refused


def test_a_session_s_messages_and_unspoken_text_are_bounded(tiny_dir, monkeypatch):
    """--max-chars 50: a message over 4 x 50 characters gets an error event and is ignored, and so does text past 16 x
    50 characters not yet given to the engine (held here), and the session goes on; a 4 MB message closes the
    session (1009) while /health answers."""
    with running(tiny_dir, max_chars=50) as (url, engine):
        gate = Gate(engine, monkeypatch)
        with connect(ws_address(url)) as ws:
            ws.send(json.dumps({"type": "session", "voice": "vivian", "max_frames": 2}))
            ws.send(json.dumps({"type": "text", "text": "x" * 201}))
            error = json.loads(ws.recv(timeout=WAIT))
            assert error["type"] == "error" and error["error"]["code"] == "message_too_long"
            try:
                ws.send(json.dumps({"type": "text", "text": "Held. "}))
                gate.wait_entered("the session's first sentence")
                for _ in range(6):  # 150 characters without a sentence end, spoken in pieces of up to 50
                    ws.send(json.dumps({"type": "text", "text": "word " * 30}))
                received = session_events(ws, until="error")
                assert received[-1]["error"]["code"] == "session_text_too_long", received[-1]
            finally:
                gate.opened.set()
            ws.send(json.dumps({"type": "done"}))
            events = [event for event in received[:-1] + session_events(ws) if isinstance(event, dict)]
            assert not [event for event in events if event["type"] == "error"]
            taken = " ".join(event["text"] for event in events if event["type"] == "sentence")
            assert taken.startswith("Held. word word") and taken.count("word") == 5 * 30  # the sixth refused
        with connect(ws_address(url), max_size=None) as ws, ThreadPoolExecutor(1) as pool:
            sending = pool.submit(ws.send, json.dumps({"type": "text", "text": "y" * (4 << 20)}))
            assert httpx.get(url + "/health", timeout=WAIT).status_code == 200
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=WAIT)
            assert closed.value.rcvd.code == 1009
            sending.result()
        assert httpx.get(url + "/ready", timeout=WAIT).status_code == 200


def test_a_reader_that_stops_reading_is_cut_and_frees_its_row(tiny_dir):
    """A streamed request whose client stops reading (a small socket buffer on both sides) falls more than
    --max-unsent-seconds behind: its job is cancelled at once (the engine never waits for it), its connection closed
    without HTTP's final chunk, and the next request is served."""
    long = {"input": "A long utterance to stream. " * 6, "voice": "vivian", "max_frames": 47, "stream": True}
    with running(tiny_dir, send_buffer=4096, max_unsent_seconds=0.5) as (url, engine):
        host, port = url.removeprefix("http://").split(":")
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        body = json.dumps(long).encode()
        head = f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        client.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: engine.accounting.counts["cancelled"] == 1, WAIT, "the reader to be cut")
        settled(engine)
        assert engine.accounting.counts["served"] == 0 and engine.health()["speaking"] == 0
        assert httpx.post(url + "/v1/audio/speech", json=BODY, timeout=WAIT).status_code == 200
        client.settimeout(WAIT)
        received = b""
        while piece := client.recv(65536):  # what was sent, then the connection closed
            received += piece
        client.close()
    assert received.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in received.lower()
    assert not received.endswith(b"0\r\n\r\n")  # no final chunk: a broken body


def test_sigterm_lets_requests_in_flight_finish_within_the_drain_and_cuts_the_rest(tiny_dir):
    """`rvqtts serve --drain-seconds 3` sent SIGTERM with two streams in flight: it takes no new connection, the
    short stream ends whole (HTTP's final chunk), the one that outlasts the drain is cut (the client sees a broken
    body, not a clean short one), and the process exits."""

    def streamed(text: str, started: threading.Event, pause: float = 0.0) -> tuple[int, Exception | None]:
        """The bytes a stream gave and how it ended; read a piece every `pause` seconds (a slow player: its response
        outlasts the drain on any machine, where a fast one might synthesize it all within 3 s)."""
        body = {"input": text, "voice": "vivian", "max_frames": 47, "stream": True}
        with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=WAIT) as response:
            received = 0
            try:
                for piece in response.iter_bytes():
                    received += len(piece)
                    started.set()
                    time.sleep(pause)
            except httpx.HTTPError as error:
                return received, error
            return received, None

    with server_process(tiny_dir, "--batch-size", "2", "--drain-seconds", "3") as (url, ready, server):
        wait_until(ready, WAIT, "the server to load")
        short_started, long_started = threading.Event(), threading.Event()
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(streamed, "A long utterance that outlasts the drain. " * 90, long_started, 0.25)
            short = pool.submit(streamed, "Short.", short_started)
            wait_until(lambda: short_started.is_set() and long_started.is_set(), WAIT, "both streams to start")
            server.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health")
            (short_bytes, short_error), (long_bytes, long_error) = short.result(), long.result()
        assert short_error is None and short_bytes > 44
        assert isinstance(long_error, httpx.RemoteProtocolError) and long_bytes > 44, long_error
        assert server.wait(WAIT) in (0, -signal.SIGTERM)
