"""`rvqtts read` on the tiny checkpoint: a Markdown book to chapter files, captions, an .m4b read back with PyAV and a
manifest; the same bytes whatever the batch size, after kill -9 and a resume, after a full disk and a rerun; a chunk's
audio exactly `rvqtts synth`'s with its seed (rvqtts.documents.narration)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from rvqtts.documents.narration import ReadingOptions, narrate
from rvqtts.synthesis.settings import GenerationSettings, Line
from tests.helpers import run_cli, wait_until

KEEPER = Path(__file__).parent / "data" / "keeper.md"
FRAMES = ("--max-frames", "6")  # random weights rarely end their speech: every chunk is cut here
AAC_FRAME_SECONDS = 1024 / 24000


def read_book(tiny_dir: Path, out: Path, *extra: object):
    return run_cli("read", KEEPER, "--out-dir", out, "--model", tiny_dir, "--seed", 5, *FRAMES, *extra)


def outputs(folder: Path) -> dict[str, bytes]:
    """Every file a reading leaves besides its manifest (which holds its timings) and the chunk store."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory) -> Path:
    """The book read in one uninterrupted run, three chunks at a time."""
    out = tmp_path_factory.mktemp("reference") / "book"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RVQTTS_CACHE", str(out.parent / "cache"))
        result = read_book(tiny_dir, out, "--batch-size", 3)
    assert result.exit_code == 0, result.output
    return out


def test_a_book_becomes_chapter_files_captions_an_audiobook_and_a_manifest(reference):
    import av

    manifest = json.loads((reference / "manifest.json").read_text())
    chapters = manifest["chapters"]
    assert [c["file"] for c in chapters] == [
        "01-chapter-one-the-storm.wav",
        "02-chapter-two-the-ship.wav",
        "03-chapter-three-the-morning.wav",
    ]
    for chapter in chapters:
        samples, rate = soundfile.read(reference / chapter["file"], dtype="float32")
        assert samples.size / rate == pytest.approx(chapter["seconds"], abs=1e-3)
        chunks = chapter["chunks"]
        assert chunks[0]["start"] == 0 and chunks[-1]["end"] == pytest.approx(chapter["seconds"], abs=1e-3)
        for before, after in zip(chunks, chunks[1:]):  # a crossfade within a paragraph, a pause between them
            gap = after["start"] - before["end"]
            assert gap == pytest.approx(0.5 if after["paragraph"] != before["paragraph"] else -0.05, abs=1e-3)
        srt = (reference / chapter["captions"][0]).read_text()
        vtt = (reference / chapter["captions"][1]).read_text()
        assert vtt.startswith("WEBVTT\n\n") and srt.startswith("1\n00:00:00,000 --> ")
        assert srt.count(" --> ") == vtt.count(" --> ") > len(chunks) - 1  # a cue per sentence
        last_end = srt.strip().split("\n\n")[-1].split("\n")[1].split(" --> ")[1]
        assert last_end == _clock(chapter["seconds"])
    assert "Thank you, keeper." in (reference / "03-chapter-three-the-morning.srt").read_text()
    assert len(manifest["warnings"]) == sum(len(c["chunks"]) for c in chapters)  # every chunk cut at 6 frames
    book = manifest["audiobook"]
    with av.open(str(reference / book["file"])) as container:
        assert container.metadata["title"] == "The Keeper of the Northern Light"
        marks = container.chapters()
        duration = container.duration / 1e6
    assert [mark["metadata"]["title"] for mark in marks] == [c["title"] for c in chapters]
    start = 0.0
    for mark, chapter in zip(marks, chapters):  # each chapter's first sample, within one AAC frame
        assert abs(float(mark["start"] * mark["time_base"]) - start) <= AAC_FRAME_SECONDS
        start += chapter["seconds"] + 2.0
    assert duration == pytest.approx(start, abs=2 * AAC_FRAME_SECONDS)


def _clock(seconds: float) -> str:
    millis = round(seconds * 1000)
    return f"00:{millis // 60000:02d}:{millis // 1000 % 60:02d},{millis % 1000:03d}"


def test_a_chunk_is_what_synth_makes_with_its_seed(reference, tiny_dir, tmp_path):
    chunk = json.loads((reference / "manifest.json").read_text())["chapters"][1]["chunks"][2]
    result = run_cli(
        "synth", chunk["text"], "--seed", chunk["seed"], "--model", tiny_dir, *FRAMES, "-o", tmp_path / "one.wav"
    )
    assert result.exit_code == 0, result.output
    alone, _ = soundfile.read(tmp_path / "one.wav", dtype="int16")
    key = json.loads((reference / "manifest.json").read_text())["chapters"][1]["keys"][2]
    stored, _ = soundfile.read(reference / ".chunks" / f"{key}.flac", dtype="int16")
    np.testing.assert_array_equal(stored, alone)


def test_one_row_at_a_time_writes_the_same_files(reference, tiny_dir, tmp_path):
    result = read_book(tiny_dir, tmp_path / "book", "--batch-size", 1)
    assert result.exit_code == 0, result.output
    assert outputs(tmp_path / "book") == outputs(reference)


def test_kill_9_then_the_same_command_ends_with_the_same_bytes(reference, tiny_dir, tmp_path):
    out = tmp_path / "book"
    command = [sys.executable, "-m", "rvqtts.cli", "read", str(KEEPER), "--out-dir", str(out), "--model", str(tiny_dir)]
    command += ["--seed", "5", *FRAMES, "--batch-size", "1", "-q"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(list((out / ".chunks").glob("*.flac"))) >= 3, 120, "three chunks stored")
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(30)
    assert process.returncode == -signal.SIGKILL
    assert not list(out.glob("*.m4b")) and len(list((out / ".chunks").glob("*.flac"))) < 20
    result = read_book(tiny_dir, out, "--batch-size", 1)
    assert result.exit_code == 0, result.output
    assert outputs(out) == outputs(reference)
    assert not [p for p in out.rglob("*") if p.name.endswith(".partial")]


def test_a_full_disk_keeps_the_chapters_finished_and_a_rerun_resumes(reference, tiny_dir, tmp_path, monkeypatch):
    from rvqtts.documents import chapter_files, chunk_store

    out, written = tmp_path / "book", []
    real_write = chunk_store.write_atomically

    def filling(path, data):
        if len(written) == 9:  # chapter one is 7 chunks, written with its captions: the disk fills in chapter two
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        written.append(path)
        real_write(path, data)

    for module in (chunk_store, chapter_files):
        monkeypatch.setattr(module, "write_atomically", filling)
    result = read_book(tiny_dir, out)
    assert result.exit_code == 2 and "No space left on device" in result.output and "again" in result.output
    assert (out / "01-chapter-one-the-storm.wav").read_bytes() == (
        reference / "01-chapter-one-the-storm.wav"
    ).read_bytes()
    assert not (out / "02-chapter-two-the-ship.wav").exists()
    for module in (chunk_store, chapter_files):
        monkeypatch.setattr(module, "write_atomically", real_write)
    result = read_book(tiny_dir, out)
    assert result.exit_code == 0, result.output
    assert outputs(out) == outputs(reference)


def test_chapters_asked_for_alone_then_kept_unless_forced(reference, tiny_dir, tmp_path):
    out = tmp_path / "book"
    result = read_book(tiny_dir, out, "--chapters", "2")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("*.wav")) == ["02-chapter-two-the-ship.wav"] and not list(out.glob("*.m4b"))
    assert "the audiobook is made once every chapter is" in result.output
    made = (out / "02-chapter-two-the-ship.wav").stat().st_mtime_ns
    result = read_book(tiny_dir, out)
    assert result.exit_code == 0 and "2 chapters made, 1 already there" in result.output, result.output
    assert (out / "02-chapter-two-the-ship.wav").stat().st_mtime_ns == made  # a finished chapter is not rewritten
    assert outputs(out) == outputs(reference)
    other = run_cli("read", KEEPER, "--out-dir", out, "--model", tiny_dir, "--seed", 6, *FRAMES, "--chapters", "2")
    assert "made with other text, settings or pauses and is kept" in other.output
    assert (out / "02-chapter-two-the-ship.wav").stat().st_mtime_ns == made
    forced = run_cli(
        "read", KEEPER, "--out-dir", out, "--model", tiny_dir, "--seed", 6, *FRAMES, "--chapters", "2", "--force"
    )
    assert (
        forced.exit_code == 0
        and (out / "02-chapter-two-the-ship.wav").read_bytes() != outputs(reference)["02-chapter-two-the-ship.wav"]
    )


def test_list_shows_the_chapters_and_speaks_nothing(tiny_dir, tmp_path):
    result = run_cli("read", KEEPER, "--list", "--model", tiny_dir)
    assert result.exit_code == 0, result.output
    for words in ("Chapter One: The Storm", "Chapter Three: The Morning", "776", "total", "1,952", "time here"):
        assert words in result.output


def test_the_python_api_reports_progress(tiny, tmp_path):
    from rvqtts.documents.reading import read_document

    seen = []
    options = ReadingOptions(seed=1, chapters=(3,), audiobook=False, captions=False, batch_size=2)
    voice = Line(settings=GenerationSettings(max_frames=4))
    result = narrate(tiny, read_document(KEEPER), tmp_path / "book", voice, options, seen.append)
    assert [c.status for c in result.chapters] == ["made"] and result.statistics["chunks_made"] == 7
    assert result.statistics["batch_rows"] == 2  # the rows the chunks were spoken in, from their records
    assert [p.chunks_done for p in seen] == sorted(p.chunks_done for p in seen) and seen[-1].chunks_done == 7
    assert seen[-1].chapters_done == 1 and seen[-1].audio_seconds == pytest.approx(7 * 4 * 0.08, abs=0.01)
    assert sorted(p.name for p in (tmp_path / "book").iterdir()) == [
        ".chunks",
        "03-chapter-three-the-morning.wav",
        "manifest.json",
    ]


def test_a_rerun_with_other_pauses_keeps_the_chapter_and_a_shorter_book_drops_the_rest(tiny, tmp_path):
    from rvqtts.documents.document import Chapter, Document

    book = Document("Two Parts", (Chapter("One", ("First words.", "More words.")), Chapter("Two", ("Last words.",))))
    voice, out = Line(settings=GenerationSettings(max_frames=2)), tmp_path / "book"
    first = narrate(tiny, book, out, voice, ReadingOptions(batch_size=2))
    assert [c.status for c in first.chapters] == ["made", "made"] and first.audiobook is not None
    made = (out / "01-one.wav").read_bytes()
    paused = narrate(tiny, book, out, voice, ReadingOptions(batch_size=2, paragraph_pause=1.5))
    assert [c.status for c in paused.chapters] == ["kept", "kept"] and (out / "01-one.wav").read_bytes() == made
    assert any("01-one.wav was made with other text, settings or pauses and is kept" in n for n in paused.notices)
    shorter = Document("Two Parts", book.chapters[:1])
    narrate(tiny, shorter, out, voice, ReadingOptions(batch_size=2, force=True))
    manifest = json.loads((out / "manifest.json").read_text())
    assert [c["title"] for c in manifest["chapters"]] == ["One"]
    assert [mark["title"] for mark in manifest["audiobook"]["chapters"]] == ["One"]


def test_a_cloned_voice_is_encoded_once_and_every_chunk_is_synths_in_it(base_dir, tmp_path, monkeypatch):
    from rvqtts.documents.document import Chapter, Document
    from rvqtts.qwen import cloning
    from rvqtts.qwen.cloning import VoiceSource
    from rvqtts.support.audio import audio_bytes
    from rvqtts.synthesis.synthesizer import Synthesizer

    reference = tmp_path / "me.wav"
    noise = np.random.default_rng(1).standard_normal(24000 * 2).astype(np.float32)
    soundfile.write(reference, noise / np.abs(noise).max() * 0.1, 24000)
    base, encoded = Synthesizer.from_checkpoint(base_dir), []
    monkeypatch.setattr(
        cloning,
        "encode_voice",
        lambda tts, source, real=cloning.encode_voice: encoded.append(source) or real(tts, source),
    )
    book = Document(
        "Voiced", (Chapter("One", ("First words. More words.", "Second paragraph.")), Chapter("Two", ("End.",)))
    )
    source = VoiceSource(ref_audio=reference, x_vector_only=True)
    voice = Line(clone=source, settings=GenerationSettings(max_frames=3))
    result = narrate(base, book, tmp_path / "book", voice, ReadingOptions(seed=2, batch_size=2, audiobook=False))
    assert [c.status for c in result.chapters] == ["made", "made"] and encoded == [source]
    chapter = json.loads((tmp_path / "book" / "manifest.json").read_text())["chapters"][1]
    alone = base.synthesize(
        chapter["chunks"][0]["text"],
        seed=chapter["chunks"][0]["seed"],
        clone=base.voice_of(source),
        settings=voice.settings,
    )
    stored, _ = soundfile.read(tmp_path / "book" / ".chunks" / f"{chapter['keys'][0]}.flac", dtype="int16")
    expected, _ = soundfile.read(io.BytesIO(audio_bytes(alone.audio, alone.sample_rate)), dtype="int16")
    np.testing.assert_array_equal(stored, expected)


def test_chapters_normalized_to_a_loudness_measure_so(tiny, tmp_path):
    import pyloudnorm

    from rvqtts.documents.document import Chapter, Document

    book = Document("Loud", (Chapter("One", ("First words. More words.", "Second paragraph here.")),))
    voice = Line(settings=GenerationSettings(max_frames=12))
    narrate(tiny, book, tmp_path / "book", voice, ReadingOptions(batch_size=2, loudness=-30.0, audiobook=False))
    samples, rate = soundfile.read(tmp_path / "book" / "01-one.wav", dtype="float64")
    assert pyloudnorm.Meter(rate).integrated_loudness(samples) == pytest.approx(-30.0, abs=0.1)
    entry = json.loads((tmp_path / "book" / "manifest.json").read_text())["chapters"][0]
    assert entry["loudness"]["gain_db"] == pytest.approx(-30.0 - entry["loudness"]["measured_lufs"], abs=0.02)


def test_an_epub_and_standard_input_read_on_the_tiny_checkpoint(tiny_dir, tmp_path):
    import av
    from typer.testing import CliRunner

    from rvqtts.cli import app
    from tests.test_documents import CHAPTERS, PNG, make_epub

    out = tmp_path / "book"
    result = run_cli(
        "read", make_epub(tmp_path / "small.epub", CHAPTERS), "--out-dir", out, "--model", tiny_dir, *FRAMES
    )
    assert result.exit_code == 0, result.output
    assert "cover.xhtml has no text (images only?): skipped" in result.output
    assert sorted(p.name for p in out.glob("*.wav")) == ["01-title-of-one-xhtml.wav", "02-title-of-two-xhtml.wav"]
    assert (out / "cover.png").read_bytes() == PNG
    with av.open(str(out / "the-small-book.m4b")) as container:
        assert container.metadata["artist"] == "Ada Writer, Bo Second"
        assert [mark["metadata"]["title"] for mark in container.chapters()] == [
            "Title of one.xhtml",
            "Title of two.xhtml",
        ]
    piped = CliRunner().invoke(
        app,
        ["read", "-", "--out-dir", tmp_path / "piped", "--model", tiny_dir, *FRAMES],
        input="Hello there.\n\nA second paragraph.\n",
    )
    assert piped.exit_code == 0, piped.output
    assert [p.name for p in (tmp_path / "piped").glob("*.wav")] == ["01-untitled.wav"]


def test_a_voice_designed_once_reads_every_chunk_and_a_rerun_keeps_it(voice_design_dir, base_dir, tmp_path):
    book = tmp_path / "book.md"
    book.write_text(
        "# Book\n\n## One\n\nThe opening words of the book, long enough to be a sample.\n\n## Two\n\nEnd.\n"
    )
    out = tmp_path / "out"
    arguments = ("read", book, "--out-dir", out, "--model", voice_design_dir, "--clone-on", base_dir, *FRAMES)
    result = run_cli(*arguments, "--instruct", "A calm, low voice.")
    assert result.exit_code == 0 and "2 chapters made" in result.output, result.output
    voice = out / "designed-voice.safetensors"
    made, request = voice.read_bytes(), json.loads((out / "designed-voice.json").read_text())
    assert request["instruct"] == "A calm, low voice." and request["text"].startswith("Book One The opening words")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["statistics"]["identity"]["model"]["kind"] == "base"
    assert manifest["statistics"]["identity"]["voice"]["clone"]["digest"] == [hashlib.sha256(made).hexdigest()]
    again = run_cli(*arguments, "--instruct", "A calm, low voice.")
    assert again.exit_code == 0 and "0 chapters made, 2 already there" in again.output, again.output
    assert voice.read_bytes() == made
    other = run_cli(*arguments, "--instruct", "A bright, quick voice.")  # another voice: designed again, chapters kept
    assert other.exit_code == 0 and "made with other text, settings or pauses and is kept" in other.output
    assert json.loads((out / "designed-voice.json").read_text())["instruct"] == "A bright, quick voice."
    refused = run_cli("read", book, "--out-dir", out, "--model", base_dir, "--clone-on", base_dir)
    assert refused.exit_code == 2 and "give a VoiceDesign --model and a Base model to --clone-on" in refused.output


def test_a_missing_reference_is_refused_before_the_model_loads(base_dir, tmp_path, monkeypatch):
    from rvqtts.synthesis.synthesizer import Synthesizer

    monkeypatch.setattr(Synthesizer, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    result = run_cli(
        "read", KEEPER, "--out-dir", tmp_path / "o", "--model", base_dir, "--ref-audio", tmp_path / "gone.wav",
        "--x-vector-only",
    )  # fmt: skip
    assert result.exit_code == 2 and "gone.wav" in result.output and not (tmp_path / "o").exists(), result.output
