"""Recorded frames, and `rvqtts train-offsets`, `calibrate` and `accept` end to end on tiny checkpoints."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import random_contexts
from helpers import run_cli as run

from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import load_offsets, predictor_fingerprint
from rvqtts.engine.speculative.tree import grow_tree, load_acceptance, load_tree
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.tuning.calibration import sampling_entropy
from rvqtts.tuning.contexts import ContextsFileError, load_contexts, record_contexts, save_contexts, teacher_force
from rvqtts.tuning.drafts import DraftData


@pytest.fixture(scope="module")
def small_frames(small, tmp_path_factory):
    path = tmp_path_factory.mktemp("frames") / "small.npz"
    save_contexts(random_contexts(small, 400), path)
    return path


def test_contexts_round_trip_and_splits(tmp_path, small):
    frames = random_contexts(small, 6)
    save_contexts(frames, tmp_path / "plain.npz")
    again = load_contexts(tmp_path / "plain.npz", split="ignored for files without splits")
    assert np.array_equal(again.codes, frames.codes) and np.array_equal(again.h_t, frames.h_t)
    assert list(again.language) == list(frames.language) and again.source == "random test frames"
    np.savez(
        tmp_path / "split.npz",
        calibration_h_t=frames.h_t,
        calibration_codes=frames.codes,
        calibration_language=frames.language,
    )
    assert len(load_contexts(tmp_path / "split.npz", "calibration")) == 6
    with pytest.raises(ContextsFileError, match="holds the splits calibration: choose one with --split"):
        load_contexts(tmp_path / "split.npz", "evaluation")


@pytest.mark.parametrize(
    "arrays, checks, message",
    [
        ({"h_t": np.zeros((3, 4))}, {}, "is not a contexts file: it needs the arrays h_t, codes, language"),
        (
            {"h_t": np.zeros((3, 4)), "codes": np.zeros((2, 4), int), "language": np.array(["en"] * 3)},
            {},
            "expected h_t",
        ),
        (
            {"h_t": np.zeros((3, 4)), "codes": np.zeros((3, 4), int), "language": np.array(["en"] * 3)},
            {"hidden_size": 8},
            "h_t has width 4 but the model's talker has 8",
        ),
        (
            {"h_t": np.zeros((3, 4)), "codes": np.zeros((3, 4), int), "language": np.array(["en"] * 3)},
            {"code_groups": 16},
            "frames have 4 codes but the model makes 16",
        ),
        ({"h_t": np.full((3, 4), np.nan), "codes": np.zeros((3, 4), int), "language": np.array(["en"] * 3)}, {}, "NaN"),
    ],
)
def test_bad_contexts_files_are_refused_with_their_fault(tmp_path, arrays, checks, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ContextsFileError, match=message):
        load_contexts(tmp_path / "bad.npz", **checks)
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ContextsFileError, match="cannot read contexts file"):
        load_contexts(tmp_path / "junk.npz")


def test_recorded_frames_are_the_synthesized_frames(tiny):
    settings = GenerationSettings(max_frames=30)
    utterances = [Line(text="Hello there.", utterance=1), Line(text="Guten Tag.", language="german", utterance=2)]
    frames = record_contexts(tiny, utterances, Line(speaker="vivian", language="english", seed=4, settings=settings))
    made = [
        tiny.synthesize(u.text, "vivian", u.language or "english", seed=4, utterance=u.utterance, settings=settings)
        for u in utterances
    ]
    assert np.array_equal(frames.codes, np.concatenate([m.codes for m in made]))
    assert list(frames.language) == ["english"] * len(made[0].codes) + ["german"] * len(made[1].codes)
    assert frames.h_t.shape == (len(frames), tiny.talker.config.hidden_size)


def test_sampling_entropy_is_that_of_the_warped_distribution():
    """Position 1 keeps top-k 50 of 100 equally likely codes after temperature: log2(50) bits; position 2 has
    one code a thousand logits ahead: 0 bits; a third frame with the roles swapped averages them."""
    vocabulary, width = 100, 2
    weights = torch.zeros(2, vocabulary, width)
    weights[:, :50, 0] = 1.0  # 50 codes share the top score when h[0] = 1
    weights[:, 7, 1] = 1000.0  # code 7 dominates when h[1] = 1
    spread, peaked = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    hidden = torch.stack([torch.stack([spread, peaked]), torch.stack([spread, peaked]), torch.stack([peaked, spread])])
    bits = sampling_entropy(weights, DraftData(hidden, torch.zeros(3, 2, dtype=torch.long)), SamplingConfig())
    assert bits == pytest.approx([2 / 3 * math.log2(50), 1 / 3 * math.log2(50)], abs=1e-3)


def test_train_calibrate_accept_from_a_contexts_file(tmp_path, small, small_dir, small_frames):
    offsets = tmp_path / "small.safetensors"
    trained = run(
        "train-offsets",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--out",
        offsets,
        "--learning-rate",
        "0.01",
        "--max-steps",
        "300",
        "--held-out",
        "0.25",
    )
    assert trained.exit_code == 0, trained.output
    assert "held-out loss" in trained.output
    loaded = load_offsets(offsets, hidden_size=small.hidden_size)
    assert loaded.model == str(small_dir) and loaded.depth == 3
    assert loaded.model_fingerprint == predictor_fingerprint(small.code_predictor)
    record = json.loads(loaded.metadata["training"])
    for field in ("source", "frames", "steps", "train_loss", "held_out_loss", "date", "depth", "target"):
        assert field in record
    assert record["held_out_loss"] < record["initial_held_out_loss"]

    trees = tmp_path / "trees"
    calibrated = run(
        "calibrate",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--offsets",
        offsets,
        "--budgets",
        "4,8",
        "--out-dir",
        trees,
    )
    assert calibrated.exit_code == 0, calibrated.output
    table = load_acceptance(trees / "small-acceptance.json")
    assert table["offsets"] == "small.safetensors" and len(table["acceptance"]) == 3
    assert table["model_fingerprint"] == loaded.model_fingerprint
    positions = len(small.code_predictor.lm_head)
    assert len(table["entropy_bits"]) == positions and all(0 < b <= math.log2(50) for b in table["entropy_bits"])
    assert f"sampling entropy of c1..c{positions} in bits" in calibrated.output
    for n in (4, 8):
        tree = load_tree(trees / f"small-n{n}.json")
        assert tree.nodes == n and tree.depth <= 3 and tree.expected_codes_per_call > 1
        assert tree.extra["model_fingerprint"] == loaded.model_fingerprint
        assert tree.paths == grow_tree(table["acceptance"], n).paths  # the table regrows the trees
    again = run(
        "calibrate",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--offsets",
        offsets,
        "--budgets",
        "4",
        "--out-dir",
        trees,
    )
    assert again.exit_code == 2 and "already exist: --force replaces them" in again.output

    figures = tmp_path / "accept.json"
    accepted = run(
        "accept",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--offsets",
        offsets,
        "--tree",
        trees / "small-n8.json",
        "--json",
        figures,
    )
    assert accepted.exit_code == 0, accepted.output
    result = json.loads(figures.read_text())
    assert result["frames"] == 400 and set(result["per_language"]) == {"english", "german"}
    assert 1.0 < result["ci95"][0] <= result["codes_per_call"] <= result["ci95"][1] <= 3.0
    assert "codes per predictor call" in accepted.output


def test_self_distillation_from_texts(tmp_path, tiny_dir):
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "Hello there."}\n{"text": "Guten Tag.", "language": "german"}\n')
    recorded = tmp_path / "recorded.npz"
    trained = run(
        "train-offsets",
        "--model",
        tiny_dir,
        "--texts",
        texts,
        "--out",
        tmp_path / "o.safetensors",
        "--save-contexts",
        recorded,
        "--max-steps",
        "20",
        "--language",
        "english",
    )
    assert trained.exit_code == 0, trained.output
    frames = load_contexts(recorded)
    assert set(frames.language) == {"english", "german"} and "self-distilled: 2 texts" in frames.source
    record = json.loads(load_offsets(tmp_path / "o.safetensors").metadata["training"])
    assert record["frames"] == len(frames) and record["source"] == frames.source


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["train-offsets", "--out", "{tmp}/o.safetensors"], "give one data source"),
        (
            ["train-offsets", "--out", "{tmp}/o.safetensors", "--contexts", "{frames}", "--texts", "t.txt"],
            "give one data source",
        ),
        (["train-offsets", "--out", "{tmp}/o.bin", "--contexts", "{frames}"], "must end in .safetensors"),
        (
            ["train-offsets", "--out", "{tmp}/o.safetensors", "--contexts", "{frames}", "--depth", "0"],
            "between 1 and 14",
        ),
        (
            ["train-offsets", "--out", "{tmp}/o.safetensors", "--contexts", "{frames}", "--held-out", "1"],
            "--held-out must be between 0 and 1",
        ),
        (["calibrate", "--out-dir", "{tmp}", "--contexts", "{frames}", "--budgets", "4,x"], "comma-separated"),
        (["calibrate", "--out-dir", "{tmp}", "--contexts", "{frames}", "--budgets", "0"], "at least 1"),
        (["accept", "--contexts", "{tmp}/missing.npz"], "cannot read contexts file"),
        (["accept", "--contexts", "{frames}", "--tree", "5"], "no shipped tree has N = 5"),
    ],
)
def test_drafting_commands_refuse_bad_input(tmp_path, small_dir, small_frames, arguments, message):
    filled = [a.format(tmp=tmp_path, frames=small_frames) for a in arguments]
    result = run(*filled, "--model", small_dir)
    assert result.exit_code == 2 and message in result.output, result.output


def test_offsets_for_another_model_are_refused(tmp_path, tiny_dir, small_dir, small_frames):
    trained = run(
        "train-offsets",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--out",
        tmp_path / "small.safetensors",
        "--max-steps",
        "10",
    )
    assert trained.exit_code == 0, trained.output
    again = run(
        "train-offsets",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--out",
        tmp_path / "small.safetensors",
        "--max-steps",
        "10",
    )
    assert again.exit_code == 2 and "already exists: --force replaces it" in again.output
    wrong = run(
        "calibrate",
        "--model",
        tiny_dir,
        "--contexts",
        small_frames,
        "--offsets",
        tmp_path / "small.safetensors",
        "--out-dir",
        tmp_path,
    )
    assert wrong.exit_code == 2 and "was trained for another model" in wrong.output


def test_teacher_forcing_reproduces_the_talker_states_of_synthesis(tiny):
    settings = GenerationSettings(max_frames=20)
    line = Line(text="Hello there.", speaker="vivian", language="english", utterance=1)
    free = record_contexts(tiny, [line], Line(seed=2, settings=settings))
    states = []
    teacher_force(tiny, line, free.codes, lambda prefix, codes: states.append(prefix[0]))
    # Forced to emit the codes it sampled, the talker passes through the same hidden states.
    assert len(states) == len(free)
    assert np.allclose(np.stack([s.numpy() for s in states]), free.h_t, atol=1e-5)


def test_train_offsets_from_recordings(tmp_path, tiny, tiny_dir):
    import soundfile

    noise = np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1
    soundfile.write(tmp_path / "a.wav", noise, 24000)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"audio": "a.wav", "text": "Hello there.", "language": "english"}\n')
    recorded = tmp_path / "forced.npz"
    trained = run(
        "train-offsets",
        "--model",
        tiny_dir,
        "--audio",
        pairs,
        "--out",
        tmp_path / "o.safetensors",
        "--save-contexts",
        recorded,
        "--max-steps",
        "10",
        "--dtype",
        "float32",
    )
    assert trained.exit_code == 0, trained.output
    frames = load_contexts(recorded)
    samples, rate = soundfile.read(tmp_path / "a.wav", dtype="float32")  # what qwen-tts's librosa.load reads
    encoded = tiny.codec.encoding_tokenizer().encode(samples, sr=rate).audio_codes[0].numpy()
    assert np.array_equal(frames.codes, encoded) and "teacher-forced: 1 recordings" in frames.source
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"audio": "missing.wav", "text": "Hi."}\n')
    refused = run("train-offsets", "--model", tiny_dir, "--audio", bad, "--out", tmp_path / "p.safetensors")
    assert refused.exit_code == 2 and "bad.jsonl:1: no audio file" in refused.output


def test_synthesis_picks_up_files_made_for_the_loaded_model(
    tmp_path, monkeypatch, small, small_dir, small_frames, tiny
):
    import rvqtts.engine.speculative.offsets
    import rvqtts.engine.speculative.tree
    from rvqtts.engine.speculative.policy import choose_speculation

    shipped_offsets, shipped_trees = tmp_path / "offsets", tmp_path / "trees"
    shipped_trees.mkdir()
    trained = run(
        "train-offsets",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--out",
        shipped_offsets.with_suffix(".safetensors"),
        "--max-steps",
        "50",
        "--learning-rate",
        "0.01",
    )
    assert trained.exit_code == 0, trained.output
    shipped_offsets.mkdir()
    shipped_offsets.with_suffix(".safetensors").rename(shipped_offsets / "small.safetensors")
    calibrated = run(
        "calibrate",
        "--model",
        small_dir,
        "--contexts",
        small_frames,
        "--offsets",
        shipped_offsets / "small.safetensors",
        "--budgets",
        "5",
        "--out-dir",
        shipped_trees,
    )
    assert calibrated.exit_code == 0, calibrated.output
    monkeypatch.setattr(rvqtts.engine.speculative.offsets, "SHIPPED_OFFSETS", shipped_offsets)
    monkeypatch.setattr(rvqtts.engine.speculative.tree, "SHIPPED_TREES", shipped_trees)
    speculation, notice = choose_speculation(small.code_predictor, tree="5")
    assert notice is None and speculation.tree.nodes == 5
    assert np.array_equal(
        speculation.offsets.vectors.numpy(), load_offsets(shipped_offsets / "small.safetensors").vectors.numpy()
    )
    with pytest.raises(ValueError, match="no shipped tree has N = 5"):  # another model passes them over
        choose_speculation(tiny.code_predictor, tree="5")
    _, notice = choose_speculation(tiny.code_predictor, tree=str(shipped_trees / "small-n5.json"))
    assert notice and "zero offsets" in notice
