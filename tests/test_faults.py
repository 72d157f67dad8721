"""Faults injected, not simulated: files written atomically under an exception and a kill, and `rvqtts synth -f`
batches killed (SIGKILL) or interrupted (SIGINT, Ctrl-C) in a subprocess in the middle of a line and in the middle
of a write, then resumed: whole files only, and the resumed folder byte for byte an uninterrupted run's.

The subprocesses stop at a known point (tests/faults.py: a fault armed in a folder, a marker with the stalled pid),
so each interruption lands where the test says, with no timing guess."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults import FAULTS, PARTIAL, Zygote, arm, output_name, stalling_write_bytes, wait_for_stall
from helpers import TIMINGS, run_cli

from rvqtts.support.files import atomic_path, write_atomically, write_json
from rvqtts.synthesis.batch_files import MANIFEST

TESTS = Path(__file__).parent
LINES = ["One.", "Two.", "Three."]
OUTPUTS = ["0001.wav", "0002.wav", "0003.wav"]
FRAMES = 6  # --max-frames: a line takes a fraction of a second
OLD, NEW = b"old whole contents\n", bytes(range(256)) * 64


def litter(folder: Path) -> list[str]:
    """The names in `folder` that are not outputs: hidden files, an atomic write's temporary files among them."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# The atomic write itself


def half_then_fail(original):
    """Path.write_bytes writing half its bytes, then failing as a full disk does."""

    def write_bytes(self, data):
        original(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    return write_bytes


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    target, fresh = tmp_path / "out.wav", tmp_path / "new.wav"
    target.write_bytes(OLD)
    monkeypatch.setattr(Path, "write_bytes", half_then_fail(Path.write_bytes))
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, NEW)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(fresh, NEW)
    with pytest.raises(OSError, match="No space left"):
        write_json(tmp_path / "doc.json", {"text": "x" * 1000})
    assert target.read_bytes() == OLD  # not half of NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.wav"]  # no half file, no temporary one


def test_an_atomic_path_holds_the_old_file_until_its_block_ends_and_cleans_up_an_interrupted_one(tmp_path):
    target = tmp_path / "out.wav"
    target.write_bytes(OLD)
    for interruption in (RuntimeError("a failed line"), KeyboardInterrupt()):
        with pytest.raises(type(interruption)):
            with atomic_path(target) as partial:
                partial.write_bytes(NEW[:100])
                raise interruption
        assert target.read_bytes() == OLD and litter(tmp_path) == []
    with atomic_path(target) as partial:
        partial.write_bytes(NEW)
        assert partial.parent == tmp_path and partial.name.startswith(".out.wav.") and partial.name.endswith(PARTIAL)
        assert target.read_bytes() == OLD  # readers see the old file while the new one is written
    assert target.read_bytes() == NEW and litter(tmp_path) == []
    with pytest.raises(TypeError):  # a document that cannot be written leaves the old one
        write_json(tmp_path / "doc.json", {"ok": 1})
        write_json(tmp_path / "doc.json", {"not json": object()})
    assert json.loads((tmp_path / "doc.json").read_text()) == {"ok": 1} and litter(tmp_path) == []


WRITER = """
import sys
from pathlib import Path
import faults
from rvqtts.support.files import write_json
Path.write_bytes = faults.stalling_write_bytes(Path.write_bytes)
write_json(sys.argv[1], {"samples": list(range(2000))})
"""


def test_a_write_killed_midway_leaves_the_old_file_and_only_a_hidden_temporary_one(tmp_path):
    """A process SIGKILLed while it writes (all but the last few bytes written): the target keeps its old contents
    all along (the new ones go to a temporary file beside it), and what is left is that hidden temporary file,
    which no output name or `*.json` pattern matches."""
    target, faults = tmp_path / "out" / "doc.json", tmp_path / "faults"
    target.parent.mkdir()
    target.write_bytes(OLD)
    marker = arm(faults, "write-doc.json")
    env = {**os.environ, FAULTS: str(faults), "PYTHONPATH": pythonpath()}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target)], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert wait_for_stall(marker, writer, timeout=60) == writer.pid
        assert target.read_bytes() == OLD  # mid-write: the target is still the old file
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    assert target.read_bytes() == OLD
    (left,) = litter(target.parent)
    assert output_name(target.parent / left) == "doc.json" and left.endswith(PARTIAL)
    assert list(target.parent.glob("*.json")) == [target]


def test_the_fault_helpers_find_a_writes_target_and_stall_only_where_armed(tmp_path, monkeypatch):
    assert output_name(Path(".0002.wav.k3j_x9.partial")) == "0002.wav" and output_name(Path("0002.wav")) == "0002.wav"
    assert output_name(Path(".manifest.jsonl.abc.partial")) == "manifest.jsonl"
    monkeypatch.setenv(FAULTS, str(tmp_path / "faults"))
    arm(tmp_path / "faults", "write-b.wav", holding="line 2")
    write = stalling_write_bytes(Path.write_bytes)
    write(tmp_path / "a.wav", b"line 2")  # another file
    write(tmp_path / "b.wav", b"line 1")  # not the bytes armed
    assert (tmp_path / "a.wav").read_bytes() == b"line 2" and (tmp_path / "b.wav").read_bytes() == b"line 1"
    assert (tmp_path / "faults" / "armed-write-b.wav").exists()  # still armed


# Batches interrupted in a subprocess, then resumed


def pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "lines.txt"
    path.write_text("".join(line + "\n" for line in LINES))
    return path


def synth_arguments(corpus: Path, out: Path, model: Path) -> list[str]:
    """`rvqtts synth -f` as the tests run it: one line at a time, short lines."""
    batch = ["--max-frames", str(FRAMES), "--batch-size", "1"]
    return ["synth", "-f", str(corpus), "--out-dir", str(out), "--model", str(model), *batch]


def run_here(*arguments: str):
    """`rvqtts ARGUMENTS` in this process with the one torch thread of the subprocesses (OMP_NUM_THREADS=1): the
    speech decoder's float32 bits depend on the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_cli(*arguments)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tiny_dir) -> Path:
    out = corpus.parent / "uninterrupted"
    result = run_here(*synth_arguments(corpus, out, tiny_dir))
    assert result.exit_code == 0, result.output
    return out


def entries(folder: Path) -> list[dict]:
    """The manifest's entries without their timings, in the file's order."""
    lines = (folder / MANIFEST).read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def assert_whole(folder: Path, reference: Path) -> None:
    """What an interrupted batch left: each output whole (an uninterrupted run's bytes), the manifest listing
    outputs that are there, each once, with an uninterrupted run's entry, and nothing else but hidden files."""
    outputs = sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.name != MANIFEST)
    assert set(outputs) <= set(OUTPUTS), outputs
    for name in outputs:
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), f"{name} is not whole"
    if (folder / MANIFEST).exists():
        assert (folder / MANIFEST).read_text(encoding="utf-8").endswith("\n"), "the manifest is not whole"
        listed = entries(folder)
        assert [e["name"] for e in listed] == sorted({e["name"] for e in listed}), listed  # once each, in order
        assert {e["name"] for e in listed} <= set(outputs), (listed, outputs)
        expected = {e["name"]: e for e in entries(reference)}
        assert listed == [expected[e["name"]] for e in listed]


def assert_complete(folder: Path, reference: Path) -> None:
    """A resumed batch: an uninterrupted run's files, byte for byte, and its manifest (every line once, in
    order), beside at most the hidden temporary files of a write that was killed."""
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted([*OUTPUTS, MANIFEST])
    for name in OUTPUTS:
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), name
    assert entries(folder) == entries(reference)
    assert [(e["line"], e["name"], e["text"]) for e in entries(folder)] == [
        (n, f"{n:04d}.wav", text) for n, text in enumerate(LINES, 1)
    ]


@pytest.fixture(scope="module")
def zygote():
    """rvqtts's CLI imported once, a process forked per batch (tests/faults.py): a second each, not ten."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1"}
    forks = Zygote(env)
    yield forks
    forks.close()


def start_batch(tmp_path: Path, arguments: list[str], zygote: Zygote | None):
    """`rvqtts ARGUMENTS` in a process of its own that stalls where tests/faults.py's faults are armed in
    tmp_path/faults: forked by `zygote`, or (None) a fresh Python started as a user starts rvqtts."""
    env = {FAULTS: str(tmp_path / "faults"), "RVQTTS_CACHE": os.environ["RVQTTS_CACHE"]}
    if zygote is not None:
        return zygote.start(arguments, env, tmp_path)
    env = {**os.environ, **env, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "import faults; faults.rvqtts_with_stalls()", *arguments]
    return subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def interrupt_at(tmp_path: Path, arguments: list[str], fault: str, holding: str, how: signal.Signals, zygote):
    """Run the batch until it stalls at `fault`, send it `how`: its exit code (Popen's: -N for signal N), what it
    wrote to stderr and the seconds from the signal to its exit."""
    marker = arm(tmp_path / "faults", fault, holding)
    batch = start_batch(tmp_path, arguments, zygote)
    try:
        assert wait_for_stall(marker, batch) == batch.pid
        sent = time.monotonic()
        batch.send_signal(how)
        _, stderr = batch.communicate(timeout=60)
        return batch.returncode, stderr, time.monotonic() - sent
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.communicate(timeout=60)


@pytest.mark.parametrize(
    "fault, holding, left, fresh",
    [
        ("synthesize-2", "", ["0001.wav"], False),  # mid-line: the engine is making line 2
        ("write-0002.wav", "", ["0001.wav"], True),  # mid-write of a WAV; rvqtts started as a user starts it
        ("write-manifest.jsonl", '"0002.wav"', ["0001.wav", "0002.wav"], False),  # between a WAV and its entry
    ],
)
def test_a_batch_killed_mid_line_or_mid_write_leaves_whole_files_and_resumes_to_the_same_bytes(
    tmp_path, corpus, tiny_dir, uninterrupted, zygote, fault, holding, left, fresh
):
    out = tmp_path / "out"
    arguments = synth_arguments(corpus, out, tiny_dir)
    code, stderr, _ = interrupt_at(tmp_path, arguments, fault, holding, signal.SIGKILL, None if fresh else zygote)
    assert code == -signal.SIGKILL, stderr[-3000:]
    assert_whole(out, uninterrupted)
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".wav") == left
    hidden = litter(out)  # a write killed midway leaves its temporary file: hidden, never an output's name
    assert [output_name(out / name) for name in hidden] == ([fault.removeprefix("write-")] if hidden else [])
    assert all(name.endswith(PARTIAL) for name in hidden) and bool(hidden) == fault.startswith("write-")
    resumed = run_here(*arguments)
    assert resumed.exit_code == 0 and "2 written, 1 skipped" in resumed.output, resumed.output
    assert_complete(out, uninterrupted)
    assert litter(out) == hidden  # not taken for an output, not written over


@pytest.mark.parametrize("fault", ["synthesize-2", "write-0002.wav"])
def test_ctrl_c_stops_a_batch_at_once_with_whole_files_and_a_rerun_finishes_it(
    tmp_path, corpus, tiny_dir, uninterrupted, zygote, fault
):
    """SIGINT (Ctrl-C) while a line is made, or while its WAV is written: exit 130 within seconds, no
    traceback, whole files and their entries, no temporary file left (the write cleans up after itself), and a
    rerun makes the rest, byte for byte."""
    out = tmp_path / "out"
    arguments = synth_arguments(corpus, out, tiny_dir)
    code, stderr, seconds = interrupt_at(tmp_path, arguments, fault, "", signal.SIGINT, zygote)
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert f"interrupted: 1 files written to {out}, each whole; run the same command again" in stderr, stderr[-3000:]
    assert seconds < 30, seconds
    assert_whole(out, uninterrupted)
    assert sorted(p.name for p in out.iterdir()) == ["0001.wav", MANIFEST]  # no temporary file either
    resumed = run_here(*arguments)
    assert resumed.exit_code == 0 and "2 written, 1 skipped" in resumed.output, resumed.output
    assert_complete(out, uninterrupted)
    assert litter(out) == []
