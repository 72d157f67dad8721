"""The stand-in pipeline (`rvqtts standin build --small`): it runs, learns, reports every field, and its
model runs through the engine's ordinary path."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from rvqtts.cli import app
from rvqtts.engine.loop.inner_loop import InnerLoop
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import load_acceptance, load_tree, resolve_tree
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.contexts import load_contexts
from rvqtts.tuning.standin.codec import ResidualCodec, frame_features
from rvqtts.tuning.standin.corpus import LANGUAGES, speak, split_of

if shutil.which("espeak-ng") is None:
    if os.environ.get("CI"):
        pytest.fail("CI must install espeak-ng (.ci/run does)", pytrace=False)
    pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)", allow_module_level=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("standin") / "small"
    result = CliRunner().invoke(app, ["standin", "build", str(out), "--small"])
    assert result.exit_code == 0, result.output
    return out, json.loads((out / "report.json").read_text()), result.output


def test_report_holds_every_field(built):
    out, report, output = built
    assert len(report["entropy_bits"]) == 15 and len(report["chain_gain_bits"]) == 15
    assert len(report["draft_top1_by_depth"]) == 3
    assert set(report["reused_heads_codes_per_call"]) == {"4", "8", "16", "32", "64"}
    for row in report["reused_heads_codes_per_call"].values():
        assert 1.0 <= row["ci95"][0] <= row["codes_per_call"] <= row["ci95"][1] <= 3.0
        assert set(row["per_language"]) == set(LANGUAGES) and row["tree"]
    for key in ("offsets_codes_per_call", "medusa_codes_per_call"):
        assert set(report[key]) == {"4", "8", "16", "32", "64"}
    assert set(report["drafters"]) == {"reused heads", "offsets", "medusa heads"}  # --small: the paper's three
    assert report["drafter_parameters"] == {
        "reused heads": 0,
        "offsets": 3 * 64,
        "medusa heads": 3 * 15 * (64 * 64 + 64),
    }
    assert report["offsets_training"]["held_out_loss"] <= report["offsets_training"]["initial_held_out_loss"]
    assert (out / "offsets.safetensors").is_file()
    for drafter in ("reused-heads", "offsets"):
        assert [load_tree(out / "trees" / f"stand-in-{drafter}-n{n}.json").nodes for n in (4, 8, 16, 32, 64)] == [
            4,
            8,
            16,
            32,
            64,
        ]
        table = load_acceptance(out / "trees" / f"stand-in-{drafter}-acceptance.json")
        assert table["acceptance"] == report[f"{drafter.replace('-', '_')}_acceptance"]
    assert all(f"{code}/train" in report["corpus"]["seconds"] for code in LANGUAGES)
    assert "chain gain bits" in output and "codes per predictor call" in output
    assert (out / "sample.wav").is_file() and (out / "codec.npz").is_file()


def test_the_stand_in_learned_c1_from_its_context(built):
    _, report, _ = built
    # Chance is 1/128; the small stand-in reaches about 0.17 after 150 steps.
    assert report["c1_top1_accuracy"] > 8 * report["chance_top1_accuracy"]
    assert all(0 < h < 7 for h in report["entropy_bits"])  # a peaked distribution, below log2(128) = 7 bits


def test_the_engine_runs_on_the_stand_in_unchanged(built):
    out, _, _ = built
    synth = Synthesizer.from_checkpoint(out / "model")
    frames = load_contexts(out / "contexts.npz", "evaluation").take(np.arange(40))
    prefixes = frames.prefixes(synth.talker.get_input_embeddings())
    plain = InnerLoop(synth.code_predictor, None, seed=3)
    spec = InnerLoop(synth.code_predictor, Speculation(resolve_tree("16"), Offsets.zeros(3, synth.hidden_size)), seed=3)
    for frame, prefix in enumerate(prefixes):
        assert spec.frame(prefix, SamplingConfig(), 0, frame) == plain.frame(prefix, SamplingConfig(), 0, frame)
    assert spec.stats.calls < plain.stats.calls


def test_codec_round_trip_and_splits():
    audio = speak("The quick brown fox jumps over the lazy dog.", "en-us", "m1", 150, 50)
    assert audio.dtype == np.float32 and abs(audio.size / 24000 - 2.5) < 1.5
    features = frame_features(audio)
    assert features.shape[1] == 128 and features.shape[0] == audio.size // 1920
    noisy = np.tile(features, (4, 1)) + np.random.default_rng(0).normal(0, 0.1, (4 * len(features), 128))
    codec = ResidualCodec.fit(noisy.astype(np.float32), 16, seed=1)
    codes = codec.encode(features)
    assert codes.shape == (len(features), 16) and np.array_equal(codes, codec.encode(features))

    def error(levels: int) -> float:
        return float(np.abs(codec.decode(codes[:, :levels]) - features).mean())

    assert error(16) < error(4) < error(1) < float(np.abs(codec.mean - features).mean())
    assert [split_of(i) for i in range(8)] == ["evaluation", "calibration"] + ["train"] * 5 + ["evaluation"]
