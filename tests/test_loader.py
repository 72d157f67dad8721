"""One loader: `Synthesizer.load(model)` is the engine `rvqtts synth --model model` runs (rvqtts.synthesis.loader)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli

from rvqtts.engine.model.devices import native_bf16_flag
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.synthesizer import Synthesizer

TEXTS = ("The first line.", "A second one.", "And a third.")
FRAMES = 3


@pytest.mark.parametrize("choices", ["fixed", "measured"])
def test_synthesizer_load_with_defaults_makes_the_engine_and_the_files_rvqtts_synth_makes(
    tmp_path, tiny_dir, monkeypatch, request, choices
):
    """Under the fixed rules (bfloat16 where the CPU multiplies it natively, a shipped tree) and under measured
    choices (dtypes, kernels, the online tree size and the batch size timed here), the library's defaults give the
    command line's dtype, decoder dtype, kernels, weights, tree policy and batch size, and so its codes."""
    if choices == "measured":
        request.getfixturevalue("measured")
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"{text}\n" for text in TEXTS))
    stats = tmp_path / "stats.json"
    result = run_cli(
        "synth", "-f", lines, "--out-dir", tmp_path / "out", "--model", tiny_dir, "--max-frames", FRAMES,
        "--stats-json", stats, "--codes-out", tmp_path / "codes",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    command_line = json.loads(stats.read_text())["utterances"]

    synth = Synthesizer.load(tiny_dir)
    batch = [Line(text=text, utterance=number) for number, text in enumerate(TEXTS, start=1)]
    made = dict(synth.synthesize_many(batch, settings=GenerationSettings(max_frames=FRAMES)))
    assert sorted(made) == [0, 1, 2]
    for index, cli in enumerate(command_line):
        record = made[index].record()
        # the online choice's tree size moves with what each run learns and times; a fixed policy's does not
        for key in ("engine", "spec", "weights", "batch_rows") + (("tree_nodes",) if choices == "fixed" else ()):
            assert record[key] == cli[key], key
        assert (record["online"] is None) == (cli["online"] is None)
        codes = np.load(tmp_path / "codes" / f"{index + 1:04d}.npy")
        assert np.array_equal(made[index].codes, codes)
    if choices == "fixed":  # the fixed rules, not Synthesizer.from_checkpoint's float32
        assert record["engine"]["dtype"] == ("bfloat16" if native_bf16_flag() else "float32")
        assert record["online"] is None
    else:
        assert record["online"] is not None


def test_engine_choices_refuse_what_is_not_a_choice():
    for bad, message in (
        (dict(dtype="float8"), "unknown --dtype 'float8': choose auto, float32"),
        (dict(decoder_dtype="int8"), "unknown --decoder-dtype 'int8'"),
        (dict(weights="int2"), "unknown --weights 'int2': choose native, int8 or int4"),
        (dict(batch_size=0), "the batch size must be at least 1"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineChoices(**bad)
