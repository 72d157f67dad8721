"""Pieces of `rvqtts synth`: sentence chunks, frame budgets, batch files, crossfades, batch totals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import join_chunks

from rvqtts.support.report import total_record
from rvqtts.synthesis.batch_files import MANIFEST, BatchFileError, Manifest, Rendered, read_batch
from rvqtts.synthesis.settings import Line
from rvqtts.synthesis.text import chunk_text, frame_limit, frames_warranted, split_sentences, text_weight


def test_sentences_split_in_latin_and_cjk_scripts():
    text = 'He said "hi." Then (he left.) Now!  Why? 你好。我是「测试。」好的！ok'
    assert split_sentences(text) == [
        'He said "hi."',
        "Then (he left.)",
        "Now!",
        "Why?",
        "你好。",
        "我是「测试。」",
        "好的！",
        "ok",
    ]
    assert split_sentences("Dr. Smith arrived.\nShe sat down.") == ["Dr.", "Smith arrived.", "She sat down."]


def test_chunks_keep_sentences_whole_and_respect_the_limit():
    sentences = [f"Sentence number {i} is here." for i in range(30)]
    chunks = chunk_text(" ".join(sentences), limit=100)
    assert " ".join(chunks) == " ".join(sentences)
    assert all(text_weight(c) <= 100 for c in chunks) and len(chunks) > 5
    assert all(c.endswith(".") for c in chunks)


def test_overlong_sentences_are_cut_at_clauses_then_spaces_then_anywhere():
    clauses = "one two three, four five six, seven eight nine, ten eleven twelve."
    assert chunk_text(clauses, limit=30) == ["one two three, four five six,", "seven eight nine,", "ten eleven twelve."]
    assert all(text_weight(c) <= 20 for c in chunk_text("word " * 40, limit=20))
    ideographs = "这" * 100
    pieces = chunk_text(ideographs, limit=50)
    assert "".join(pieces) == ideographs and all(text_weight(p) <= 50 for p in pieces)


def test_the_frames_a_text_warrants_grow_with_text_and_script():
    assert frames_warranted("Hi.") >= 25  # at least two seconds
    assert frames_warranted("a" * 140) > frames_warranted("a" * 14)
    assert frames_warranted("你好" * 7) > frames_warranted("ab" * 7)


def test_a_given_frame_limit_wins_and_the_warrant_stays_within_the_model():
    assert frame_limit("Hi.", 500, 100) == 500  # the user's, even past the model's default
    assert frame_limit("a" * 1400, None, 100) == 100
    assert frame_limit("Hi.", None, 100) == frames_warranted("Hi.")


def test_batch_txt_uses_line_numbers(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("First.\n\n  Second.  \n")
    items = read_batch(path)
    assert [(u.utterance, u.text, u.name) for u in items] == [(1, "First.", "0001.wav"), (3, "Second.", "0003.wav")]


def test_batch_jsonl_fields_and_names(tmp_path):
    path = tmp_path / "lines.jsonl"
    rows = [
        {"text": "A", "speaker": "ryan", "out": "intro"},
        {"text": "B", "language": "german"},
        {"text": "C", "out": "parts/c.wav", "instruct": "calm"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = read_batch(path)
    assert [u.name for u in items] == ["intro.wav", "0002.wav", "parts/c.wav"]
    assert items[0].speaker == "ryan" and items[1].language == "german" and items[2].instruct == "calm"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": "bad"\n', "lines.jsonl:2: not valid JSON"),
        ('{"text": ""}\n', 'lines.jsonl:1: "text" must be a non-empty string'),
        ('["text"]\n', "lines.jsonl:1: expected a JSON object"),
        ('{"text": "a", "spekaer": "x"}\n', "lines.jsonl:1: unknown field(s) ['spekaer']"),
        ('{"text": "a", "out": "../up"}\n', 'lines.jsonl:1: "out" must stay inside the output folder'),
        ('{"text": "a", "out": "x"}\n{"text": "b", "out": "x.wav"}\n', "lines.jsonl:2: output x.wav is also line 1's"),
        ('{"text": "a", "speaker": 3}\n', 'lines.jsonl:1: "speaker" must be a string'),
        ("\n\n", "no utterances"),
    ],
)
def test_bad_batch_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "lines.jsonl"
    path.write_text(content)
    with pytest.raises(BatchFileError) as error:
        read_batch(path)
    assert message in str(error.value)


def test_unreadable_batch_files(tmp_path):
    with pytest.raises(BatchFileError, match="cannot read batch file"):
        read_batch(tmp_path / "missing.txt")
    with pytest.raises(BatchFileError, match="must end in .txt or .jsonl"):
        read_batch(tmp_path / "lines.csv")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(BatchFileError, match="cannot read batch file"):
        read_batch(tmp_path / "binary.txt")


def test_crossfade_overlaps_each_seam():
    rate = 1000
    parts = [np.ones(200, np.float32), np.ones(300, np.float32) * -1, np.ones(30, np.float32)]
    joined = join_chunks(parts, rate, crossfade=0.05)
    assert joined.size == 200 + 300 + 30 - 50 - 30  # the last seam is as long as the short chunk
    assert joined[0] == 1 and joined[200] == -1 and np.all(np.diff(joined[150:200]) < 0)
    assert join_chunks([np.ones(5)], rate).tolist() == [1.0] * 5


def test_total_record_adds_counts_and_recomputes_ratios():
    base = dict(
        chunks=1,
        talker_calls=11,
        decoder_seconds=0.1,
        talker_seconds=0.2,
        spec=True,
        tree_nodes=16,
        weights="int8",
        seed=0,
        warnings=[],
    )
    records = [
        dict(
            base,
            frames=10,
            audio_seconds=0.8,
            predictor_calls=100,
            predictor_codes=150,
            wall_seconds=2.0,
            predictor_seconds=1.0,
            accepted_per_depth=[20, 5],
            inner_loop_ms_by_part={"forward": 40.0, "walk": 2.0},
        ),
        dict(
            base,
            frames=30,
            audio_seconds=2.4,
            predictor_calls=200,
            predictor_codes=450,
            wall_seconds=4.0,
            predictor_seconds=2.0,
            accepted_per_depth=[60],
            warnings=["cut"],
            inner_loop_ms_by_part={"forward": 20.0, "plain": 8.0},
        ),
    ]
    total = total_record(records)
    assert total["frames"] == 40 and total["predictor_calls"] == 300 and total["predictor_codes"] == 600
    assert total["codes_per_call"] == 2.0 and total["rtf"] == pytest.approx(6.0 / 3.2, abs=1e-4)
    assert total["accepted_per_depth"] == [80, 5] and total["warnings"] == 1 and total["utterances"] == 2
    assert total["spec"] is True and total["tree_nodes"] == 16 and total["weights"] == "int8"
    assert total["wall_seconds"] == 6.0 and "lines_wall_seconds" not in total
    assert total["inner_loop_ms_by_part"] == {"forward": 25.0, "plain": 6.0, "walk": 0.5}  # weighted by frames
    # lines that shared calls overlapped: the batch's own wall is its wall, RTF and throughput
    batch = total_record(records, wall_seconds=2.5)
    assert batch["wall_seconds"] == 2.5 and batch["lines_wall_seconds"] == 6.0
    assert batch["rtf"] == pytest.approx(2.5 / 3.2, abs=1e-4)
    assert batch["audio_seconds_per_wall_second"] == pytest.approx(3.2 / 2.5, abs=1e-4)


def test_atomic_files_get_ordinary_permissions(tmp_path):
    from rvqtts.support.files import current_umask, write_atomically

    write_atomically(tmp_path / "sub" / "file.bin", b"data")
    assert (tmp_path / "sub" / "file.bin").read_bytes() == b"data"
    assert (tmp_path / "sub" / "file.bin").stat().st_mode & 0o777 == 0o666 & ~current_umask()
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["file.bin"]


def test_the_manifest_keeps_line_order_and_earlier_runs_entries(tmp_path):
    def made(line: int) -> tuple[Line, Rendered]:
        return Line(text=f"line {line}", utterance=line, name=f"{line:04d}.wav"), Rendered(
            b"", None, {"speaker": "ryan"}, {"frames": line}
        )

    first = Manifest(tmp_path)
    first.add(*made(3))  # lines finish in any order on a cluster
    first.add(*made(1))
    with (tmp_path / MANIFEST).open("a") as damaged:
        damaged.write("{not json\n")  # an interrupted run's damaged line is dropped
    Manifest(tmp_path).add(*made(2))  # a resumed run keeps what the first one wrote
    entries = [json.loads(line) for line in (tmp_path / MANIFEST).read_text().splitlines()]
    assert [(e["line"], e["name"], e["speaker"], e["frames"]) for e in entries] == [
        (1, "0001.wav", "ryan", 1),
        (2, "0002.wav", "ryan", 2),
        (3, "0003.wav", "ryan", 3),
    ]


def test_a_batch_redoes_an_output_its_manifest_does_not_list(tmp_path):
    """A file whose manifest entry was never written (the batch was stopped between the two: tests/test_faults.py)
    is made again, so that a resumed batch's manifest lists every output; a listed file is skipped."""
    from rvqtts.synthesis.batch_files import to_do

    items = [Line(text=f"line {line}", utterance=line, name=f"{line:04d}.wav") for line in (1, 2, 3)]
    for item in items[:2]:
        (tmp_path / item.name).write_bytes(b"whole")
    Manifest(tmp_path).add(items[0], Rendered(b"", None, {}, {}))
    Manifest(tmp_path).add(items[2], Rendered(b"", None, {}, {}))  # an entry whose file is gone
    assert [item.utterance for item in to_do(items, tmp_path)] == [2, 3]
    assert [item.utterance for item in to_do(items, tmp_path / "new")] == [1, 2, 3]
    assert to_do(items, tmp_path, force=True) == items
