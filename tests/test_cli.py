"""The command line: make-tiny-model's reproducible checkpoints, and synth's files and refusals."""

from __future__ import annotations

import hashlib

import numpy as np
import soundfile
import torch
from typer.testing import CliRunner

from rvqtts.cli import app
from rvqtts.offsets import Offsets, save_offsets

runner = CliRunner()


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_make_tiny_model_is_byte_reproducible_and_refuses_a_used_folder(tmp_path, tiny_dir):
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert digest(tmp_path / "again") == digest(tiny_dir)
    other = runner.invoke(app, ["make-tiny-model", str(tmp_path / "other"), "--seed", "1", "--codebook", "16",
                                "--code-groups", "4"])
    assert other.exit_code == 0 and digest(tmp_path / "other") != digest(tiny_dir)
    used = runner.invoke(app, ["make-tiny-model", str(tmp_path / "again")])
    assert used.exit_code == 2 and "already exists" in used.output
    bad = runner.invoke(app, ["make-tiny-model", str(tmp_path / "bad"), "--code-groups", "1"])
    assert bad.exit_code == 2 and "--code-groups" in bad.output and not (tmp_path / "bad").exists()


def test_synth_writes_wav_and_codes_and_no_spec_matches(tmp_path, tiny_dir):
    outputs = {}
    for flag in ("--spec", "--no-spec"):
        wav, codes = tmp_path / f"{flag}.wav", tmp_path / f"{flag}.npy"
        result = runner.invoke(app, ["synth", "Hello there.", "--model", str(tiny_dir), "-o", str(wav),
                                     "--codes-out", str(codes), "--seed", "4", flag])
        assert result.exit_code == 0, result.output
        audio, rate = soundfile.read(wav)
        outputs[flag] = (audio, np.load(codes))
        assert rate == 24000 and audio.ndim == 1 and audio.shape[0] == outputs[flag][1].shape[0] * 1920
    assert np.array_equal(outputs["--spec"][1], outputs["--no-spec"][1])
    assert np.array_equal(outputs["--spec"][0], outputs["--no-spec"][0])


def test_synth_refuses_bad_input_and_writes_nothing(tmp_path, tiny_dir):
    bad_tree = tmp_path / "tree.json"
    bad_tree.write_text('{"format": "rvqtts-tree", "depth": 3, "nodes": 1, "paths": [[0, 0]]}')
    shallow = tmp_path / "k2.safetensors"
    save_offsets(Offsets(torch.zeros(2, 64)), shallow)
    cases = [(["Hi", "--model", str(tiny_dir), "--tree", "16", "--offsets", str(shallow)],
              f"tree 16 with offsets {shallow}: the tree is 3 deep but the offsets draft only K = 2 codes"),
             (["", "--model", str(tiny_dir)], "the text is empty"),
             (["Hi", "--model", str(tiny_dir), "--speaker", "nobody"], "Unsupported speakers"),
             (["Hi", "--model", str(tiny_dir), "--tree", str(bad_tree)], "not closed under prefixes"),
             (["Hi", "--model", str(tiny_dir), "--tree", "5"], "no shipped tree has N = 5"),
             (["Hi", "--model", str(tiny_dir), "--offsets", str(tmp_path / "none.safetensors")],
              "cannot read offsets file")]
    for arguments, message in cases:
        output = tmp_path / "out.wav"
        result = runner.invoke(app, ["synth", *arguments, "-o", str(output)])
        assert result.exit_code == 2 and message in result.output, (arguments, result.output)
        assert not output.exists() and not list(tmp_path.glob(".out.wav*"))
