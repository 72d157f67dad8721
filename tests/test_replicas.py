"""Replicas: two `rvqtts serve` processes (as behind a load balancer) sharing one --voices folder on the tiny Base
checkpoint. An upload on one is spoken by the other; a delete on one is a 404 on the other; a voice deleted and
uploaded again under its name is the new voice on both; two uploads of one name at once give one 200 and one 409;
nothing half-written is left in the folder. docs/server.md, "Replicas"."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import numpy as np
import pytest
import soundfile
from helpers import server_process, wait_until

WAIT = 120  # seconds: a server's start (the tiny model loaded) or a voice's encoding on two busy vCPUs
pytestmark = pytest.mark.timeout(400)


def recording(seed: int) -> bytes:
    """1.5 s of noise as a WAV file: a recording the tiny Base model encodes (x-vector only, without a transcript)."""
    samples = np.random.default_rng(seed).standard_normal(36000).astype(np.float32) * 0.1
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, 24000, format="WAV")
    return buffer.getvalue()


def upload(url: str, name: str, audio: bytes, **fields: str) -> httpx.Response:
    files = {"audio_sample": ("ref.wav", audio)}
    return httpx.post(url + "/v1/audio/voices", files=files, data={"name": name, **fields}, timeout=WAIT)


def speak(url: str, voice: str) -> httpx.Response:
    body = {"input": "Hello.", "voice": voice, "seed": 5, "max_frames": 6}
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=WAIT)


def test_two_servers_share_one_voices_folder(base_dir, tmp_path):
    voices = tmp_path / "voices"
    voices.mkdir()
    with ExitStack() as stack:
        (first, first_ready, _), (second, second_ready, _) = (
            stack.enter_context(server_process(base_dir, "--voices", str(voices))) for _ in "ab"
        )
        wait_until(lambda: first_ready() and second_ready(), WAIT, "both servers to load")
        with ThreadPoolExecutor(2) as pool:  # one name, two uploads at once: the file system picks one
            racing = list(pool.map(lambda url: upload(url, "bea", recording(1)), (first, second)))
        assert sorted(response.status_code for response in racing) == [200, 409], [r.text for r in racing]
        conflict = next(response for response in racing if response.status_code == 409)
        assert conflict.json()["error"]["code"] == "voice_exists"
        spoken = speak(second, "bea")
        assert spoken.status_code == 200 and spoken.content == speak(first, "bea").content  # the same voice file
        assert httpx.delete(second + "/v1/audio/voices/bea").status_code == 200
        assert httpx.delete(first + "/v1/audio/voices/bea").status_code == 404
        gone = speak(first, "bea")
        assert gone.status_code == 400 and "not served" in gone.json()["error"]["message"]
        renewed = upload(first, "bea", recording(2), ref_text="A reference sentence.")  # another voice, same name
        assert renewed.status_code == 200 and renewed.json()["mode"] == "icl"
        again = speak(second, "bea")  # the second server read the old file once: it reads the new one
        assert again.status_code == 200 and again.content == speak(first, "bea").content != spoken.content
        assert sorted(path.name for path in voices.iterdir()) == ["bea.safetensors"]  # nothing half-written left
