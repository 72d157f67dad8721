"""A first run is an ordinary run: on an empty measurement cache (kernels, the decoder's dtype, batch sizes and call
costs all measured in the process that then speaks), every checkpoint variant `make-tiny-model` builds speaks a
batch and a line in float32 and bfloat16, and what it speaks is what a run from the cached measurements speaks.

Before the fix, the batch-size measurement left its eight rows' layouts on a runner whose caches it had shrunk to
one row: the next batch wrote past them (IndexError in torch, heap corruption in the native kernels)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from rvqtts.qwen.cloning import VoiceSource
from rvqtts.support.measurements import BATCH_SIZES
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.synthesizer import Synthesizer

FRAMES = 10
TEXTS = ("Cluster line one, spoken slowly.", "A second line.", "Line three is here.", "And a fourth one.")
VARIANTS = {  # make-tiny-model's kinds, codebooks and layouts, each by its fixture (tests/conftest.py)
    "custom-voice": "tiny_dir",
    "base": "base_dir",
    "voice-design": "voice_design_dir",
    "codebook-16": "narrow_dir",
    "codebook-8-groups-4": "small_dir",
    "0.6b": "released_06_dir",
}


def lines_for(synth: Synthesizer, tmp_path) -> list[Line]:
    """The test's lines in a voice the model's kind takes: a speaker, a cloned voice or a described one."""
    if synth.kind == "base":
        reference = tmp_path / "reference.wav"
        soundfile.write(reference, np.random.default_rng(0).normal(0, 0.1, 24000).astype(np.float32), 24000)
        voice = {"clone": VoiceSource(ref_audio=reference, x_vector_only=True)}
    elif synth.kind == "voice_design":
        voice = {"instruct": "A calm, low voice."}
    else:
        voice = {"speaker": synth.speakers[0]}
    return [Line(text=text, **voice) for text in TEXTS]


def speak(synth: Synthesizer, lines: list[Line]) -> list[np.ndarray]:
    """Every line's audio, the batch size chosen as `rvqtts synth -f` chooses it (measured where not cached)."""
    results = dict(synth.synthesize_many(lines, seed=6, settings=GenerationSettings(max_frames=FRAMES)))
    for index, result in results.items():
        assert not isinstance(result, Exception), f"line {index} failed: {result!r}"
    return [results[i].audio for i in range(len(lines))]


# Every variant in both dtypes, the released widths in bfloat16 only. The default variant starts from nothing at all;
# the others from the kernels the test run has measured (`measured`: timing a variant's kernels from nothing takes
# 5-30 s a dtype on two vCPUs, and the tiny kinds share their shapes), so what they measure first is the decoder's
# dtype, the batch size and the online choice's call costs, where the bugs were.
CASES = [
    (variant, dtype)
    for variant in VARIANTS
    for dtype in ("float32", "bfloat16")
    if (variant, dtype) != ("0.6b", "float32")
]


@pytest.mark.parametrize("variant, dtype", CASES)
def test_a_first_batch_on_an_empty_cache_speaks_what_a_cached_run_speaks(
    variant, dtype, request, user_cache, monkeypatch, tmp_path
):
    if variant != "custom-voice":
        request.getfixturevalue("measured")
    monkeypatch.setenv("RVQTTS_CHOICES", "measured")
    monkeypatch.setattr("rvqtts.engine.model.kernels._chosen", {})  # nothing chosen in this process either
    folder = request.getfixturevalue(VARIANTS[variant])
    first = Synthesizer.load(folder, EngineChoices(dtype=dtype))
    lines = lines_for(first, tmp_path)
    measured = speak(first, lines)
    assert (user_cache / "batch-sizes.json").exists(), "the batch size was not measured in this run"
    alone = first.synthesize_many(lines[:1], seed=6, settings=GenerationSettings(max_frames=FRAMES))
    assert np.array_equal(next(alone)[1].audio, measured[0]), "a line after the first batch differs from its row's"
    cached = speak(Synthesizer.load(folder, EngineChoices(dtype=dtype)), lines)
    for index, (audio, again) in enumerate(zip(measured, cached)):
        assert np.array_equal(audio, again), f"line {index}: the first run's audio differs from a cached run's"


def test_the_command_line_first_batch_on_an_empty_cache_exits_cleanly(narrow_dir, user_cache, tmp_path):
    """The whole command, as a user runs it first (a process of its own: heap corruption would crash it, where the
    tests above would see an exception), on the codebook the decoder's dtype measurement used to index past."""
    texts = tmp_path / "lines.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    command = [sys.executable, "-m", "rvqtts.cli", "synth", "--model", narrow_dir]
    command += ["--seed", "6", "--max-frames", FRAMES, "-f", texts, "--out-dir", tmp_path / "out"]
    environment = {**os.environ, "RVQTTS_CHOICES": "measured"}  # as users run (the tests' default is fixed)
    run = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=300, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").glob("*.wav")) == [f"{i:04d}.wav" for i in range(1, 5)]
    learned = json.loads((user_cache / "acceptance-online.json").read_text())  # saved as the process exited
    assert len(learned) == 1 and next(iter(learned.values()))["reached"][0] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_first_server_measures_at_start_and_serves_its_first_requests(tiny_dir, user_cache, measured, dtype):
    """`rvqtts serve` as a user first starts it: what it measures at start (the decoder's dtype, --batch-size auto,
    the online tree choice's call costs) measured in the process that then serves, and the first requests (two at
    once, sharing rows) served; the server is ready after them. The kernels come from the test run's cache (the
    tests above measure them from nothing: at the tiny shapes in float32 that alone takes 15-45 s here)."""
    import socket

    import httpx
    from helpers import wait_until

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "rvqtts.cli", "serve", "--model", tiny_dir, "--dtype", dtype, "--port", port]
    server = subprocess.Popen(list(map(str, command)), stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert server.poll() is None, f"the server exited: {server.stderr.read()[-3000:]}"
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, 240, "the server to be ready")
        body = {"voice": "vivian", "max_frames": FRAMES, "seed": 6}
        with httpx.Client(timeout=120) as client:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                answers = list(
                    pool.map(lambda t: client.post(f"{url}/v1/audio/speech", json={**body, "input": t}), TEXTS[:2])
                )
            for answer in answers:
                assert answer.status_code == 200 and len(answer.content) > 1000, answer.text[:500]
            assert client.get(f"{url}/ready").status_code == 200
        assert (user_cache / "batch-sizes.json").exists(), "the server did not measure its batch size"
        server.terminate()  # SIGTERM, as a service manager stops it
        assert server.wait(30) in (0, -signal.SIGTERM)
        learned = json.loads((user_cache / "acceptance-online.json").read_text())  # kept at shutdown
        assert len(learned) == 1 and next(iter(learned.values()))["reached"][0] > 0
    finally:
        server.kill()
        server.wait(30)


def synth_with_cache(model, cache, arguments: list) -> subprocess.CompletedProcess:
    """`rvqtts synth --model model *arguments` with RVQTTS_CACHE at `cache`. The choices are fixed, as in every test
    here but the first-run ones (measuring them takes a minute): what the run writes into the cache is then the
    native kernels' build, which goes to a folder of the process's own."""
    command = [sys.executable, "-m", "rvqtts.cli", "synth", "--model", model, "--max-frames", FRAMES, *arguments]
    environment = {**os.environ, "RVQTTS_CACHE": str(cache)}
    return subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=120, env=environment)


def assert_spoken_with_one_warning(run: subprocess.CompletedProcess, files: list, folder) -> None:
    """The run spoke every file, with the native kernels, said once that the cache cannot be written (naming
    `folder` and RVQTTS_CACHE), and raised nothing."""
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert all(soundfile.info(file).frames > 0 for file in files)
    assert "native CPU kernels do not run" not in run.stderr, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "RVQTTS_CACHE" in line]
    assert len(warnings) == 1 and "cannot be written" in warnings[0] and str(folder) in warnings[0], run.stderr


def test_a_cache_under_a_file_is_done_without_with_one_warning(tiny_dir, tmp_path):
    """RVQTTS_CACHE under a regular file (NotADirectoryError, as root too): a batch speaks, measuring in memory."""
    blocker, texts = tmp_path / "file", tmp_path / "lines.txt"
    blocker.write_text("x")
    texts.write_text("\n".join(TEXTS[:2]) + "\n")
    run = synth_with_cache(tiny_dir, blocker / "cache", ["-f", texts, "--out-dir", tmp_path / "out"])
    assert_spoken_with_one_warning(run, [tmp_path / "out" / f"000{i}.wav" for i in (1, 2)], blocker / "cache")


def test_a_read_only_cache_is_done_without_with_one_warning(tiny_dir, tmp_path):
    """RVQTTS_CACHE a folder the user cannot write (as in a container with a read-only file system): a line speaks."""
    cache = tmp_path / "cache"
    cache.mkdir(0o500)
    if os.access(cache, os.W_OK):
        pytest.skip("this user (root) writes into a read-only folder")
    run = synth_with_cache(tiny_dir, cache, ["Hi.", "-o", tmp_path / "out.wav"])
    assert_spoken_with_one_warning(run, [tmp_path / "out.wav"], cache)


def test_measurements_an_unwritable_cache_refuses_are_kept_for_the_process(tmp_path, monkeypatch, capsys):
    """What a process measures with no cache to keep it in is read back by that process (not measured again), and
    the user is warned once, not once a write."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("RVQTTS_CACHE", str(blocker / "cache"))
    monkeypatch.setattr("rvqtts.support.files._UNSAVED", {})
    monkeypatch.setattr("rvqtts.support.files._warned", False)
    for machine in ("one", "two"):
        with BATCH_SIZES.update() as records:
            records[machine] = {"1": 1.0}
    assert BATCH_SIZES.read() == {"one": {"1": 1.0}, "two": {"1": 1.0}}
    assert BATCH_SIZES.kept == "kept for this run only"
    assert capsys.readouterr().err.count("RVQTTS_CACHE") == 1
