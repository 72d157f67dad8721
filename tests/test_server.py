"""`rvqtts serve` (rvqtts.serving) through real clients over loopback: the `openai` package for speech, plain
`httpx` for the errors, concurrent clients, a client gone mid-stream and a flood of requests."""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile
from helpers import run_cli, running, streamed_samples, wait_until
from prometheus_client.parser import text_string_to_metric_families

from rvqtts.serving.engine import Job, SpeechEngine
from rvqtts.support.audio import audio_bytes
from rvqtts.synthesis import pipeline
from rvqtts.synthesis.settings import GenerationSettings

FRAMES = 12  # max_frames: short utterances keep the module fast
KEY = "test-key"
WAIT = 60  # seconds any one wait here may take before its test fails saying what it waited for
# Each test here takes under 20 s on two vCPUs (the first also builds the tiny checkpoint; the batching one times
# kernels): a hung server fails its own test long before the run's 15 minutes (pyproject.toml).
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tiny_dir):
    with running(tiny_dir, api_key=KEY, max_chars=200) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


class Gate:
    """Holds the engine as a row takes its next request (making the request's prompt, patched on the Synthesizer
    instance) until the test opens the gate: once `entered` is set, the engine thread is provably busy and every later
    request waits in its queue. A held engine is let go after WAIT seconds whatever happens, so a failing test cannot
    hang it."""

    def __init__(self, engine: SpeechEngine, monkeypatch):
        self.entered, self.opened = threading.Event(), threading.Event()
        original = engine.synth.prompt

        def held(*args, **kwargs):
            if not self.entered.is_set():
                self.entered.set()
                self.opened.wait(WAIT)
            return original(*args, **kwargs)

        monkeypatch.setattr(engine.synth, "prompt", held)

    def wait_entered(self, what: str) -> None:
        wait_until(self.entered.is_set, WAIT, f"{what} to reach the engine")


def settled(engine: SpeechEngine) -> None:
    """Wait until the engine has counted the requests it answered: a client can read its response before the engine
    thread updates its counts."""
    wait_until(lambda: not engine.busy and not engine.health()["queued"], WAIT, "the engine to finish its requests")


def speak(client, text: str, seed: int = 0, **fields) -> bytes:
    extra = {"seed": seed, "max_frames": FRAMES, **fields.pop("extra", {})}
    fields = {"model": "tiny", "voice": "vivian", "response_format": "wav", **fields}
    return client.audio.speech.create(input=text, extra_body=extra, **fields).read()


def test_a_response_is_the_file_rvqtts_synth_writes(client, tiny_dir, tmp_path):
    text = "Hello from the server."
    options = ("--speaker", "ryan", "--seed", 3, "--max-frames", FRAMES, "--dtype", "float32", "-q")
    for response_format in ("wav", "flac", "mp3", "opus"):
        out = tmp_path / f"synth.{response_format}"
        result = run_cli("synth", text, "--model", tiny_dir, "-o", out, *options)
        assert result.exit_code == 0, result.output
        spoken = speak(client, text, seed=3, voice="Ryan", response_format=response_format)
        if response_format == "opus":  # an Ogg stream's serial number is drawn anew: the same samples
            samples, rate = soundfile.read(io.BytesIO(spoken))
            assert rate == 24000 and np.array_equal(samples, soundfile.read(out)[0]) and len(samples) > 1920
        else:
            assert spoken == out.read_bytes()
    raw = run_cli("synth", text, "--model", tiny_dir, "-o", "-", "--format", "raw", *options)
    assert speak(client, text, seed=3, voice="ryan", response_format="pcm") == raw.stdout_bytes  # synth -o - raw
    assert speak(client, text, seed=4, voice="ryan") != (tmp_path / "synth.wav").read_bytes()  # the seed counts


def test_speed_stretches_whole_and_streamed_responses_as_synth_speed_does(client, tiny_dir, tmp_path):
    """`speed` 1.5: the whole response is `synth --speed 1.5`'s file, 1/1.5 of the length at speed 1; the streamed
    one has its samples up to float rounding; a speed out of 0.25..4 is refused saying the range."""
    text, out = "Faster, please.", tmp_path / "fast.wav"
    options = ("--speaker", "ryan", "--seed", 3, "--max-frames", FRAMES, "--dtype", "float32", "-q")
    assert run_cli("synth", text, "--model", tiny_dir, "-o", out, "--speed", 1.5, *options).exit_code == 0
    whole = speak(client, text, seed=3, voice="ryan", speed=1.5)
    assert whole == out.read_bytes()
    samples = soundfile.read(io.BytesIO(whole), dtype="int16")[0]
    assert len(samples) == round(len(soundfile.read(io.BytesIO(speak(client, text, seed=3, voice="ryan")))[0]) / 1.5)
    with client.with_options(timeout=WAIT).audio.speech.with_streaming_response.create(
        model="tiny", voice="ryan", input=text, response_format="pcm", speed=1.5,
        extra_body={"seed": 3, "max_frames": FRAMES, "stream": True},
    ) as response:  # fmt: skip
        streamed = np.frombuffer(response.read(), dtype="<i2")
    assert streamed.shape == samples.shape and np.abs(streamed.astype(int) - samples).max() <= 1
    with pytest.raises(openai.BadRequestError, match="`speed` must be at least 0.25 and at most 4.0"):
        speak(client, text, speed=0.1)


def test_streamed_audio_arrives_in_pieces_as_it_is_made(client, served, monkeypatch):
    """The engine is held after the stream's first piece (its first frame) until the client has read audio samples:
    they can only have come before the rest of the utterance was made. A server that sent the body at the end would
    time out here; how TCP cuts the bytes into reads does not matter."""
    text = "A streamed sentence."
    whole, _ = soundfile.read(io.BytesIO(speak(client, text, seed=1)), dtype="int16")
    _, engine = served
    first_made, opened = threading.Event(), threading.Event()
    made: list[int] = []  # the bytes of each piece of samples the engine sent, in order
    send = Job.send

    def held_send(job: Job, item) -> None:
        piece = isinstance(item, bytes) and not item.startswith(b"RIFF")
        first = piece and not first_made.is_set()
        if piece:  # counted before it is sent: the client may read it before this thread runs on
            made.append(len(item))
            first_made.set()
        send(job, item)  # sent on, then the engine is held before it makes the next
        if first:
            opened.wait(WAIT)

    monkeypatch.setattr(Job, "send", held_send)
    request = dict(model="tiny", voice="vivian", input=text, response_format="wav")
    received = b""
    try:
        with client.with_options(timeout=WAIT).audio.speech.with_streaming_response.create(
            **request, extra_body={"seed": 1, "max_frames": FRAMES, "stream": True}
        ) as response:
            assert response.headers["content-type"] == "audio/wav" and "content-length" not in response.headers
            reads = response.iter_bytes()
            while len(received) <= 44:  # the header, then samples of the first piece
                received += next(reads)
            assert first_made.is_set() and sum(map(bool, made)) == 1, f"the engine was not held: it made {made}"
            opened.set()
            received += b"".join(reads)
    finally:
        opened.set()
    assert received[:4] == b"RIFF" and received[4:8] == b"\xff\xff\xff\xff"
    assert received[40:44] == b"\xff\xff\xff\xff"
    samples = np.frombuffer(received[44:], dtype="<i2")
    assert samples.shape == whole.shape and np.abs(samples.astype(int) - whole).max() <= 1
    # one frame first, then a piece every 4 frames, made only once the client had the first's samples
    assert made[0] == 2 * (1920 - 1200) and len(made) >= 3, made  # the crossfade holds 50 ms back until the next


def test_bad_requests_get_openai_errors_saying_what_to_send(served):
    url, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    good = {"model": "tiny", "input": "Hi.", "voice": "vivian", "max_frames": 3}
    cases = [
        ({"voice": "alloy"}, 400, "voice", "choose aiden, dylan"),
        ({"response_format": "aac"}, 400, "response_format", "choose 'wav', 'pcm', 'flac', 'mp3' or 'opus'"),
        ({"input": "   "}, 400, "input", "`input` is empty"),
        ({"speed": 5}, 400, "speed", "`speed` must be at least 0.25 and at most 4.0, got 5"),
        ({"temperature": -1}, 400, "temperature", "`temperature` must be at least 0"),
        ({"seed": "x"}, 400, "seed", "whole number"),
        ({"max_frames": 2.5}, 400, "max_frames", "whole number"),
        ({"max_frames": 48}, 400, "max_frames", "over this model's limit of 47 frames"),
        ({"language": "klingon"}, 400, None, "klingon"),
        ({"stream_format": "text"}, 400, "stream_format", "choose 'audio' or 'sse'"),
        ({"stream_format": "sse", "stream": False}, 400, "stream", "leave `stream` out or true"),
        ({"response_format": "flac", "stream": True}, 400, "response_format", "flac is not streamed here"),
        ({"response_format": "mp3", "stream": True}, 400, "response_format", "ask for wav or pcm to stream"),
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
        whole = http.post("/v1/audio/speech", json=good)  # its figures in its headers
        samples, rate = soundfile.read(io.BytesIO(whole.content))
        assert whole.status_code == 200 and whole.headers["x-sample-rate"] == str(rate) == "24000"
        assert float(whole.headers["x-audio-seconds"]) == round(len(samples) / rate, 3)
        assert float(whole.headers["x-real-time-factor"]) > 0 and 1 <= float(whole.headers["x-codes-per-call"]) <= 15
    for wrong in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        response = httpx.post(url + "/v1/audio/speech", json=good, headers=wrong)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/voices", headers=wrong).status_code == 401
    health = httpx.get(url + "/health").json()  # open: for a load balancer
    assert health["status"] == "ok" and health["peak_rss_mib"] >= health["rss_mib"] > 100
    caches = health["caches_mib"]  # requests were served: the loops' caches are held
    assert caches["talker_kv"] > 0 and caches["predictor_kv"] > 0 and sum(caches.values()) < health["rss_mib"]


def test_server_sent_events_carry_the_streamed_audio(served, client):
    """`stream_format: "sse"` through the openai package: OpenAI's events, a speech.audio.delta per piece whose
    base64 bytes, joined, are the body the same request streams as audio, then speech.audio.done with the request's
    figures (the page shows them), its audio seconds those of the samples sent."""
    url, _ = served
    body = {"input": "Hello there, streamed as events.", "voice": "vivian", "seed": 2, "max_frames": FRAMES}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT) as http:
        audio = http.post("/v1/audio/speech", json={**body, "response_format": "pcm", "stream": True})
    with client.audio.speech.with_streaming_response.create(
        model="tiny",
        voice="vivian",
        input=body["input"],
        response_format="pcm",
        stream_format="sse",
        extra_body={"seed": 2, "max_frames": FRAMES},
    ) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        assert events.headers["x-sample-rate"] == "24000"
        text = events.read().decode()
    parsed = [json.loads(line.removeprefix("data: ")) for line in text.split("\n\n") if line]
    deltas = [event for event in parsed if event["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and parsed[-1]["type"] == "speech.audio.done" and len(parsed) == len(deltas) + 1
    assert b"".join(base64.b64decode(event["audio"]) for event in deltas) == audio.content and audio.content
    stats = parsed[-1]["stats"]
    assert stats["sample_rate"] == 24000 and stats["audio_seconds"] == round(len(audio.content) / 2 / 24000, 3)
    assert 0 < stats["first_audio_seconds"] <= stats["seconds"] and stats["real_time_factor"] > 0
    assert 1 <= stats["codes_per_call"] <= 15


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

    served_before = engine.accounting.counts["served"]
    shares = [jobs[n::8] for n in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(client_run, shares))
    for share, bodies in zip(shares, answers):
        for job, body in zip(share, bodies):
            assert body == expected[job], job
    settled(engine)
    assert engine.accounting.counts["served"] - served_before == 16 and engine.accounting.counts["failed"] == 0


def test_a_client_gone_mid_stream_frees_its_row_for_a_waiting_request(tiny_dir, monkeypatch):
    """Two rows, two long streams and a request waiting: the client of the first hangs up after its first piece, and
    its row goes to the waiting request at the next frame, which shares calls with the second stream before that ends
    (frames slowed to 10 ms, so the second stream outlasts the hang-up by 0.4 s at least); without the stop, the
    waiting request would have had to wait for both streams to end (they end together) and would speak alone."""
    from rvqtts.engine.loop.frame_loop import FrameLoop

    inner_loop = FrameLoop._inner_loop

    def slowed(self, prefixes, ready):
        time.sleep(0.01)
        return inner_loop(self, prefixes, ready)

    monkeypatch.setattr(FrameLoop, "_inner_loop", slowed)
    long = {"input": "A long utterance. " * 5, "voice": "vivian", "stream": True, "max_frames": 47}
    with running(tiny_dir, batch_size=2) as (url, engine):
        gate = Gate(engine, monkeypatch)
        with httpx.Client(base_url=url, timeout=WAIT) as http, ThreadPoolExecutor(2) as pool:
            try:
                with http.stream("POST", "/v1/audio/speech", json={**long, "seed": 1}) as gone:
                    gate.wait_entered("the first stream")
                    other = pool.submit(lambda: httpx.post(url + "/v1/audio/speech", json=long, timeout=WAIT))
                    wait_until(lambda: engine.health()["queued"] == 1, WAIT, "the second stream to queue")
                    waiting = pool.submit(
                        lambda: httpx.post(url + "/v1/audio/speech", json={**long, "stream": False}, timeout=WAIT)
                    )
                    wait_until(lambda: engine.health()["queued"] == 2, WAIT, "a third request to queue")
                    gate.opened.set()
                    next(gone.iter_bytes())  # the header and first samples, then the client hangs up
            finally:
                gate.opened.set()
            assert other.result().status_code == waiting.result().status_code == 200
        settled(engine)
    assert engine.accounting.counts["cancelled"] == 1 and engine.accounting.counts["served"] == 2
    assert engine.accounting.counts["batched"] == 2  # the second stream and the request that took the first's row


def test_a_flood_gets_503_with_retry_after_and_the_server_keeps_serving(tiny_dir, monkeypatch):
    """With the engine held on one request and a second in its queue of 1, each of 10 concurrent requests is
    refused at once; once the engine is let go, both held requests are answered and the server serves on."""
    body = {"input": "Flood.", "voice": "vivian", "max_frames": FRAMES}
    with running(tiny_dir, queue_size=1) as (url, engine):

        def post(_: int, timeout: float = WAIT) -> httpx.Response | None:
            try:
                return httpx.post(url + "/v1/audio/speech", json=body, timeout=timeout)
            except httpx.TimeoutException:  # queued although the queue was full: the engine is held
                return None

        gate = Gate(engine, monkeypatch)
        with ThreadPoolExecutor(12) as pool:
            try:
                held = [pool.submit(post, 0)]
                gate.wait_entered("the first request")
                held.append(pool.submit(post, 0))
                wait_until(lambda: engine.health()["queued"] == 1, WAIT, "a second request to fill the queue of 1")
                flood = list(pool.map(lambda n: post(n, timeout=10), range(10)))
            finally:
                gate.opened.set()
            answered = [future.result() for future in held]
        assert all(r is not None and r.status_code == 503 for r in flood), [r and r.status_code for r in flood]
        assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "server_busy" for r in flood)
        assert [r.status_code for r in answered] == [200, 200], [r.text for r in answered]
        assert answered[0].content == answered[1].content  # the same seed's audio
        assert post(0).content == answered[0].content and engine.accounting.counts["refused_busy"] == len(flood)


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


def test_a_voice_uploaded_over_the_api_speaks_as_synth_ref_audio_and_can_be_deleted(base_dir, tmp_path):
    """POST /v1/audio/voices with a recording and its transcript: the voice speaks what `synth --ref-audio` speaks
    (the same bytes); it is listed until it is deleted. Bad names, recordings and forms get 400, 409, 413 or 415
    saying why, a form from another site 403, and nothing is written for them."""
    voices = tmp_path / "voices"
    voices.mkdir()
    rate, samples = 24000, np.random.default_rng(1).standard_normal(36000).astype(np.float32) * 0.1
    soundfile.write(tmp_path / "ref.wav", samples, rate)
    recording = (tmp_path / "ref.wav").read_bytes()
    text = "A reference sentence."
    out, options = tmp_path / "synth.wav", ("--seed", 5, "--max-frames", 6, "--dtype", "float32", "-q")
    made = run_cli("synth", "Hello.", "--model", base_dir, "--ref-audio", tmp_path / "ref.wav", "--ref-text", text,
                   "-o", out, *options)  # fmt: skip
    assert made.exit_code == 0, made.output

    def upload(name="bea", audio=recording, **fields):
        form = {"name": name, **fields}
        return httpx.post(url + "/v1/audio/voices", files={"audio_sample": ("ref.wav", audio)}, data=form, timeout=60)

    with running(base_dir, voices_dir=voices) as (url, _):
        added = upload(ref_text=text)
        assert added.status_code == 200 and added.json() == {"object": "voice", "name": "bea", "mode": "icl",
                                                            "seconds": 1.5}, added.text  # fmt: skip
        assert httpx.get(url + "/v1/audio/voices").json()["voices"] == httpx.get(url + "/v1/voices").json()["voices"]
        body = {"input": "Hello.", "voice": "bea", "seed": 5, "max_frames": 6}
        assert httpx.post(url + "/v1/audio/speech", json=body, timeout=60).content == out.read_bytes()
        silent, short = audio_bytes(np.zeros(rate, np.float32), rate), audio_bytes(samples[: rate // 2], rate)
        refused = {
            409: upload(),
            400: [upload("../x"), upload("b", b"not audio"), upload("c", silent), upload("d", short)],
            413: upload("e", recording + bytes(10 << 20)),
            415: httpx.post(url + "/v1/audio/voices", json={"name": "f"}),
            403: httpx.post(
                url + "/v1/audio/voices",
                files={"audio_sample": ("r.wav", recording)},
                data={"name": "g"},
                headers={"origin": "https://elsewhere.example"},
            ),  # fmt: skip
        }
        for status, responses in refused.items():
            for response in responses if isinstance(responses, list) else [responses]:
                assert response.status_code == status and response.json()["error"]["message"], response.text
        messages = [response.json()["error"]["message"] for response in refused[400]]
        assert "1 to 64 letters" in messages[0] and "cannot read 'ref.wav' as audio (Format" in messages[1], messages
        assert "silent" in messages[2] and "0.50 s long" in messages[3] and "/tmp" not in "".join(messages)
        assert sorted(p.name for p in voices.iterdir()) == ["bea.safetensors"]
        assert httpx.delete(url + "/v1/audio/voices/bea").json() == {"object": "voice", "name": "bea", "deleted": True}
        assert httpx.delete(url + "/v1/audio/voices/bea").status_code == 404
        assert httpx.get(url + "/v1/audio/voices").json()["voices"] == [] and not list(voices.iterdir())
        again = upload(audio=audio_bytes(samples[::-1].copy(), rate))  # another voice of the same name: read anew
        assert again.json()["mode"] == "x-vector-only"
        assert httpx.post(url + "/v1/audio/speech", json=body, timeout=60).content != out.read_bytes()


def test_serve_refuses_bad_options_before_loading(tiny_dir, tmp_path, monkeypatch):
    for arguments, message in [
        (["--voices", tmp_path], "--voices is for Base models"),
        (["--port", 0], "--port must be between"),
        (["--queue-size", 0], "--queue-size and --max-chars"),
        (["--wyoming-port", 8880], "--wyoming-port must be between 1 and 65535 and not --port (8880)"),
        (["--model", tmp_path / "none"], "none"),
    ]:
        result = run_cli("serve", "--model", tiny_dir, *arguments)
        assert result.exit_code == 2 and message in result.output, (arguments, result.output)
    monkeypatch.setitem(sys.modules, "wyoming", None)
    result = run_cli("serve", "--model", tiny_dir, "--wyoming-port", 10200)
    assert result.exit_code == 2 and "--wyoming-port needs the wyoming package" in result.output
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the extra were not installed
    result = run_cli("serve", "--model", tiny_dir)
    assert result.exit_code == 2 and "pip install -e '.[serve]'" in result.output


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics (without the key) parsed as Prometheus parses it: each sample's value by (name, labels)."""
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_requests_first_audio_frames_rows_and_memory(served, client):
    """A streamed and a whole request and a refused one, scraped before and after: requests by outcome, the
    histograms' counts (first audio for the streamed one only), frames made, rows, queue and resident memory."""
    url, engine = served
    before = scrape(url)
    with client.with_options(timeout=WAIT).audio.speech.with_streaming_response.create(
        model="tiny", voice="vivian", input="Counted, streamed.", extra_body={"max_frames": FRAMES, "stream": True}
    ) as response:
        response.read()
    speak(client, "Counted, whole.")
    assert httpx.post(url + "/v1/audio/speech", json={"input": "Hi."}).status_code == 401
    settled(engine)
    after = scrape(url)

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("rvqtts_requests_total", outcome="served") == 2 and grew("rvqtts_requests_total", outcome="failed") == 0
    assert grew("rvqtts_first_audio_seconds_count") == 1 and grew("rvqtts_request_seconds_count") == 2
    assert 0 < grew("rvqtts_first_audio_seconds_sum") <= grew("rvqtts_request_seconds_sum")
    assert 2 <= grew("rvqtts_frames_total") <= 2 * FRAMES and after[("rvqtts_frames_per_second", ())] > 0
    assert after[("rvqtts_rows", ())] == engine.options.batch_size and after[("rvqtts_queue_length", ())] == 0
    assert after[("rvqtts_rows_busy", ())] == 0 and after[("process_resident_memory_bytes", ())] > 100e6


def test_a_customvoice_server_takes_no_voice_uploads(served):
    url, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(url + "/v1/audio/voices", files={"audio_sample": ("r.wav", b"x")}, data={"name": "a"},
                          headers=headers)  # fmt: skip
    assert response.status_code == 400 and "only a Base model clones voices" in response.json()["error"]["message"]
    assert httpx.post(url + "/v1/audio/voices", data={"name": "a"}).status_code == 401


def test_the_load_test_reports_latencies_and_the_servers_memory_and_caches(served):
    from rvqtts.bench.serve import load_test, serve_table

    url, _ = served
    texts = ["A short line.", "Another one."]
    fields = {"voice": "vivian", "max_frames": 4}
    result = load_test(url, texts, requests=3, clients=2, api_key=KEY, fields=fields, stagger=0.2)
    assert result["requests"] == 3 and result["requests_per_minute"] > 0
    assert 0 < result["first_audio_p50"] <= result["total_p50"] <= result["total_p95"]
    split = result["first_audio_split"]  # the server's own account, within the client's first audio
    assert 0 < sum(split.values()) <= result["first_audio_p95"] and split["prefill"] > 0 and split["decoder"] > 0
    assert result["server_rss_mib_after"] > result["server_caches_mib_after"] > 0  # the loops' caches are held
    assert result["wall_seconds"] > 0.2 and "0.2 s apart" in str(serve_table(result).title)  # the second client waited
    assert "its caches MiB" in str(serve_table(result).columns[-1].header)


def test_streamed_and_whole_requests_share_rows_each_with_its_solo_audio(tiny_dir, measured, monkeypatch):
    """Streamed (audio and events) and whole requests with different texts, seeds and sampling settings, queued behind
    a held request, take rows beside it at its first frame (the kernels measured row-invariant): each whole body is,
    byte for byte, the one it gets alone, each streamed one its samples up to float rounding (the rows' pieces are
    decoded together); a streamed request's first piece is one frame."""
    from rvqtts.synthesis.batch_size import rows_invariant

    jobs = [
        {"input": "Another, longer line of text.", "seed": 1},
        {"input": "A streamed line.", "seed": 1, "stream": True, "response_format": "pcm"},
        {"input": "Another streamed one.", "seed": 2, "stream_format": "sse", "temperature": 0.7},
        {"input": "A whole one.", "seed": 3, "top_k": 10, "predictor_temperature": 1.1},
        {"input": "And a streamed WAV.", "seed": 4, "stream": True, "top_p": 0.8},
    ]
    with running(tiny_dir, batch_size=len(jobs) + 1) as (url, engine):
        assert rows_invariant(engine.synth)

        def post(job: dict) -> bytes:
            body = {"voice": "vivian", "max_frames": FRAMES, **job}
            response = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.content

        alone = [post(job) for job in jobs]
        settled(engine)
        assert engine.accounting.counts["batched"] == 0
        passes = []  # the streams of every pass of the speech decoder
        push_together = pipeline.push_together

        def counted(streams, codes):
            passes.append(len(streams))
            return push_together(streams, codes)

        monkeypatch.setattr(pipeline, "push_together", counted)
        gate = Gate(engine, monkeypatch)
        with ThreadPoolExecutor(len(jobs) + 1) as pool:
            try:
                holder = pool.submit(post, {"input": "Hold the engine.", "seed": 9, "stream": True})
                gate.wait_entered("the holder request")
                waiting = [pool.submit(post, job) for job in jobs]
                wait_until(lambda: engine.health()["queued"] == len(jobs), WAIT, "the requests to queue")
            finally:
                gate.opened.set()
            together = [future.result() for future in waiting]
            holder.result()
        settled(engine)
    for job, made, own in zip(jobs, together, alone):
        if job.get("stream") or job.get("stream_format"):  # pieces decoded together: its samples up to float rounding
            made_samples = streamed_samples(made, job.get("stream_format"))
            own_samples = streamed_samples(own, job.get("stream_format"))
            assert made_samples.shape == own_samples.shape and len(own_samples) > 1920
            assert np.abs(made_samples.astype(int) - own_samples).max() <= 1, job
        else:
            assert made == own, job
    assert max(passes) > 1  # the streamed rows' pieces were decoded together
    assert engine.accounting.counts["batched"] == len(jobs) + 1 and engine.accounting.counts["failed"] == 0
    header, first = (json.loads(event.removeprefix(b"data: ")) for event in alone[2].split(b"\n\n")[:2])
    assert base64.b64decode(header["audio"]).startswith(b"RIFF")
    assert len(base64.b64decode(first["audio"])) == 2 * (1920 - 1200)  # one frame, less the crossfade's 50 ms


SPEECH_FIELDS = [
    "input",
    "voice",
    "response_format",
    "stream",
    "stream_format",
    "speed",
    "seed",
    "language",
    "instruct",
    "instructions",
    "model",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "max_frames",
    "predictor_temperature",
    "predictor_top_k",
    "predictor_top_p",
]  # fmt: skip  (docs/server.md, "The request")


def test_the_api_description_is_valid_openapi_and_names_what_the_parser_takes(served):
    """GET /openapi.json (open, without the key) is a valid OpenAPI 3.1 document whose request schema names every
    field of docs/server.md's table and states the ranges the parser refuses outside of."""
    from openapi_spec_validator import validate

    url, _ = served
    document = httpx.get(url + "/openapi.json").json()
    validate(document)
    schemas = document["components"]["schemas"]
    assert set(schemas["SpeechBody"]["properties"]) == set(SPEECH_FIELDS)
    assert set(schemas["VoiceForm"]["properties"]) == {"name", "audio_sample", "ref_text"}
    speed = schemas["SpeechBody"]["properties"]["speed"]["anyOf"][0]
    headers = {"Authorization": f"Bearer {KEY}"}
    for value, refused in ((speed["maximum"], False), (speed["maximum"] + 0.01, True), (speed["minimum"] - 0.01, True)):
        body = {"input": "Hi.", "voice": "vivian", "max_frames": 2, "speed": value}
        response = httpx.post(url + "/v1/audio/speech", json=body, headers=headers, timeout=WAIT)
        assert (response.status_code == 400) == refused, (value, response.text[:200])
    assert {"/v1/audio/speech", "/v1/audio/voices", "/v1/audio/voices/{name}"} <= set(document["paths"])
    assert document["security"] == [{"key": []}]  # the served fixture has a key


def test_no_malformed_request_gets_a_server_error(served):
    """A seeded fuzz over the request's fields (types, ranges, sizes, unknown fields): every answer is a 200, 400 or
    413 with OpenAI's error body, and the connection stays whole."""
    url, engine = served
    rng = np.random.default_rng(45)
    good = {"input": "Hi.", "voice": "vivian", "max_frames": 2}
    values = [
        None, True, False, 0, -1, 1, 2, 47, 48, 10**12, -(10**12), 2**63, 0.5, -0.5, 1e308, float("inf"), "", " ",
        "x", "wav", "sse", "audio", "vivian", "auto", "x" * 300, [], [1], {}, {"id": "vivian"}, {"id": 3}, float("nan"),
    ]  # fmt: skip
    names = [*SPEECH_FIELDS, "unknown"]
    statuses = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT) as http:
        for _ in range(500):
            body = dict(good)
            for name in rng.choice(names, size=rng.integers(1, 4), replace=False):
                body[str(name)] = values[rng.integers(len(values))]
            if rng.random() < 0.05:
                body = values[rng.integers(len(values))]  # not an object at all
            content = json.dumps(body).encode()  # inf and nan as JSON's extensions, as a careless client sends them
            response = http.post("/v1/audio/speech", content=content, headers={"content-type": "application/json"})
            statuses.append(response.status_code)
            assert response.status_code in (200, 400, 413), (body, response.status_code, response.text[:300])
            if response.status_code != 200:
                assert response.json()["error"]["type"] == "invalid_request_error", body
    settled(engine)
    assert engine.accounting.counts["failed"] == 0 and 20 < statuses.count(200) < 480  # both kinds were tried


def test_text_in_pieces_over_a_websocket_is_spoken_sentence_by_sentence(served):
    """An LLM's words as they come: each sentence is spoken once it is whole (its audio arrives before the rest of
    the text is sent) and is, byte for byte, the streamed PCM of a request with the session's fields; the text left
    at the end is spoken on `done`; a bad session or message gets an error event and the session goes on."""
    from websockets.sync.client import connect

    url, engine = served
    session = {"voice": "vivian", "seed": 5, "max_frames": FRAMES}
    received: list[object] = []

    errors: list[dict] = []

    def until(kind: str) -> None:
        while not received or received[-1] != kind:
            message = ws.recv(timeout=WAIT)
            event = None if isinstance(message, bytes) else json.loads(message)
            received.append(message if event is None else event["type"])
            if event and event["type"] == "error":
                errors.append(event)

    address = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(address, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "session", **session, "voice": "alloy"}))  # refused: the session goes on
        ws.send(json.dumps({"type": "session", **session}))
        ws.send(json.dumps({"type": "text", "text": "Hello the"}))
        ws.send(json.dumps({"type": "text", "text": "re. How are"}))
        until("sentence.done")  # the first sentence, spoken before any more text came
        ws.send("not json")
        for piece in (" you", " today? Fi", "ne"):
            ws.send(json.dumps({"type": "text", "text": piece}))
        ws.send(json.dumps({"type": "done"}))
        until("done")
    assert [e["error"]["param"] for e in errors] == ["voice", None] and "send JSON messages" in str(errors[1])
    events = [item for item in received if isinstance(item, str) and item != "error"]
    assert events == ["sentence", "sentence.done"] * 3 + ["done"]
    audio, pieces = [], []
    for item in received:
        if item == "sentence":
            pieces = []
        elif item == "sentence.done":
            audio.append(b"".join(pieces))
        elif isinstance(item, bytes):
            pieces.append(item)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT) as http:
        for sentence, spoken in zip(["Hello there.", "How are you today?", "Fine"], audio):
            body = {**session, "input": sentence, "stream": True, "response_format": "pcm"}
            assert spoken and http.post("/v1/audio/speech", json=body).content == spoken, sentence
    with pytest.raises(Exception, match="403"):  # no key: refused at the handshake
        connect(address).close()
