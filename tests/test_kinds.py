"""Every released 12 Hz model kind as a tiny checkpoint: Base (a speaker encoder, no speakers) and
VoiceDesign load and run through qwen-tts's own voice-clone and voice-design calls; rvqtts names them and
synthesizes VoiceDesign's described voices."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import run_cli

from rvqtts.qwen.compat import qwen_tts
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.tuning.tiny import build_tiny_model


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, base_dir):
    return {
        "base": base_dir,
        "voice-design": build_tiny_model(tmp_path_factory.mktemp("kinds") / "vd", kind="voice-design"),
    }


def load(folder):
    return qwen_tts().Qwen3TTSModel.from_pretrained(folder, device_map="cpu", dtype=torch.float32)


def test_a_tiny_base_model_clones_a_voice_with_qwen_tts(kinds):
    tts = load(kinds["base"])
    assert tts.model.tts_model_type == "base" and tts.get_supported_speakers() in ([], None)
    reference = (np.random.default_rng(0).standard_normal(24000) * 0.1).astype(np.float32)  # 1 s of noise
    (item,) = tts.create_voice_clone_prompt(ref_audio=(reference, 24000), ref_text="Hello there.")
    assert tuple(item.ref_code.shape) == (13, 16)  # 12.5 frames a second from the codec's encoder, rounded up
    assert tuple(item.ref_spk_embedding.shape) == (tts.model.talker.config.hidden_size,)
    wavs, rate = tts.generate_voice_clone(text="Hi.", language="auto", voice_clone_prompt=[item], max_new_tokens=4)
    assert rate == 24000 and wavs[0].size > 0


def test_a_tiny_voice_design_model_speaks_a_described_voice_with_qwen_tts(kinds):
    tts = load(kinds["voice-design"])
    assert tts.model.tts_model_type == "voice_design" and tts.model.tts_model_size == "1b7"
    wavs, rate = tts.generate_voice_design(text="Hi.", instruct="A calm, low voice.", language="auto", max_new_tokens=4)
    assert rate == 24000 and wavs[0].size > 0


def test_voices_names_the_kind_and_what_it_takes(kinds, tmp_path):
    listed = run_cli("voices", "--model", kinds["base"])
    assert listed.exit_code == 0 and listed.output.splitlines()[:2] == [
        "kind: Base (a voice cloned from reference audio (--ref-audio with --ref-text or --x-vector-only, or --voice))",
        "speakers: none",
    ]
    listed = run_cli("voices", "--model", kinds["voice-design"])
    assert listed.exit_code == 0 and listed.output.startswith("kind: VoiceDesign (a voice described in words")
    made = run_cli("make-tiny-model", tmp_path / "vd", "--kind", "voice-design", "--dims", "0.6b")
    assert made.exit_code == 2 and "VoiceDesign is released at 1.7B only" in made.output
    made = run_cli("make-tiny-model", tmp_path / "x", "--kind", "clone")
    assert made.exit_code == 2 and "--kind must be one of custom-voice, base, voice-design" in made.output


def test_synth_speaks_a_voice_design_models_described_voice(kinds, tmp_path):
    model = ["--model", kinds["voice-design"], "--max-frames", 8]
    calm = ["--instruct", "A calm, low voice."]

    def codes(name: str, *extra) -> np.ndarray:
        result = run_cli(
            "synth",
            "Hello there.",
            "-o",
            tmp_path / f"{name}.wav",
            "--codes-out",
            tmp_path / f"{name}.npy",
            *model,
            *extra,
        )
        assert result.exit_code == 0, result.output
        assert "does not support --instruct" not in result.output
        return np.load(tmp_path / f"{name}.npy")

    assert np.array_equal(codes("calm", *calm), codes("calm-plain", *calm, "--no-spec"))  # same seed, same codes
    assert not np.array_equal(codes("calm", *calm), codes("bright", "--instruct", "A bright, quick voice."))
    for extra, message in [
        ([], "a VoiceDesign model speaks the voice its instruction describes: give an instruction (--instruct"),
        ([*calm, "--speaker", "ryan"], "this VoiceDesign model has no built-in speakers"),
    ]:
        refused = run_cli("synth", "Hi.", "-o", tmp_path / "refused.wav", *model, *extra)
        assert refused.exit_code == 2 and message in refused.output, refused.output
    assert not (tmp_path / "refused.wav").exists()
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "One.", "instruct": "A whisper."}\n{"text": "Two."}\n')
    refused = run_cli("synth", "-f", lines, "--out-dir", tmp_path / "out", *model)
    assert refused.exit_code == 2 and "lines.jsonl:2: a VoiceDesign model speaks" in refused.output
    made = run_cli("synth", "-f", lines, "--out-dir", tmp_path / "out", *model, *calm)
    assert made.exit_code == 0, made.output
    entries = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text().splitlines()]
    assert [(e["speaker"], e["instruct"]) for e in entries] == [(None, "A whisper."), (None, "A calm, low voice.")]


def test_a_voice_design_model_needs_its_instruction_in_every_command(kinds, tmp_path):
    from rvqtts.synthesis.synthesizer import Synthesizer

    designer = Synthesizer.from_checkpoint(kinds["voice-design"])
    assert designer.speakers == [] and designer.supports_instruct
    with pytest.raises(ValueError, match="give an instruction"):
        designer.synthesize("Hi.", settings=GenerationSettings(max_frames=2))
    texts = tmp_path / "texts.txt"
    texts.write_text("One two three.\n")
    calibrate = ["calibrate", "--model", kinds["voice-design"], "--texts", texts, "--budgets", "4", "-q"]
    refused = run_cli(*calibrate, "--out-dir", tmp_path / "refused")
    assert refused.exit_code == 2 and "texts.txt:1: a VoiceDesign model speaks the voice" in refused.output
    made = run_cli(*calibrate, "--out-dir", tmp_path / "trees", "--instruct", "A calm, low voice.")
    assert made.exit_code == 0 and (tmp_path / "trees" / "reused-heads-n4.json").is_file(), made.output
