"""The command line on the tiny checkpoint: files, statistics, seeds, A/B, batches, streams, refusals."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
from faults import failing_prompts
from typer.testing import CliRunner

import rvqtts.synthesis.pipeline as pipeline
from rvqtts.cli import app
from rvqtts.engine.speculative.offsets import Offsets, save_offsets
from rvqtts.support.files import current_umask
from rvqtts.synthesis.synthesizer import Synthesizer

runner = CliRunner()


def digest(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def synth(*arguments, input=None):
    return runner.invoke(app, ["synth", *map(str, arguments)], input=input)


def test_make_tiny_model_is_byte_reproducible_and_refuses_a_used_folder(tmp_path, tiny_dir):
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    assert digest(tmp_path / "again") == digest(tiny_dir)
    assert (tmp_path / "again").stat().st_mode & 0o777 == 0o777 & ~current_umask()
    other = runner.invoke(
        app, ["make-tiny-model", str(tmp_path / "other"), "--seed", "1", "--codebook", "16", "--code-groups", "4"]
    )
    assert other.exit_code == 0 and digest(tmp_path / "other") != digest(tiny_dir)
    used = runner.invoke(app, ["make-tiny-model", str(tmp_path / "again")])
    assert used.exit_code == 2 and "already exists" in used.output
    bad = runner.invoke(app, ["make-tiny-model", str(tmp_path / "bad"), "--code-groups", "1"])
    assert bad.exit_code == 2 and "--code-groups" in bad.output and not (tmp_path / "bad").exists()


def run_one(tmp_path, tiny_dir, name, *extra):
    """A float32 run of 16 frames with the 15-node tree (the defaults depend on the CPU), or as `extra` says."""
    wav, codes, stats = (tmp_path / f"{name}.{suffix}" for suffix in ("wav", "npy", "json"))
    result = synth(
        "Hello there.",
        "--model",
        tiny_dir,
        "-o",
        wav,
        "--codes-out",
        codes,
        "--stats-json",
        stats,
        "--dtype",
        "float32",
        "--tree",
        "15",
        "--max-frames",
        "16",  # the tiny model never ends its speech: what is checked holds at any length
        *extra,
    )
    assert result.exit_code == 0, result.output
    return wav.read_bytes(), np.load(codes), json.loads(stats.read_text())


def test_synth_wav_codes_and_statistics_agree(tmp_path, tiny_dir):
    wav, codes, stats = run_one(tmp_path, tiny_dir, "spec", "--seed", "4")
    audio, rate = soundfile.read(io.BytesIO(wav))
    frames = codes.shape[0]
    assert rate == 24000 and audio.ndim == 1 and audio.shape[0] == frames * 1920 and codes.shape == (frames, 16)
    record = stats["utterances"][0]
    assert record["frames"] == frames and record["audio_seconds"] == pytest.approx(frames * 0.08)
    assert record["predictor_codes"] == 15 * frames
    assert record["predictor_calls"] * record["codes_per_call"] == pytest.approx(record["predictor_codes"], rel=1e-4)
    # the tiny model never ends its speech: a prefill and a step per frame but the last, whose c0 is unused
    assert record["talker_calls"] == frames and record["chunks"] == 1
    assert record["spec"] is True and record["tree_nodes"] == 15 and record["seed"] == 4
    assert record["rtf"] == pytest.approx(record["wall_seconds"] / record["audio_seconds"], rel=1e-2)
    parts = record["talker_seconds"] + record["predictor_seconds"] + record["decoder_seconds"]
    # relative, as a slower (shared) machine stretches every part alike; 10 ms for four figures rounded to the ms and
    # the Python between them on a loaded machine (a full suite beside it: 7 ms of 348 were no part's)
    assert parts == pytest.approx(record["wall_seconds"], rel=0.02, abs=0.01)
    assert stats["total"]["frames"] == frames and stats["total"]["utterances"] == 1
    # the process's memory: a run that loaded torch and a model holds well over 100 MiB, and never more than its peak
    assert stats["memory"]["peak_rss_mib"] >= stats["memory"]["rss_mib"] > 100


def test_same_seed_same_wav_and_no_spec_gives_the_same_codes(tmp_path, tiny_dir):
    first = run_one(tmp_path, tiny_dir, "a", "--seed", "4")
    again = run_one(tmp_path, tiny_dir, "b", "--seed", "4")
    plain = run_one(tmp_path, tiny_dir, "c", "--seed", "4", "--no-spec")
    other = run_one(tmp_path, tiny_dir, "d", "--seed", "5")
    assert first[0] == again[0] and np.array_equal(first[1], again[1])
    assert first[0] == plain[0] and np.array_equal(first[1], plain[1])
    assert plain[2]["utterances"][0]["spec"] is False
    assert plain[2]["utterances"][0]["predictor_calls"] == 15 * plain[1].shape[0]
    assert not np.array_equal(first[1], other[1])


def test_stdin_in_and_stdout_out(tiny_dir):
    result = synth("-", "--model", tiny_dir, "-o", "-", "--quiet", input="Read from standard input.")
    assert result.exit_code == 0, result.stderr
    audio, rate = soundfile.read(io.BytesIO(result.stdout_bytes))
    assert rate == 24000 and audio.size > 0 and result.stderr == ""
    no_argument = synth("--model", tiny_dir, "-o", "-", "-q", input="Also without a dash.")
    assert no_argument.exit_code == 0 and no_argument.stdout_bytes[:4] == b"RIFF"


def test_long_text_is_chunked_and_joined(tmp_path, tiny_dir):
    sentence = "This sentence is part of a long text that must be spoken in several chunks."
    text = " ".join([sentence] * 8)
    stats = tmp_path / "long.json"
    result = synth(text, "--model", tiny_dir, "-o", tmp_path / "long.wav", "--stats-json", stats)
    assert result.exit_code == 0, result.output
    record = json.loads(stats.read_text())["utterances"][0]
    assert record["chunks"] == 3  # 8 x 76 characters in chunks of at most 240
    # every chunk is cut: a prefill, then a step per frame but the last
    assert record["talker_calls"] == record["frames"]
    audio, _ = soundfile.read(tmp_path / "long.wav")
    assert audio.shape[0] == record["frames"] * 1920 - 2 * 1200  # two 50 ms crossfades
    assert "was cut at" in result.output and len(record["warnings"]) == 3  # the tiny model never ends speech


def test_batch_writes_resumes_and_skips(tmp_path, tiny_dir):
    batch = tmp_path / "lines.jsonl"
    batch.write_text(
        '{"text": "One.", "out": "one"}\n{"text": "Two.", "speaker": "ryan"}\n'
        '{"text": "Three.", "language": "german"}\n'
    )
    out, short = tmp_path / "out", ("--max-frames", 8)  # the tiny model never ends its speech
    result = synth("-f", batch, "--out-dir", out, "--model", tiny_dir, *short, "--stats-json", tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["0002.wav", "0003.wav", "manifest.jsonl", "one.wav"]
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(m["name"], m["speaker"], m["language"]) for m in manifest] == [
        ("one.wav", "vivian", "auto"),
        ("0002.wav", "ryan", "auto"),
        ("0003.wav", "vivian", "german"),
    ]
    stats = json.loads((tmp_path / "s.json").read_text())
    assert len(stats["utterances"]) == 3 and stats["total"]["frames"] == sum(m["frames"] for m in manifest)
    kept = (out / "one.wav").read_bytes()
    (out / "0002.wav").unlink()
    (out / "one.wav").write_bytes(b"stale")  # an existing output is skipped, whatever it holds
    again = synth("-f", batch, "--out-dir", out, "--model", tiny_dir, *short)
    assert again.exit_code == 0 and "1 written, 2 skipped" in again.output
    assert (out / "0002.wav").exists() and (out / "one.wav").read_bytes() == b"stale"
    forced = synth("-f", batch, "--out-dir", out, "--model", tiny_dir, *short, "--force")
    assert forced.exit_code == 0 and (out / "one.wav").read_bytes() == kept  # same seed, same line, same audio
    done = synth("-f", batch, "--out-dir", out, "--model", "no-such-model-folder")
    assert done.exit_code == 0 and "already in" in done.output  # nothing to do: the model is not even loaded


def test_a_failing_utterance_does_not_stop_the_batch(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setattr(pipeline, "line_prompts", failing_prompts(pipeline.line_prompts))
    batch = tmp_path / "lines.txt"
    batch.write_text("Fine.\nBreak.\nAlso fine.\n")
    result = synth("-f", batch, "--out-dir", tmp_path / "out", "--model", tiny_dir, "--max-frames", 8)
    assert result.exit_code == 1
    assert "lines.txt:2: failed: RuntimeError: simulated failure" in result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0001.wav", "0003.wav", "manifest.jsonl"]


def test_voices_lists_speakers_and_languages(tiny_dir):
    result = runner.invoke(app, ["voices", "--model", str(tiny_dir)])
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        "kind: CustomVoice (built-in speakers (--speaker), a style instruction (--instruct) on the 1.7B)",
        "speakers: aiden, dylan, eric, ono_anna, ryan, serena, sohee, uncle_fu, vivian",
        "languages: auto, chinese, english, french, german, italian, japanese, korean, portuguese, russian, spanish",
    ]


def test_bad_input_exits_2_with_its_message_and_writes_nothing(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setattr("rvqtts.cli.synth.check_coreml", lambda *settings: None)  # as if on a Mac with coremltools
    bad_tree = tmp_path / "tree.json"
    bad_tree.write_text('{"format": "rvqtts-tree", "depth": 3, "nodes": 1, "paths": [[0, 0]]}')
    shallow, wide = tmp_path / "k2.safetensors", tmp_path / "wide.safetensors"
    save_offsets(Offsets(torch.zeros(2, 64)), shallow)
    save_offsets(Offsets(torch.zeros(3, 1024)), wide)
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"text": "fine"}\n{"text": "oops",}\n')
    unknown_voice = tmp_path / "voice.jsonl"
    unknown_voice.write_text('{"text": "fine"}\n{"text": "who", "speaker": "nobody"}\n')
    a_file = tmp_path / "plain-file"
    a_file.write_text("")
    model = ["--model", tiny_dir]
    single = tmp_path / "out.wav"
    cases = [
        (["", *model, "-o", single], "the text is empty"),
        (["Hi", *model, "-o", single, "--speaker", "nobody"], "unknown speaker 'nobody'; this model has: aiden"),
        (["Hi", *model, "-o", single, "--language", "klingon"], "unknown language 'klingon'"),
        (["Hi", *model, "-o", single, "--tree", bad_tree], "not closed under prefixes"),
        (["Hi", *model, "-o", single, "--tree", "5"], "no shipped tree has N = 5"),
        (["Hi", *model, "-o", single, "--offsets", tmp_path / "none.safetensors"], "cannot read offsets file"),
        (
            ["Hi", *model, "-o", single, "--offsets", wide],
            "has hidden size 1024, but the model's code predictor has 64",
        ),
        (
            ["Hi", *model, "-o", single, "--offsets", shallow],
            "the tree is 3 deep but the offsets draft only K = 2 codes",
        ),
        (  # --no-spec: the Core ML package's tree is chosen after the model loads
            ["Hi", *model, "-o", single, "--backend", "coreml", "--no-spec", "--tree", "8", "--offsets", shallow],
            "the tree is 3 deep but the offsets draft only K = 2 codes",
        ),
        (["Hi", *model, "-o", a_file / "out.wav"], "is a file, not a folder"),
        (["Hi", *model, "-o", single, "--top-p", "0"], "top_p must be in (0, 1]"),
        (["Hi", *model, "-o", single, "--temperature", "-1"], "temperature must be 0 (greedy) or positive"),
        (["Hi", *model, "-o", single, "--repetition-penalty", "1e-300"], "must be between 0.01 and 100.0"),
        (["Hi", "--model", tmp_path / "missing-model", "-o", single], "no model folder"),
        (
            ["Hi", "--model", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "-o", single],
            "the Hugging Face hub cannot be reached and the model is not in the local cache; pass --model PATH",
        ),
        (["-f", tmp_path / "missing.txt", "--out-dir", tmp_path / "batch", *model], "cannot read batch file"),
        (["-f", malformed, "--out-dir", tmp_path / "batch", *model], "bad.jsonl:2: not valid JSON"),
        (["-f", unknown_voice, "--out-dir", tmp_path / "batch", *model], "voice.jsonl:2: unknown speaker 'nobody'"),
        (["-f", malformed, *model], "-f needs --out-dir"),
    ]
    before = sorted(tmp_path.rglob("*")), digest(tmp_path)
    for arguments, message in cases:
        result = synth(*arguments)
        assert result.exit_code == 2, (arguments, result.output)
        assert message in result.stderr, (arguments, result.stderr)
        assert result.stderr.count("error:") == 1 and result.stdout == ""
        assert (sorted(tmp_path.rglob("*")), digest(tmp_path)) == before, f"{arguments} wrote something"


def test_instruct_is_ignored_with_a_warning_on_a_model_without_it(tmp_path, tiny_dir):
    plain = synth("Hi.", "--model", tiny_dir, "-o", tmp_path / "a.wav", "--seed", "2")
    styled = synth("Hi.", "--model", tiny_dir, "-o", tmp_path / "b.wav", "--seed", "2", "--instruct", "whisper")
    assert styled.exit_code == 0 and "does not support --instruct" in styled.stderr
    assert "does not support --instruct" not in plain.stderr
    assert (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()


def test_input_that_needs_no_model_is_refused_before_the_model_loads(tmp_path, tiny_dir, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Synthesizer, "from_checkpoint", no_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, whatever this one is
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    base = tmp_path / "base-model"
    base.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tts_model_type": "base"}))
    model = ["--model", tiny_dir]
    out, folder = tmp_path / "out.wav", tmp_path / "folder.wav"
    folder.mkdir()
    cases = [
        (["Hi", *model, "-o", out, "--speaker", "nobody"], [], "unknown speaker 'nobody'"),
        (["Hi", *model, "-o", out, "--language", "klingon"], [], "unknown language 'klingon'"),
        (["Hi", *model, "-o", "/proc/none/x.wav"], [], "cannot write /proc/none/x.wav"),
        (["Hi", *model, "-o", out, "--stats-json", "/proc/none/s.json"], [], "cannot write /proc/none/s.json"),
        (["Hi", *model, "-o", out, "--codes-out", "/proc/none/c.npy"], [], "cannot write /proc/none/c.npy"),
        (["-f", tmp_path / "none.txt", *model, "--out-dir", "/proc/none/d"], [], "cannot read batch file"),
        (["Hi", *model, "-o", tmp_path / "x.aac"], [], "writes .wav, .flac, .ogg, .mp3, .opus files"),
        (["Hi", *model, "-o", folder], [], "it is a folder"),
        (["Hi", *model, "-o", out, "--device", "cuda"], [], "--device cuda: this torch is built without CUDA"),
        (["Hi", *model, "-o", out, "--device", "mps"], [], "--device mps: MPS is not available here"),
        (["-", *model, "-o", out], b"caf\xe9\n", "standard input is not UTF-8 text (byte 3"),
        (["Hi", *model, "-o", out, "--chunk-chars", "5"], [], "--chunk-chars must be at least 20"),
        (["Hi", "--model", base, "-o", out], [], "a Base model speaks a cloned voice: give a voice file"),
    ]
    lines = tmp_path / "lines.txt"
    lines.write_text("One.\n")
    cases.append((["-f", lines, *model, "--out-dir", "/proc/none/d"], [], "cannot write /proc/none/d"))
    before = sorted(tmp_path.rglob("*")), digest(tmp_path)
    for arguments, stdin, message in cases:
        result = synth(*arguments, input=stdin or None)
        assert result.exit_code == 2, (arguments, result.output)
        assert message in result.stderr, (arguments, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stdout == ""
        assert (sorted(tmp_path.rglob("*")), digest(tmp_path)) == before, f"{arguments} wrote something"
    listing = runner.invoke(app, ["voices", "--model", str(base)])  # it reads the config: any 12 Hz kind
    assert listing.exit_code == 0 and listing.stdout.startswith("kind: Base (a voice cloned from reference audio")
    other = base / "config.json"
    other.write_text(json.dumps({**config, "tokenizer_type": "qwen3_tts_tokenizer_25hz"}))
    listing = runner.invoke(app, ["voices", "--model", str(base)])
    assert listing.exit_code == 2 and "rvqtts runs the 12 Hz models" in listing.stderr and listing.stdout == ""


def test_output_formats_follow_the_suffix(tmp_path, tiny_dir):
    for suffix, container in (("flac", "FLAC"), ("ogg", "OGG"), ("WAV", "WAV")):
        target = tmp_path / f"out.{suffix}"
        result = synth("Hi.", "--model", tiny_dir, "-o", target, "--max-frames", "4", "-q")
        assert result.exit_code == 0, result.output
        info = soundfile.info(target)
        assert info.format == container and info.samplerate == 24000 and info.frames == 4 * 1920


def test_max_frames_raises_the_limit_and_no_chunk_speaks_in_one_pass(tmp_path, tiny_dir):
    stats = tmp_path / "s.json"
    result = synth(
        "Hi.", "--model", tiny_dir, "-o", tmp_path / "a.wav", "--max-frames", "40", "--stats-json", stats, "--no-spec"
    )
    record = json.loads(stats.read_text())["utterances"][0]
    assert result.exit_code == 0 and record["frames"] == 40  # "Hi." alone warrants 33 frames
    assert record["accepted_per_depth"] == [0, 0, 0]  # K entries also when nothing was drafted
    text = "One short sentence. Another short sentence. A third short one."
    for extra, chunks in ((["--chunk-chars", "25"], 3), (["--no-chunk"], 1)):
        result = synth(
            text, "--model", tiny_dir, "-o", tmp_path / "b.wav", "--max-frames", "3", "--stats-json", stats, *extra
        )
        record = json.loads(stats.read_text())["utterances"][0]
        assert result.exit_code == 0 and record["chunks"] == chunks and record["frames"] == 3 * chunks
        assert len(record["accepted_per_depth"]) == 3


def test_sampling_defaults_come_from_the_checkpoint_and_flags_override(tmp_path, tiny_dir):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    generation = json.loads((model / "generation_config.json").read_text())
    generation.update(temperature=0.8, top_k=30, subtalker_temperature=0.6, subtalker_top_k=7, repetition_penalty=1.2)
    (model / "generation_config.json").write_text(json.dumps(generation))
    stats = tmp_path / "s.json"

    def sampling(*flags):
        result = synth(
            "Hi.", "--model", model, "-o", tmp_path / "a.wav", "--max-frames", "2", "--stats-json", stats, *flags
        )
        assert result.exit_code == 0, result.output
        return json.loads(stats.read_text())["utterances"][0]["sampling"]

    assert sampling() == {
        "talker": {"temperature": 0.8, "top_k": 30, "top_p": 1.0, "do_sample": True, "repetition_penalty": 1.2},
        "predictor": {"temperature": 0.6, "top_k": 7, "top_p": 1.0, "do_sample": True},
    }
    both = sampling("--temperature", "0.5", "--top-k", "9")
    assert both["talker"]["temperature"] == both["predictor"]["temperature"] == 0.5
    assert both["talker"]["top_k"] == both["predictor"]["top_k"] == 9
    apart = sampling("--temperature", "0.5", "--predictor-temperature", "0.7", "--predictor-top-k", "4")
    assert apart["talker"]["temperature"] == 0.5 and apart["predictor"]["temperature"] == 0.7
    assert apart["talker"]["top_k"] == 30 and apart["predictor"]["top_k"] == 4


def test_non_finite_logits_stop_with_the_dtype_and_a_suggestion(tmp_path, tiny_dir):
    from rvqtts.engine.model.sampling import NonFiniteError
    from rvqtts.synthesis.settings import GenerationSettings

    for part in ("talker", "predictor"):
        synthesizer = Synthesizer.from_checkpoint(tiny_dir)
        module = synthesizer.talker.codec_head if part == "talker" else synthesizer.code_predictor.lm_head[3]
        with torch.no_grad():
            module.weight[5, 0] = float("nan")
        with pytest.raises(
            NonFiniteError,
            match=f"the {'talker' if part == 'talker' else 'code predictor'} produced NaN or inf values in float32",
        ):
            synthesizer.synthesize("Hi.", speaker="vivian", settings=GenerationSettings(max_frames=3))


def test_the_command_line_basics(tmp_path, tiny_dir):
    from importlib.metadata import version

    assert runner.invoke(app, ["--version"]).stdout == f"rvqtts {version('rvqtts')}\n"
    used = runner.invoke(app, ["make-tiny-model", str(tiny_dir)])
    assert used.exit_code == 2 and "pass --force" in used.stderr
    for command in (["synth"], ["make-tiny-model"], ["bench", "e2e"], ["train-offsets"]):
        help_text = runner.invoke(app, [*command, "--help"]).stdout
        assert "--help" in help_text and "<bool>" not in help_text and "BOOLEAN" not in help_text


def test_the_statistics_table_never_cuts_a_figure():
    from rich.console import Console

    from rvqtts.support.report import stats_table

    record = dict(
        frames=1234,
        audio_seconds=98.72,
        predictor_calls=12345,
        codes_per_call=1.23456,
        wall_seconds=123.456,
        talker_seconds=45.678,
        predictor_seconds=67.891,
        decoder_seconds=9.876,
        rtf=1.2506,
        spec=True,
        tree_nodes=15,
    )
    console = Console(width=110, record=True, file=io.StringIO())
    console.print(stats_table([("/a/very/long/output/folder/name/that/goes/on/and/on/utterance-0001.wav", record)]))
    shown = console.export_text()
    for figure in ("1234", "98.72", "12345", "1.23", "123.46", "45.68", "67.89", "9.88", "1.25"):
        assert figure in shown, (figure, shown)


@pytest.mark.parametrize("flag", ["amx_bf16", None])
def test_the_default_run_picks_its_dtype_and_tree_by_what_was_measured(tmp_path, tiny_dir, monkeypatch, flag):
    """On a CPU that multiplies bfloat16 natively: bfloat16; elsewhere float32. Both run the plain loop
    (`cpu/bfloat16` and `cpu/float32` in trees/best-n.json: no tree was measured to pay on a CPU), and say so."""
    import rvqtts.engine.model.devices

    monkeypatch.setattr(rvqtts.engine.model.devices, "native_bf16_flag", lambda: flag)
    stats = tmp_path / "s.json"
    result = synth("Hi.", "--model", tiny_dir, "-o", tmp_path / "a.wav", "--max-frames", "3", "--stats-json", stats)
    assert result.exit_code == 0, result.output
    record = json.loads(stats.read_text())["utterances"][0]
    platform = "cpu/bfloat16" if flag else "cpu/float32"
    if flag:
        assert "bfloat16: this CPU multiplies bfloat16 natively (amx_bf16)" in result.stderr
    else:
        assert "bfloat16" not in result.stderr
    assert record["spec"] is False and record["tree_nodes"] == 0
    assert f"plain inner loop: no tree was measured to pay for this model on {platform}" in result.stderr


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch):
    from rvqtts.engine.model.devices import native_bf16_flag, pick_dtype

    monkeypatch.delenv("RVQTTS_ISA", raising=False)  # the flags as given (the cap is tests/test_devices.py's)

    assert native_bf16_flag("processor\t: 0\nflags\t\t: fpu sse avx512f amx_tile amx_bf16\n") == "amx_bf16"
    assert native_bf16_flag("flags\t\t: fpu avx2 avx512_bf16\n") == "avx512_bf16"
    assert native_bf16_flag("flags\t\t: fpu avx2 avx512f\n") is None and native_bf16_flag("") is None
    assert pick_dtype("auto", "cuda:1") == ("bfloat16", None) and pick_dtype("auto", "mps") == ("float16", None)
    assert pick_dtype("float16", "cpu") == ("float16", None)


def test_voices_and_a_refused_speaker_are_answered_from_the_config_alone(tiny_dir):
    """`rvqtts voices` reads config.json only (no torch, no qwen-tts: an answer in well under a second), and
    synth refuses an unknown speaker of one text before torch is imported (half a second on the Xeon)."""
    script = (
        "import sys; from typer.testing import CliRunner; from rvqtts.cli import app; "
        f"listed = CliRunner().invoke(app, ['voices', '--model', {str(tiny_dir)!r}]); "
        "print(listed.exit_code, 'torch' in sys.modules, 'qwen_tts' in sys.modules); "
        f"refused = CliRunner().invoke(app, ['synth', 'Hi.', '--model', {str(tiny_dir)!r}, '--speaker', 'nobody']); "
        "print(refused.exit_code, 'torch' in sys.modules, 'qwen_tts' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["0", "False", "False", "2", "False", "False"], result.stderr
