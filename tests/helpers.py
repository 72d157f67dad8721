"""Helpers shared by the tests."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from typer.testing import CliRunner

from rvqtts.cli import app
from rvqtts.serving.app import create_app, uvicorn_settings
from rvqtts.serving.engine import SpeechEngine
from rvqtts.serving.options import ServerOptions
from rvqtts.support.audio import CROSSFADE_SECONDS, StreamJoiner
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.calibration import sample_codes
from rvqtts.tuning.contexts import Contexts

# A record's timing fields: what two runs of the same line may differ in.
TIMINGS = {
    "wall_seconds",
    "talker_seconds",
    "predictor_seconds",
    "decoder_seconds",
    "prefill_seconds",
    "first_audio_seconds",
    "first_audio_split",
    "inner_loop_ms_by_part",
    "rtf",
}


def streamed_samples(body: bytes, stream_format: str | None = None) -> np.ndarray:
    """The 16-bit samples of a streamed response: raw PCM, a WAV stream's after its header, or (`sse`) its events'
    audio."""
    if stream_format == "sse":
        events = [json.loads(event.removeprefix(b"data: ")) for event in body.split(b"\n\n") if event]
        body = b"".join(base64.b64decode(event["audio"]) for event in events if event["type"] == "speech.audio.delta")
    return np.frombuffer(body[44:] if body.startswith(b"RIFF") else body, dtype=np.int16)


def run_cli(*arguments: object):
    """`rvqtts ARGUMENTS...` in process; the result has exit_code and output (stderr included)."""
    return CliRunner().invoke(app, [*map(str, arguments)])


def wait_until(predicate: Callable[[], object], seconds: float, what: str) -> object:
    """Poll `predicate` until it is true and return its value; fail the test, saying `what` it waited for, if
    `seconds` pass first. Every wait in the tests has such a deadline: none can hang the run."""
    deadline = time.monotonic() + seconds
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds:g} s for {what}", pytrace=False)
        time.sleep(0.01)
    return value


SERVER_WAIT = 60  # seconds a server may take to start listening


@contextmanager
def serving(model_dir: Path, send_buffer: int | None = None, **options) -> Iterator[tuple[str, SpeechEngine, object]]:
    """A server on a free loopback port over `model_dir` in float32, set up as `rvqtts serve --dtype float32`
    sets it up, in this process; yields its base URL, engine and uvicorn server (`should_exit` stops it, as SIGTERM
    does), and stops it. `send_buffer`: its connections' socket send buffer in bytes (a small one makes a client that
    stops reading felt at once); `options`: ServerOptions' fields."""
    synth = Synthesizer.load(model_dir, EngineChoices(dtype="float32"))
    engine = SpeechEngine(synth, ServerOptions(model_dir.name, **options))
    config = uvicorn.Config(create_app(engine), log_level="warning", **uvicorn_settings(engine.options))
    server = uvicorn.Server(config)
    sock = socket.socket()
    if send_buffer:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), SERVER_WAIT, "uvicorn to start listening")
    assert server.started, "uvicorn stopped before it started: its log says why"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine, server
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(model_dir: Path, *options: str) -> Iterator[tuple[str, Callable[[], bool], subprocess.Popen]]:
    """`rvqtts serve` in its own process (float32, quiet) with `options`; yields its URL, a check that it is ready
    (/ready answers; failing, with its output, where the process has ended) and the process, and stops it."""
    port = free_port()
    command = [sys.executable, "-c", "from rvqtts.cli import app; app()", "serve", "--model", str(model_dir)]
    options = (*options, "--port", str(port), "--dtype", "float32", "-q")
    server = subprocess.Popen([*command, *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(url + "/ready").status_code == 200
        except httpx.TransportError:
            assert server.poll() is None, server.stdout.read().decode()
            return False

    try:
        yield url, ready, server
    finally:
        server.kill()
        server.wait(30)


@contextmanager
def running(model_dir: Path, send_buffer: int | None = None, **options) -> Iterator[tuple[str, SpeechEngine]]:
    """`serving`'s server: yields its base URL and engine."""
    with serving(model_dir, send_buffer, **options) as (url, engine, _):
        yield url, engine


def join_chunks(parts: list[np.ndarray], sample_rate: int, crossfade: float = CROSSFADE_SECONDS) -> np.ndarray:
    """The chunk waveforms joined whole by a `StreamJoiner` (offline synthesis joins its chunks with one too)."""
    joiner = StreamJoiner(sample_rate, crossfade)
    for part in parts:
        joiner.add(part, new_part=True)
    joiner.finish()
    return joiner.audio()


def run_cli_json(out: Path, *arguments: object):
    """`rvqtts ARGUMENTS... --json OUT`, which must succeed: the result and the JSON it wrote."""
    result = run_cli(*arguments, "--json", out)
    assert result.exit_code == 0, result.output
    return result, json.loads(Path(out).read_text())


def random_prefix(synth: Synthesizer, seed: int) -> torch.Tensor:
    """A frame context [h_t, embedding of c0] like the talker hands over."""
    generator = torch.Generator().manual_seed(seed)
    talker = synth.model.talker
    h_t = torch.randn(1, talker.config.hidden_size, generator=generator)
    c0 = torch.randint(0, synth.code_predictor.config.vocab_size, (1,), generator=generator)
    with torch.no_grad():
        return torch.cat([h_t, talker.get_input_embeddings()(c0)])


DECODE_SEED = 7  # the seed of decode_frames' noise (utterance 0, frame f)


def frame_prefixes(synth: Synthesizer, frames: int) -> list[torch.Tensor]:
    """decode_frames' frame contexts: random_prefix(seed = f) in the code predictor's dtype."""
    dtype = synth.code_predictor.lm_head[0].weight.dtype
    return [random_prefix(synth, seed=f).to(dtype) for f in range(frames)]


def frame_noises(synth: Synthesizer, frames: int) -> list[torch.Tensor]:
    """The noise decode_frames draws frame f's codes with (its InnerLoop's, seed DECODE_SEED)."""
    from rvqtts.engine.model.sampling import residual_noise

    config = synth.code_predictor.config
    return [residual_noise(DECODE_SEED, 0, f, config.num_code_groups, config.vocab_size) for f in range(frames)]


def decode_frames(synth: Synthesizer, speculation, frames: int, calls=None) -> tuple[np.ndarray, object]:
    """The inner loop's codes [frames, G-1] over `frame_prefixes` with SamplingConfig() and its statistics; `calls`
    replaces its static calls (e.g. emulated CUDA graphs)."""
    from rvqtts.engine.loop.inner_loop import InnerLoop
    from rvqtts.engine.model.sampling import SamplingConfig

    loop = InnerLoop(synth.code_predictor, speculation, seed=DECODE_SEED)
    if calls is not None:
        loop.calls = calls
    codes = [loop.frame(prefix, SamplingConfig(), 0, f) for f, prefix in enumerate(frame_prefixes(synth, frames))]
    return np.array(codes), loop.stats


def stock_path_logits(code_predictor, prefix: torch.Tensor, codes: list[int]) -> torch.Tensor:
    """qwen-tts's forward over [h_t, c0, c_1..c_m] in one uncached call: logits of c_1..c_{m+1}."""
    embeddings = code_predictor.get_input_embeddings()
    parts = [prefix] + [embeddings[i](torch.tensor([c])) for i, c in enumerate(codes)]
    inputs = code_predictor.small_to_mtp_projection(torch.cat(parts))[None]
    hidden = code_predictor.model(inputs_embeds=inputs).last_hidden_state[0]
    return torch.stack([code_predictor.lm_head[j](hidden[j + 1]) for j in range(len(codes) + 1)])


def random_contexts(synth, frames: int, seed: int = 0) -> Contexts:
    """Random h_t and c0; c1.. sampled by the model itself, as synthesis would record them."""
    generator = np.random.default_rng(seed)
    groups = synth.code_predictor.config.num_code_groups
    codes = generator.integers(0, synth.code_predictor.config.vocab_size, (frames, groups))
    contexts = Contexts(
        generator.standard_normal((frames, synth.talker.config.hidden_size)).astype(np.float32),
        codes,
        np.array(["english", "german"] * (frames // 2)),
        source="random test frames",
    )
    codes[:, 1:] = sample_codes(synth.code_predictor, contexts.prefixes(synth.talker.get_input_embeddings()), seed)
    return contexts


def linear_maps_are_row_invariant(code_predictor, rows: int = 34) -> bool:
    """Whether the runner's linear maps give one row the same bits alone as in a call of 2 to `rows` rows
    (a round's query, and each depth's rows through its LM head) on this machine (kernels are chosen by
    shape, differently per CPU and dtype: rvqtts.engine.model.kernels). Where they do, a
    tree call's rows equal plain steps bit for bit; elsewhere they differ in the last bit."""
    from rvqtts.engine.model.kernels import LinearMap
    from rvqtts.engine.model.predictor import PredictorRunner

    runner = PredictorRunner(code_predictor, 2)
    maps = [runner.qkv[0], runner.gate_up[0], runner.out[0], runner.down[0], runner.heads[0]]
    if isinstance(runner.project, LinearMap):
        maps.append(runner.project)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for linear in maps:
            x = torch.randn(rows, linear.weight.shape[1], generator=generator).to(linear.weight.dtype)
            alone = linear(x[:1])[0]  # how the runner maps one row
            for size in range(2, rows + 1):
                if not torch.equal(linear(x[:size])[0], alone) or not torch.equal(
                    linear(x[:size])[-1], linear(x[size - 1 : size])[0]
                ):
                    return False
    return True
