"""Voice cloning on a tiny Base checkpoint: the voice encoded by qwen-tts's own code, spoken through rvqtts's
loops with the same seed promises, decoded as the continuation of its reference (ICL), stored as a voice
file, given per batch line; and every bad reference refused with one line before the model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch
from helpers import run_cli

from rvqtts.qwen.cloning import ClonedVoice, VoiceError, VoiceSource, load_voice, save_voice
from rvqtts.qwen.codec import StreamPacing
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.synthesizer import Synthesizer

SETTINGS = GenerationSettings(max_frames=10)
REF_TEXT = "Hello there, this is my voice."


@pytest.fixture(scope="module")
def base(tmp_path_factory, base_dir):
    root, folder = tmp_path_factory.mktemp("cloning"), base_dir
    rng = np.random.default_rng(0)
    # 1.5 s of noise at 48 kHz in stereo: qwen-tts resamples it to 24 kHz after rvqtts mixes it to mono
    soundfile.write(root / "ref.wav", (rng.standard_normal((72000, 2)) * 0.1).astype(np.float32), 48000)
    synth = Synthesizer.load(folder, EngineChoices(dtype="float32", tree="16"))
    return folder, root / "ref.wav", synth


def test_a_voice_cloned_in_icl_mode_is_spoken_exactly_as_its_references_continuation(base):
    _, ref, synth = base
    voice = synth.clone_voice(ref, REF_TEXT)
    assert voice.icl and tuple(voice.codes.shape) == (19, 16) and voice.embedding.shape == (64,)
    assert synth.clone_voice(ref, REF_TEXT) is voice  # a source is encoded once
    spoken = synth.synthesize("Hi there.", seed=3, clone=voice, settings=SETTINGS)
    plain = synth.using(None).synthesize("Hi there.", seed=3, clone=voice, settings=SETTINGS)
    assert np.array_equal(spoken.codes, plain.codes)  # same seed, same codes, speculative or not
    frames = len(spoken.codes)
    assert spoken.audio.size == frames * 1920
    # qwen-tts's own post-processing of the same codes: decode reference ++ generated, cut a proportion
    # (which may leave a sample of the reference; rvqtts gives exactly the generated frames' samples).
    joined = torch.cat([voice.codes, torch.from_numpy(spoken.codes)])
    upstream = synth.model.speech_tokenizer.decode([{"audio_codes": joined}])[0][0]
    cut = int(len(voice.codes) / len(joined) * upstream.shape[0])
    assert upstream[cut:].size in (frames * 1920, frames * 1920 + 1)
    assert np.abs(upstream[-frames * 1920 :] - spoken.audio).max() < 1e-4
    assert not np.allclose(synth.codec.decode(spoken.codes), spoken.audio, atol=1e-4)  # the reference matters
    stream = synth.stream("Hi there.", seed=3, clone=voice, settings=SETTINGS, pacing=StreamPacing(3, 3))
    chunks = list(stream)
    assert np.array_equal(stream.result.codes, spoken.codes) and len(chunks) > 2
    assert np.abs(stream.result.audio - spoken.audio).max() < 1e-4  # streamed after the reference too
    again = synth.stream("Hi there.", seed=3, clone=voice, settings=SETTINGS, pacing=StreamPacing(3, 3))
    list(again)  # the decoder restored after the reference, not fed it again: the same samples
    assert voice in synth.codec.primed and np.array_equal(again.result.audio, stream.result.audio)
    state, cache, _ = synth.codec.primed[voice]  # kept compactly: no view holding a whole push's activations
    kept = [*state.values(), *(getattr(layer, name) for layer in cache.layers for name in ("keys", "values"))]
    assert sum(t.untyped_storage().nbytes() for t in kept) <= 2 * sum(t.numel() * t.element_size() for t in kept)
    text, chunked = "One two three four. Five six seven eight.", dict(chunk_chars=20, settings=SETTINGS, clone=voice)
    whole = synth.synthesize(text, **chunked)
    streamed = synth.stream(text, pacing=StreamPacing(4, 4), **chunked)
    list(streamed)  # each text chunk continues the reference
    assert whole.chunks > 1 and np.array_equal(streamed.result.codes, whole.codes)
    assert np.abs(streamed.result.audio - whole.audio).max() < 1e-4


def test_an_x_vector_only_voice_takes_the_embedding_alone(base):
    _, ref, synth = base
    icl, alone = synth.clone_voice(ref, REF_TEXT), synth.clone_voice(ref, x_vector_only=True)
    assert alone.codes is None and alone.ref_text is None and torch.equal(alone.embedding, icl.embedding)
    # the ICL prompt holds the reference's codes and transcript; x-vector-only only the embedding
    assert synth.prompt("Hi.", None, clone=icl).length >= synth.prompt("Hi.", None, clone=alone).length + 19
    spoken = synth.synthesize("Hi there.", clone=alone, settings=SETTINGS)
    assert np.array_equal(spoken.audio, synth.codec.decode(spoken.codes))
    with pytest.raises(ValueError, match="a Base model speaks a cloned voice"):
        synth.synthesize("Hi there.", settings=SETTINGS)
    with pytest.raises(ValueError, match="has no built-in speakers"):
        synth.synthesize("Hi there.", "vivian", clone=alone, settings=SETTINGS)


def test_a_voice_file_round_trips_and_refuses_another_models_voice(base, tmp_path):
    _, ref, synth = base
    voice = synth.clone_voice(ref, REF_TEXT)
    save_voice(voice, tmp_path / "v.safetensors")
    loaded = synth.voice_of(VoiceSource(voice=tmp_path / "v.safetensors"))
    assert torch.equal(loaded.codes, voice.codes) and torch.equal(loaded.embedding, voice.embedding)
    assert loaded.ref_text == REF_TEXT
    first = synth.synthesize("Hi there.", clone=voice, settings=SETTINGS)
    assert np.array_equal(first.audio, synth.synthesize("Hi there.", clone=loaded, settings=SETTINGS).audio)
    other = ClonedVoice(voice.embedding, voice.codes, REF_TEXT, "0" * 16, "elsewhere.wav")
    save_voice(other, tmp_path / "other.safetensors")
    with pytest.raises(VoiceError, match="encoded by another model's speaker encoder"):
        synth.voice_of(VoiceSource(voice=tmp_path / "other.safetensors"))
    with pytest.raises(VoiceError, match="another model's speaker encoder"):
        synth.synthesize("Hi.", clone=other, settings=SETTINGS)
    (tmp_path / "junk.safetensors").write_bytes(b"not a voice")
    with pytest.raises(VoiceError, match="cannot read voice file"):
        load_voice(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"embedding": torch.zeros(64)}, str(tmp_path / "plain.safetensors"), metadata={"format": "x"})
    with pytest.raises(VoiceError, match="is not an rvqtts voice file"):
        load_voice(tmp_path / "plain.safetensors")


def write(path, seconds: float, peak: float = 0.1, rate: int = 24000):
    samples = np.random.default_rng(1).standard_normal(int(seconds * rate)).astype(np.float32)
    soundfile.write(path, samples / np.abs(samples).max() * peak, rate)
    return path


def test_bad_voice_input_fails_with_one_line_before_the_model_loads(base, tiny_dir, tmp_path, monkeypatch):
    folder, ref, _ = base
    monkeypatch.setattr(Synthesizer, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "text.wav").write_text("not audio")
    save_voice(ClonedVoice(torch.zeros(64), None, None, "0" * 16), tmp_path / "v.safetensors")
    out = ["-o", tmp_path / "out.wav"]
    cases = [
        ([], "a Base model speaks a cloned voice: give a voice file"),
        (["--ref-audio", ref], "needs the reference audio's transcript (--ref-text"),
        (["--ref-audio", ref, "--ref-text", "Hi.", "--x-vector-only"], "x-vector-only mode clones from the audio"),
        (["--ref-text", "Hi."], "go with reference audio"),
        (["--voice", tmp_path / "v.safetensors", "--ref-audio", ref], "not both"),
        (["--ref-audio", tmp_path / "missing.wav", "--x-vector-only"], "no reference audio file"),
        (["--ref-audio", tmp_path / "text.wav", "--x-vector-only"], "cannot read reference audio"),
        (["--ref-audio", write(tmp_path / "short.wav", 0.5), "--x-vector-only"], "is 0.50 s long: give at least 1 s"),
        (["--ref-audio", write(tmp_path / "quiet.wav", 2, peak=1e-4), "--x-vector-only"], "is silent"),
        (["--voice", tmp_path / "missing.safetensors"], "no voice file"),
        (["--ref-audio", ref, "--x-vector-only", "--speaker", "vivian"], "has no built-in speakers"),
        (["--ref-audio", ref, "--x-vector-only", "--save-voice", tmp_path / "v.pt"], "must end in .safetensors"),
        (
            ["--voice", tmp_path / "v.safetensors", "--save-voice", tmp_path / "w.safetensors"],
            "--save-voice writes the voice cloned from --ref-audio",
        ),
    ]
    for extra, message in cases:
        result = run_cli("synth", "Hi.", "--model", folder, *out, *extra)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    refused = run_cli("synth", "Hi.", "--model", tiny_dir, *out, "--ref-audio", ref, "--x-vector-only")
    assert refused.exit_code == 2 and "clone a voice on Base models; this is a CustomVoice model" in refused.output
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "One.", "x_vector_only": true, "ref_audio": "ref.wav", "ref_text": "One."}\n')
    refused = run_cli("synth", "-f", lines, "--out-dir", tmp_path / "batch", "--model", folder)
    assert refused.exit_code == 2 and "lines.jsonl:1: x-vector-only mode clones" in refused.output
    lines.write_text('{"text": "One."}\n{"text": "Two.", "ref_audio": "short.wav", "x_vector_only": true}\n')
    refused = run_cli(
        "synth", "-f", lines, "--out-dir", tmp_path / "batch", "--model", folder, "--voice", tmp_path / "v.safetensors"
    )
    assert (
        refused.exit_code == 2 and "lines.jsonl:2: reference audio" in refused.output and "is 0.50 s" in refused.output
    )
    assert not (tmp_path / "out.wav").exists() and not (tmp_path / "batch").exists()
    assert not (tmp_path / "w.safetensors").exists()


def test_a_batch_speaks_each_lines_cloned_voice_and_a_saved_voice_is_the_same(base, tmp_path):
    folder, ref, _ = base
    model = ["--model", folder, "--max-frames", 6, "--dtype", "float32"]
    saved = run_cli(
        "synth", *model, "--ref-audio", ref, "--ref-text", REF_TEXT, "--save-voice", tmp_path / "v.safetensors"
    )
    assert saved.exit_code == 0 and (tmp_path / "v.safetensors").is_file(), saved.output
    (tmp_path / "one.txt").write_text("One.\n")
    alone = run_cli(
        "synth",
        "-f",
        tmp_path / "one.txt",
        "--out-dir",
        tmp_path / "one",
        *model,
        "--ref-audio",
        ref,
        "--ref-text",
        REF_TEXT,
    )
    assert alone.exit_code == 0, alone.output
    spoken = run_cli(
        "synth",
        "Hi.",
        *model,
        "--ref-audio",
        ref,
        "--ref-text",
        REF_TEXT,
        "--save-voice",
        tmp_path / "w.safetensors",
        "--stream",
        "-o",
        tmp_path / "hi.wav",
    )  # both, streamed
    assert spoken.exit_code == 0 and (tmp_path / "w.safetensors").is_file() and (tmp_path / "hi.wav").is_file()
    other = ClonedVoice(torch.zeros(64), None, None, "0" * 16, "elsewhere.wav")
    save_voice(other, tmp_path / "other.safetensors")
    refused = run_cli("synth", "Hi.", *model, "--voice", tmp_path / "other.safetensors", "-o", tmp_path / "no.wav")
    assert refused.exit_code == 2 and "another model's speaker encoder" in refused.output.splitlines()[-1]
    assert not (tmp_path / "no.wav").exists()
    (tmp_path / "ref.wav").write_bytes(ref.read_bytes())
    lines = tmp_path / "lines.jsonl"
    lines.write_text(
        "\n".join(
            json.dumps(line)
            for line in [
                {"text": "One."},  # the batch's voice (--voice)
                {"text": "Two.", "ref_audio": "ref.wav", "x_vector_only": True},
                {"text": "Three.", "ref_audio": "ref.wav", "ref_text": REF_TEXT},
                {"text": "Four.", "voice": "v.safetensors"},
            ]
        )
        + "\n"
    )
    made = run_cli("synth", "-f", lines, "--out-dir", tmp_path / "out", *model, "--voice", tmp_path / "v.safetensors")
    assert made.exit_code == 0, made.output
    entries = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    saved = str((tmp_path / "v.safetensors").resolve())
    assert [e.get("voice") for e in entries] == [saved, None, None, saved]
    assert [e.get("x_vector_only") for e in entries] == [None, True, False, None]
    assert entries[2]["ref_audio"] == str((tmp_path / "ref.wav").resolve()) and entries[2]["ref_text"] == REF_TEXT
    # line 1 with the saved voice is line 1 with the reference it was encoded from
    assert (tmp_path / "out" / "0001.wav").read_bytes() == (tmp_path / "one" / "0001.wav").read_bytes()
    assert (tmp_path / "out" / "0002.wav").read_bytes() != (tmp_path / "out" / "0003.wav").read_bytes()


def test_offsets_and_trees_are_made_on_a_base_model_in_a_cloned_voice(base, tmp_path):
    folder, ref, synth = base
    save_voice(synth.clone_voice(ref, REF_TEXT), tmp_path / "v.safetensors")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(
        '{"text": "One two three."}\n{"text": "Four five.", "ref_audio": "%s", "x_vector_only": true}\n' % ref
    )
    train = ["train-offsets", "--model", folder, "--texts", texts, "--max-steps", 3, "-q"]
    refused = run_cli(*train, "--out", tmp_path / "refused.safetensors")
    assert refused.exit_code == 2 and "texts.jsonl:1: a Base model speaks a cloned voice" in refused.output
    assert not (tmp_path / "refused.safetensors").exists()
    trained = run_cli(
        *train,
        "--out",
        tmp_path / "o.safetensors",
        "--voice",
        tmp_path / "v.safetensors",
        "--save-contexts",
        tmp_path / "frames.npz",
    )
    assert trained.exit_code == 0 and (tmp_path / "o.safetensors").is_file(), trained.output
    made = run_cli(
        "calibrate",
        "--model",
        folder,
        "--texts",
        texts,
        "--voice",
        tmp_path / "v.safetensors",
        "--budgets",
        "4",
        "--out-dir",
        tmp_path / "trees",
        "-q",
    )
    assert made.exit_code == 0 and (tmp_path / "trees" / "reused-heads-n4.json").is_file(), made.output


def test_audio_is_resampled_as_librosa_resamples_by_default():
    """rvqtts.support.audio.resample is librosa.resample's default (soxr at high quality, cut or zero-padded to
    ceil(n * target / rate) samples), the resampling qwen-tts applies, so a reference or a recording made
    at any rate encodes to the bits qwen-tts gets from it (librosa itself is not called: its first use
    compiles numba functions for half a minute)."""
    import soxr

    from rvqtts.support.audio import resample

    rng = np.random.default_rng(4)
    for size, rate in [(72000, 48000), (32007, 16000), (88203, 44100), (1001, 48000)]:
        samples = (rng.standard_normal(size) * 0.1).astype(np.float32)
        out = resample(samples, rate, 24000)
        length = -(-size * 24000 // rate)
        whole = soxr.resample(samples, rate, 24000, quality="soxr_hq")
        assert out.dtype == np.float32 and out.shape == (length,)
        assert np.array_equal(out[: len(whole)], whole[:length]) and not out[len(whole) :].any()
    assert resample(samples, 24000, 24000) is samples


def test_a_recording_soundfile_cannot_read_goes_to_qwen_tts_by_its_path(tmp_path, monkeypatch):
    import rvqtts.tuning.contexts as contexts
    from rvqtts.support.audio import UnreadableAudio

    class Tokenizer:
        feature_extractor = type("Extractor", (), {"sampling_rate": 24000})

        def encode(self, audio, sr=None):
            self.given = (audio, sr)
            return type("Encoded", (), {"audio_codes": [torch.zeros(2, 16, dtype=torch.long)]})

    stereo = tmp_path / "a.wav"
    soundfile.write(stereo, np.full((48000, 2), 0.25, dtype=np.float32), 48000)
    tokenizer = Tokenizer()
    assert contexts.speech_codes(tokenizer, stereo).shape == (2, 16)
    samples, rate = tokenizer.given
    assert rate == 24000 and samples.shape == (24000,) and samples.dtype == np.float32  # mixed, then resampled

    def unreadable(path):
        raise UnreadableAudio("unknown format")

    monkeypatch.setattr(contexts, "read_mono", unreadable)
    contexts.speech_codes(tokenizer, stereo)
    assert tokenizer.given == (str(stereo), None)  # librosa.load's fallbacks (audioread) read what soundfile cannot


def test_streamed_lines_of_cloned_voices_decode_together_each_as_it_streams_alone(base, measured, monkeypatch):
    """Three streamed lines in three rows, two in one ICL voice (their decoders restored from one primed reference,
    so at the same frame: one attention call) and one in an x-vector voice (no reference: other frames): every
    line's codes and its samples, up to float rounding, those of its own stream alone."""
    from rvqtts.synthesis import pipeline
    from rvqtts.synthesis.settings import Line

    _, ref, synth = base
    icl, xvector = synth.clone_voice(ref, REF_TEXT), synth.clone_voice(ref, x_vector_only=True)
    lines = [
        Line(text="Hi there.", clone=icl, utterance=0, seed=3),
        Line(text="Another line.", clone=icl, utterance=1, seed=4),
        Line(text="A third.", clone=xvector, utterance=2, seed=5),
    ]
    pacing = StreamPacing(1, 3)

    def spoken(batch: list, rows: int) -> dict:
        pieces: dict = {}
        for index, item in synth.synthesize_many(batch, settings=SETTINGS, batch_size=rows, stream=pacing):
            assert not isinstance(item, Exception), item
            pieces.setdefault(index, []).append(item)
        return pieces

    alone = [spoken([line], 1)[0] for line in lines]
    passes, push_together = [], pipeline.push_together

    def recorded(streams, codes):
        passes.append(sorted(stream.frames for stream in streams))
        return push_together(streams, codes)

    monkeypatch.setattr(pipeline, "push_together", recorded)
    together = spoken(lines, 3)
    assert passes[0] == [0, len(icl.codes), len(icl.codes)]  # the first pieces: the ICL pair after its reference
    for made, own in zip((together[index] for index in range(3)), alone):
        assert np.array_equal(made[-1].codes, own[-1].codes) and len(made) > 2
        streamed, expected = np.concatenate(made[:-1]), np.concatenate(own[:-1])
        assert streamed.shape == expected.shape and np.abs(streamed - expected).max() < 1e-4
