"""Streaming: the incremental speech decoder against qwen-tts's, streams against offline synthesis, and the
bytes `rvqtts synth --stream` writes."""

from __future__ import annotations

import copy
import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
from helpers import join_chunks, run_cli

from rvqtts.engine.model.speech_decoder import StreamingDecoder, _Pass, push_together
from rvqtts.support.audio import StreamJoiner
from rvqtts.support.stretch import TimeStretch, time_stretched
from rvqtts.synthesis.settings import GenerationSettings

BOUND = 1e-5  # float rounding between one pass and many; the waveform's peak is about 0.25
LONG = "The first sentence is here. A second one follows it. And a third ends the text."


@pytest.mark.parametrize("step", [1, 4, 7])
def test_streaming_decoder_equals_qwen_tts_decode(tiny, step):
    # 151 frames: past the decoder's sliding window of 72, so its cache drops keys as the offline mask does
    codes = torch.randint(0, 2048, (151, 16), generator=torch.Generator().manual_seed(step))
    offline = tiny.model.speech_tokenizer.decode([{"audio_codes": codes}])[0][0]  # qwen-tts's one pass
    decoder = StreamingDecoder(tiny.model.speech_tokenizer.model.decoder)
    pieces = [decoder.push(codes[i : i + step]) for i in range(0, len(codes), step)]
    assert all(p.size == min(step, len(codes) - i * step) * 1920 for i, p in enumerate(pieces))
    streamed = np.concatenate(pieces)
    assert streamed.shape == offline.shape and np.abs(offline).max() > 0.05
    assert np.abs(streamed - offline).max() <= BOUND
    decoder.reset()  # a new utterance starts from silence, as the offline decode does
    assert np.abs(decoder.push(codes[:5]) - offline[: 5 * 1920]).max() <= BOUND
    whole = tiny.codec.decode(codes.numpy())  # rvqtts's offline decode: in pieces of PIECE_FRAMES
    assert whole.shape == offline.shape and np.abs(whole - offline).max() <= BOUND
    assert tiny.codec.decode(codes[:0].numpy()).shape == (0,)


def _conv_parts() -> dict:
    """qwen-tts's decoder parts at shapes that take each of the streaming decoder's ways: one product over the
    taps (a weight larger than its input, or a kernel of one step), tap by tap (one output channel), torch's
    convolution (dilated; depthwise), and transposed convolutions of kernel s and 2s, their product either way round
    (the input's transpose by the weight for few steps, the weight's transpose by the input for many)."""
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as parts

    torch.manual_seed(0)  # the modules' initial weights
    causal, transposed = parts.Qwen3TTSTokenizerV2CausalConvNet, parts.Qwen3TTSTokenizerV2CausalTransConvNet
    return {
        "product": (causal(64, 48, 7), 64),
        "kernel 1": (causal(24, 24, 1), 24),
        "one output": (causal(16, 1, 7), 16),
        "torch, dilated": (causal(8, 4, 7, dilation=3), 8),
        "depthwise": (causal(8, 8, 7, groups=8), 8),
        "transposed k = s": (transposed(32, 16, 4, 4), 32),
        "transposed k = 2s": (transposed(32, 16, 8, 4), 32),
        # a weight smaller than a long piece's input: that piece's product is laid out the other way round
        "transposed k = 2s, few channels": (transposed(8, 4, 8, 4), 8),
    }


CONV_WAYS = (
    "product",
    "kernel 1",
    "one output",
    "torch, dilated",
    "depthwise",
    "transposed k = s",
    "transposed k = 2s",
    "transposed k = 2s, few channels",
)


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("name", CONV_WAYS)
def test_each_way_the_decoder_runs_a_convolution_equals_qwen_tts_module(tiny, name, streams):
    """Pieces of each stream's input, its state carried from pass to pass, give the module's whole output; three
    streams of different inputs pushed together give each its own."""
    parts = _conv_parts()
    assert set(parts) == set(CONV_WAYS)
    module, channels = parts[name]
    x = torch.randn(streams, channels, 40, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = module(x)
        decoders = [StreamingDecoder(tiny.model.speech_tokenizer.model.decoder) for _ in range(streams)]
        pieces = []
        for start, size in ((0, 1), (1, 3), (4, 36)):
            one_pass = _Pass(decoders)
            pieces.append(one_pass._run(module, x[..., start : start + size]))
            one_pass.ended([decoder.cache for decoder in decoders], 0)
        pieces = torch.cat(pieces, -1)
    assert pieces.shape == whole.shape
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)


def test_streams_pushed_together_get_their_own_samples_and_share_attention_by_frame(tiny, monkeypatch):
    """Streams with different pasts (fresh, three frames, five) pushed together, pass after pass and pieces of 1, 4
    and 2 frames: each gets the samples of its own pushes up to float rounding; streams at the same frame share one
    attention call; streams of different decoders are refused."""
    decoder = tiny.model.speech_tokenizer.model.decoder
    codes = torch.randint(0, 2048, (5, 20, 16), generator=torch.Generator().manual_seed(3))
    pasts = [0, 0, 3, 3, 5]
    alone, together = ([StreamingDecoder(decoder) for _ in pasts] for _ in range(2))
    for stream, twin, past, own in zip(alone, together, pasts, codes):
        if past:
            stream.push(own[:past]), twin.push(own[:past])
    calls = []
    attend = decoder.pre_transformer.forward
    monkeypatch.setattr(decoder.pre_transformer, "forward", lambda **inputs: calls.append(1) or attend(**inputs))
    for count in (1, 4, 2):
        expected = [stream.push(own[stream.frames : stream.frames + count]) for stream, own in zip(alone, codes)]
        calls.clear()
        made = push_together(
            together, torch.stack([own[s.frames : s.frames + count] for s, own in zip(together, codes)])
        )
        assert len(calls) == 3  # frames 0, 3 and 5 (then 1, 4, 6; ...): one call each
        for mine, theirs in zip(made, expected):
            assert mine.shape == theirs.shape == (count * 1920,) and np.abs(mine - theirs).max() <= BOUND
        assert [s.frames for s in together] == [s.frames for s in alone]
    other = StreamingDecoder(copy.deepcopy(decoder))
    with pytest.raises(ValueError, match="share one speech decoder"):
        push_together([together[0], other], codes[:2, :1])


def test_a_pass_that_fails_leaves_every_stream_as_it_was(tiny, monkeypatch):
    """A pass that fails midway (here in the third decoder block's activation) changes no stream: pushed again, each
    gives what its twin that never saw the failure gives."""
    import rvqtts.engine.model.speech_decoder as speech_decoder

    decoder = tiny.model.speech_tokenizer.model.decoder
    codes = torch.randint(0, 2048, (2, 10, 16), generator=torch.Generator().manual_seed(4))
    streams, twins = ([StreamingDecoder(decoder) for _ in range(2)] for _ in range(2))
    for stream, twin, own in zip(streams, twins, codes):
        stream.push(own[:3]), twin.push(own[:3])
    snake, seen = speech_decoder._snake, []

    def breaking(module, x):
        seen.append(module)
        if len(seen) == 20:
            raise RuntimeError("the decoder broke")
        return snake(module, x)

    monkeypatch.setattr(speech_decoder, "_snake", breaking)
    with pytest.raises(RuntimeError, match="the decoder broke"):
        push_together(streams, codes[:, 3:7])
    monkeypatch.setattr(speech_decoder, "_snake", snake)
    assert [stream.frames for stream in streams] == [3, 3]
    again = push_together(streams, codes[:, 3:7])
    for made, twin, own in zip(again, twins, codes):
        assert np.abs(made - twin.push(own[3:7])).max() <= BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoders_snake_in_one_buffer_has_qwen_tts_bits(tiny, dtype):
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import SnakeBeta

    snake = SnakeBeta(16).to(dtype)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        snake.alpha.copy_(torch.randn(16, generator=generator))
        snake.beta.copy_(torch.randn(16, generator=generator))
    x = torch.randn(1, 16, 300, generator=generator).to(dtype)
    with torch.inference_mode():
        ours = _Pass([StreamingDecoder(tiny.model.speech_tokenizer.model.decoder)])._run(snake, x)
        assert torch.equal(ours, snake(x)) and not torch.equal(ours, x)


def test_a_stream_has_the_codes_and_audio_of_offline_synthesis_chunk_after_chunk(tiny):
    run = dict(speaker="vivian", language="english", seed=6, chunk_chars=30, settings=GenerationSettings(max_frames=18))
    offline = tiny.synthesize(LONG, **run)
    stream = tiny.stream(LONG, **run)  # the first piece after one frame, then every 4
    pieces = list(stream)
    result = stream.result
    assert result.chunks == offline.chunks == 3
    assert np.array_equal(result.codes, offline.codes)
    streamed = np.concatenate(pieces)
    assert streamed.shape == offline.audio.shape and np.abs(streamed - offline.audio).max() <= BOUND
    assert np.array_equal(result.audio, streamed)
    # 1 frame, then 4 frames a piece (the crossfade holds back its 50 ms until the next piece or chunk is known)
    assert pieces[0].size == 1920 - 1200 and pieces[1].size == pieces[2].size == 4 * 1920
    record = result.record()
    assert (record["first_stream_frames"], record["stream_frames"]) == (1, 4)
    assert 0 < record["first_audio_seconds"] < record["wall_seconds"]
    # first audio's parts in wall time: the prompt's prefill, the frames until the first piece, its decoding
    split = record["first_audio_split"]
    assert split["frames"] > 0 and 0 < split["decoder"] < record["decoder_seconds"]
    assert 0 < record["prefill_seconds"] == record["first_audio_split"]["prefill"]
    assert offline.record()["first_audio_seconds"] >= record["first_audio_seconds"]


def test_a_stream_at_four_times_the_speed_has_its_first_audio_after_two_frames_and_the_wholes_samples(tiny):
    """At speed 4 the first one-frame piece stretches to nothing (the stretch reads about 30 ms past what it makes),
    so the next piece is again one frame: first audio after two frames, not after a four-frame piece more; the
    streamed samples are the whole run's up to float rounding, a quarter of its length at speed 1."""
    run = dict(speaker="vivian", language="english", seed=6, settings=GenerationSettings(max_frames=14, speed=4.0))
    frames: list[int] = []
    stream = tiny.stream(LONG, **run, chunk_chars=None, on_frame=lambda prefix, codes: frames.append(1))
    pieces = [(len(frames), piece) for piece in stream]
    assert next(made for made, piece in pieces if piece.size) == 2
    streamed = np.concatenate([piece for _, piece in pieces])
    whole = tiny.synthesize(LONG, **run, chunk_chars=None).audio
    plain = tiny.synthesize(LONG, **{**run, "settings": GenerationSettings(max_frames=14)}, chunk_chars=None).audio
    assert streamed.shape == whole.shape == (round(plain.size / 4),) and np.abs(streamed - whole).max() <= BOUND
    assert np.array_equal(stream.result.audio, streamed)


def crossfaded(parts: list[np.ndarray], rate: int, seconds: float) -> np.ndarray:
    """A reference join, written independently of rvqtts.support.audio: each seam a linear crossfade."""
    joined = np.zeros(0, dtype=np.float32)
    for index, part in enumerate(parts):
        overlap = min(int(seconds * rate), joined.size, part.size) if index else 0
        fade = np.linspace(0.0, 1.0, overlap + 2, dtype=np.float32)[1:-1]
        seam = joined[joined.size - overlap :] * (1.0 - fade) + part[:overlap] * fade
        joined = np.concatenate([joined[: joined.size - overlap], seam, part[overlap:]])
    return joined


def test_the_stream_joiner_makes_join_chunks_audio_from_any_pieces():
    rng = np.random.default_rng(0)
    for _ in range(100):
        parts = [rng.standard_normal(int(rng.integers(0, 40))).astype(np.float32) for _ in range(rng.integers(1, 5))]
        joiner, out = StreamJoiner(100, 0.1), []
        for part in parts:
            cuts = sorted(rng.integers(0, part.size + 1, size=2))
            for k, piece in enumerate(np.split(part, cuts)):
                out.append(joiner.add(piece, new_part=k == 0))
        out.append(joiner.finish())
        reference = crossfaded(parts, 100, 0.1)
        assert np.array_equal(np.concatenate(out), reference) and np.array_equal(
            join_chunks(parts, 100, 0.1), reference
        )


@pytest.mark.parametrize("speed", [0.25, 0.8, 2.0, 4.0])
def test_speed_keeps_the_pitch_and_loudness_and_pieces_give_the_wholes_samples(speed):
    """A 220 Hz tone that swells 3 times a second, at `speed`: round(n / speed) samples, still 220 Hz (a resampling
    would move it to 220 x speed) and as loud; pushed in random pieces, the whole's very samples."""
    rate = 24000
    t = np.arange(3 * rate) / rate
    tone = (0.5 * np.sin(2 * np.pi * 220 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    whole = time_stretched(tone, speed, rate)
    assert len(whole) == round(len(tone) / speed)
    spectrum = np.abs(np.fft.rfft(whole))
    assert abs(np.argmax(spectrum) * rate / len(whole) - 220) < 2
    loudness = np.sqrt(np.mean(np.square(whole))) / np.sqrt(np.mean(np.square(tone)))
    assert 0.95 < loudness < 1.08, loudness
    stretch, pieces, start = TimeStretch(speed, rate), [], 0
    for size in np.random.default_rng(0).integers(1, 4000, size=len(tone)):
        pieces.append(stretch.push(tone[start : start + size]))
        start += size
        if start >= len(tone):
            break
    assert np.array_equal(np.concatenate([*pieces, stretch.finish()]), whole)
    assert time_stretched(tone, 1.0, rate) is tone
    for refused in (0.2, 4.5, float("nan")):
        with pytest.raises(ValueError, match="speed must be from 0.25 to 4.0"):
            TimeStretch(refused, rate)


def test_synth_stream_to_stdout_writes_a_wav_of_unknown_length(tmp_path, tiny_dir):
    text = "Hello there."
    options = ("--model", tiny_dir, "--max-frames", "9", "-q", "--seed", "3", "--dtype", "float32")
    streamed = run_cli("synth", text, *options, "--stream", "-o", "-", "--stats-json", tmp_path / "s.json")
    assert streamed.exit_code == 0, streamed.output
    data = streamed.stdout_bytes
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF
    assert data[36:40] == b"data" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    samples = np.frombuffer(data[44:], dtype="<i2")
    whole = run_cli("synth", text, *options, "-o", tmp_path / "whole.wav")
    assert whole.exit_code == 0, whole.output
    reference, rate = soundfile.read(tmp_path / "whole.wav", dtype="int16")
    assert rate == 24000 and samples.shape == reference.shape == (9 * 1920,)
    assert np.abs(samples.astype(int) - reference).max() <= 1
    raw = run_cli("synth", text, *options, "--stream", "-o", "-", "--format", "raw")
    assert raw.exit_code == 0 and raw.stdout_bytes == data[44:]
    record = json.loads((tmp_path / "s.json").read_text())["utterances"][0]
    assert record["stream_frames"] == 4 and record["first_audio_seconds"] <= record["wall_seconds"]


def test_synth_stream_to_a_file_writes_it_whole(tmp_path, tiny_dir):
    streamed_dir, whole_dir = tmp_path / "streamed", tmp_path / "whole"
    streamed_dir.mkdir()
    options = ("--model", tiny_dir, "--max-frames", "6", "-q", "--seed", "2", "--dtype", "float32")
    out = streamed_dir / "streamed.flac"
    result = run_cli("synth", "Hello there.", *options, "--stream", "--stream-frames", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert [p.name for p in streamed_dir.iterdir()] == ["streamed.flac"]  # no partial file left behind
    whole = run_cli("synth", "Hello there.", *options, "-o", whole_dir / "whole.flac")
    assert whole.exit_code == 0, whole.output
    audio, rate = soundfile.read(out, dtype="int16")
    reference, _ = soundfile.read(whole_dir / "whole.flac", dtype="int16")
    assert soundfile.info(out).format == "FLAC" and rate == 24000 and audio.shape == reference.shape == (6 * 1920,)
    # the samples of the whole run, up to the streamed decoder's float rounding (one step of 16 bits at most)
    assert np.abs(reference).max() > 1000 and np.abs(audio.astype(int) - reference).max() <= 1


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--stream-frames", "0"], "--stream-frames must be at least 1"),
        (["--format", "mp3"], "unknown --format 'mp3'"),
        (["--format", "raw", "-o", "x.wav"], "--format is for -o -"),
    ],
)
def test_bad_stream_options_fail_before_the_model_loads(tmp_path, arguments, message):
    output = [] if "-o" in arguments else ["-o", "-"]
    result = run_cli("synth", "Hi.", "--model", tmp_path / "missing", "--stream", *arguments, *output)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.skipif(shutil.which("sox") is None, reason="sox is not installed")
def test_sox_reads_the_streamed_wav_from_a_pipe(tiny_dir):
    """The README's `rvqtts synth --stream -o - ... | play -t wav -`: sox (installed by the test command) reads the
    stream from a pipe; rvqtts runs from this interpreter (`python -m rvqtts.cli`), whatever PATH holds."""
    command = [
        sys.executable,
        "-m",
        "rvqtts.cli",
        "synth",
        "Hello there.",
        "--model",
        str(tiny_dir),
        "--max-frames",
        "8",
        "-q",
        "--stream",
        "-o",
        "-",
    ]
    synth = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        sox = [shutil.which("sox"), "-t", "wav", "-", "-n", "stat"]
        stat = subprocess.run(sox, stdin=synth.stdout, capture_output=True, text=True, timeout=300)
        synth.stdout.close()
        assert synth.wait(timeout=60) == 0 and stat.returncode == 0, stat.stderr
    finally:
        synth.kill()  # a no-op once it has ended
    assert "Samples read:             15360" in stat.stderr  # 8 frames of 1920 samples
