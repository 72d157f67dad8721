"""`rvqtts serve` (rvqtts.server) through real clients over loopback: the `openai` package for speech, plain
`httpx` for the errors, concurrent clients, a client gone mid-stream and a flood of requests."""

from __future__ import annotations

import io
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import openai
import pytest
import soundfile
import uvicorn
from helpers import run_cli

from rvqtts.audio import audio_bytes
from rvqtts.server import ServerOptions, SpeechEngine, create_app
from rvqtts.settings import GenerationSettings
from rvqtts.synthesis import Synthesizer, prepare_inner_loop

FRAMES = 12  # max_frames: short utterances keep the module fast
KEY = "test-key"


@contextmanager
def running(model_dir, **options):
    """A server on a free loopback port over `model_dir` in float32, set up as `rvqtts serve --dtype float32`
    sets it up; yields its base URL and engine, and stops it."""
    synth = Synthesizer.load(model_dir, dtype="float32")
    prepare_inner_loop(synth)  # --tree auto, as rvqtts serve and rvqtts synth run
    engine = SpeechEngine(synth, ServerOptions(model_dir.name, **options))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


@pytest.fixture(scope="module")
def served(tiny_dir):
    with running(tiny_dir, api_key=KEY, max_chars=200) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


def speak(client, text: str, seed: int = 0, **fields) -> bytes:
    extra = {"seed": seed, "max_frames": FRAMES, **fields.pop("extra", {})}
    fields = {"model": "tiny", "voice": "vivian", "response_format": "wav", **fields}
    return client.audio.speech.create(input=text, extra_body=extra, **fields).read()


def test_a_response_is_the_file_rvqtts_synth_writes(client, tiny_dir, tmp_path):
    text = "Hello from the server."
    options = ("--speaker", "ryan", "--seed", 3, "--max-frames", FRAMES, "--dtype", "float32", "-q")
    for suffix, response_format in ((".wav", "wav"), (".flac", "flac")):
        out = tmp_path / f"synth{suffix}"
        result = run_cli("synth", text, "--model", tiny_dir, "-o", out, *options)
        assert result.exit_code == 0, result.output
        assert speak(client, text, seed=3, voice="Ryan", response_format=response_format) == out.read_bytes()
    raw = run_cli("synth", text, "--model", tiny_dir, "-o", "-", "--format", "raw", *options)
    assert speak(client, text, seed=3, voice="ryan", response_format="pcm") == raw.stdout_bytes  # synth -o - raw
    assert speak(client, text, seed=4, voice="ryan") != (tmp_path / "synth.wav").read_bytes()  # the seed counts


def test_streamed_audio_arrives_in_pieces_as_it_is_made(client):
    text = "A streamed sentence."
    whole, _ = soundfile.read(io.BytesIO(speak(client, text, seed=1)), dtype="int16")
    pieces = []
    request = dict(model="tiny", voice="vivian", input=text, response_format="wav")
    with client.audio.speech.with_streaming_response.create(
        **request, extra_body={"seed": 1, "max_frames": FRAMES, "stream": True}
    ) as response:
        assert response.headers["content-type"] == "audio/wav" and "content-length" not in response.headers
        pieces = list(response.iter_bytes())
    data = b"".join(pieces)
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    samples = np.frombuffer(data[44:], dtype="<i2")
    assert samples.shape == whole.shape and np.abs(samples.astype(int) - whole).max() <= 1
    assert len(pieces) >= FRAMES // 4  # a piece every 4 frames, not one body at the end


def test_bad_requests_get_openai_errors_saying_what_to_send(served):
    url, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    good = {"model": "tiny", "input": "Hi.", "voice": "vivian", "max_frames": 3}
    cases = [
        ({"voice": "alloy"}, 400, "voice", "choose aiden, dylan"),
        ({"response_format": "mp3"}, 400, "response_format", "choose wav, pcm, flac"),
        ({"input": "   "}, 400, "input", "`input` is empty"),
        ({"speed": 1.5}, 400, "speed", "1.0 only"),
        ({"temperature": -1}, 400, None, "temperature"),
        ({"seed": "x"}, 400, "seed", "whole number"),
        ({"max_frames": 2.5}, 400, "max_frames", "whole number"),
        ({"language": "klingon"}, 400, None, "klingon"),
        ({"stream_format": "sse"}, 400, "stream_format", "choose audio"),
        ({"response_format": "flac", "stream": True}, 400, "response_format", "cannot be streamed"),
        ({"input": "x" * 201}, 413, "input", "more than this server's 200"),
    ]
    with httpx.Client(base_url=url, headers=headers) as http:
        for change, status, param, message in cases:
            response = http.post("/v1/audio/speech", json={**good, **change})
            error = response.json()["error"]
            assert response.status_code == status and message in error["message"], (change, error)
            assert error["param"] == param and error["type"] == "invalid_request_error"
        response = http.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 400 and "not JSON" in response.json()["error"]["message"]
        assert http.get("/v1/nothing").status_code == 404 and "error" in http.get("/v1/nothing").json()
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert "vivian" in http.get("/v1/voices").json()["voices"]
        assert http.post("/v1/audio/speech", json=good).status_code == 200
    for wrong in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        response = httpx.post(url + "/v1/audio/speech", json=good, headers=wrong)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/voices", headers=wrong).status_code == 401
    assert httpx.get(url + "/health").json()["status"] == "ok"  # open: for a load balancer


def test_concurrent_clients_each_get_the_audio_of_their_seed(served, tiny):
    """16 requests from 8 clients at once: no failure, and every WAV is the one its text and seed make alone
    (here computed by another Synthesizer, with the plain inner loop)."""
    url, engine = served
    texts = ["First line.", "The second line is longer than the first."]
    jobs = [(texts[n % 2], n % 4) for n in range(16)]
    settings = GenerationSettings(max_frames=FRAMES)
    expected = {
        (text, seed): audio_bytes(tiny.synthesize(text, seed=seed, settings=settings).audio, tiny.sample_rate)
        for text, seed in set(jobs)
    }

    def client_run(share: list[tuple[str, int]]) -> list[bytes]:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            bodies = []
            for text, seed in share:
                body = {"input": text, "voice": "vivian", "seed": seed, "max_frames": FRAMES}
                response = http.post("/v1/audio/speech", json=body)
                assert response.status_code == 200, response.text
                bodies.append(response.content)
            return bodies

    served_before = engine.counts["served"]
    shares = [jobs[n::8] for n in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(client_run, shares))
    for share, bodies in zip(shares, answers):
        for job, body in zip(share, bodies):
            assert body == expected[job], job
    assert engine.counts["served"] - served_before == 16 and engine.counts["failed"] == 0


def test_a_client_gone_mid_stream_stops_its_request_while_others_stream(served, client):
    url, engine = served
    cancelled = engine.counts["cancelled"]
    long = {"input": "A long utterance. " * 5, "voice": "vivian", "stream": True, "max_frames": 400}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/audio/speech", json=long) as response:
            assert response.status_code == 200
            next(response.iter_bytes())  # the header and first samples, then the client hangs up
        reference = speak(client, "Still here.", seed=2)  # waits behind the stopped request, then runs
        deadline = time.monotonic() + 30
        while engine.counts["cancelled"] == cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
    assert engine.counts["cancelled"] == cancelled + 1
    assert speak(client, "Still here.", seed=2) == reference  # the engine is whole after a stop


def test_a_flood_gets_503_with_retry_after_and_the_server_keeps_serving(tiny_dir):
    body = {"input": "Flood.", "voice": "vivian", "max_frames": FRAMES}
    with running(tiny_dir, queue_size=1) as (url, engine):

        def post(_: int) -> httpx.Response:
            return httpx.post(url + "/v1/audio/speech", json=body, timeout=120)

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(post, range(12)))
        statuses = sorted(r.status_code for r in responses)
        busy = [r for r in responses if r.status_code == 503]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
        assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "server_busy" for r in busy)
        assert len({r.content for r in responses if r.status_code == 200}) == 1  # all the same seed's audio
        assert post(0).status_code == 200 and engine.counts["refused_busy"] == len(busy)


def test_a_base_model_speaks_the_voice_files_of_its_folder_and_nothing_else(base_dir, tmp_path):
    voices = tmp_path / "voices"
    voices.mkdir()
    samples = np.random.default_rng(0).standard_normal(30000).astype(np.float32) * 0.1
    soundfile.write(tmp_path / "ref.wav", samples, 24000)
    made = run_cli(
        "synth",
        "--model",
        base_dir,
        "--ref-audio",
        tmp_path / "ref.wav",
        "--x-vector-only",
        "--save-voice",
        voices / "anna.safetensors",
    )
    assert made.exit_code == 0, made.output
    (tmp_path / "outside.safetensors").write_bytes((voices / "anna.safetensors").read_bytes())
    (voices / "linked.safetensors").symlink_to(tmp_path / "outside.safetensors")
    out = tmp_path / "synth.wav"
    options = ("--voice", voices / "anna.safetensors", "--seed", 5, "--max-frames", 6, "--dtype", "float32", "-q")
    assert run_cli("synth", "Hello.", "--model", base_dir, "-o", out, *options).exit_code == 0
    with running(base_dir, voices_dir=voices) as (url, _):
        assert httpx.get(url + "/v1/voices").json()["voices"] == ["anna"]
        body = {"input": "Hello.", "voice": "anna", "seed": 5, "max_frames": 6}
        assert httpx.post(url + "/v1/audio/speech", json=body, timeout=60).content == out.read_bytes()
        for name in ("linked", "../outside", str(tmp_path / "outside"), "vivian"):
            response = httpx.post(url + "/v1/audio/speech", json={**body, "voice": name})
            assert response.status_code == 400 and "voice files in" in response.json()["error"]["message"], name


def test_serve_refuses_bad_options_before_loading(tiny_dir, tmp_path, monkeypatch):
    for arguments, message in [
        (["--voices", tmp_path], "--voices is for Base models"),
        (["--port", 0], "--port must be between"),
        (["--queue-size", 0], "--queue-size and --max-chars"),
        (["--model", tmp_path / "none"], "none"),
    ]:
        result = run_cli("serve", "--model", tiny_dir, *arguments)
        assert result.exit_code == 2 and message in result.output, (arguments, result.output)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the extra were not installed
    result = run_cli("serve", "--model", tiny_dir)
    assert result.exit_code == 2 and "pip install 'rvqtts[serve]'" in result.output


def test_whole_requests_waiting_together_share_calls_and_get_their_own_audio(tiny_dir, measured):
    """Requests that wait together are spoken a row each in shared calls (measured kernels, row-invariant),
    each with its own seed and text: every response is the one it gets alone."""
    from rvqtts.batch_size import rows_invariant

    jobs = [("One line.", 1), ("Another, longer line of text.", 2), ("Third.", 3), ("One line.", 4)]
    with running(tiny_dir, batch_size=4) as (url, engine):
        assert rows_invariant(engine.synth)

        def post(job: tuple[str, int], frames: int = FRAMES) -> bytes:
            body = {"input": job[0], "voice": "vivian", "seed": job[1], "max_frames": frames}
            response = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.content

        alone = [post(job) for job in jobs]  # one client: each request alone in the engine
        assert engine.counts["batched"] == 0
        with ThreadPoolExecutor(5) as pool:
            holder = pool.submit(post, ("Hold the engine.", 9), 40)  # the others queue behind it
            while not engine.busy:
                time.sleep(0.01)
            together = list(pool.map(post, jobs))
            holder.result()
        assert together == alone and engine.counts["batched"] >= 2
