"""`rvqtts serve` against careless and hostile clients (issue 56): a failing engine, bodies that are not JSON or
too large however sent, browsers of other sites, too many connections, readers that stop reading, a paragraph
sent at once over the WebSocket, and SIGTERM. Each defect here has its test, over loopback on the tiny checkpoint."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import wait_until
from test_server import FRAMES, WAIT, Gate, running, settled
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from rvqtts.engine.frame_loop import FrameLoop

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
            held = [pool.submit(httpx.post, url + "/v1/audio/speech", json=BODY, timeout=WAIT)]
            gate.wait_entered("the first request")
            held.append(pool.submit(httpx.post, url + "/v1/audio/speech", json=BODY, timeout=WAIT))
            wait_until(lambda: engine.health()["queued"] == 1, WAIT, "the second request to queue")
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
