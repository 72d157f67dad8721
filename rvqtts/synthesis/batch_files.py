"""Batch input files: a `.txt` file (one utterance per non-empty line) or a `.jsonl` file (one JSON
object per line with `text` and optional `speaker`, `language`, `instruct`, `out`, and a Base model's
cloned voice: `ref_audio` with `ref_text` or `x_vector_only`, or `voice`, paths relative to the file).

Each utterance gets a stable output name: its `out` field, or its line number (`0007.wav`), so a rerun
writes the same files and can skip the ones already there. The whole file is checked before anything
is synthesized; a fault names the file and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np

from rvqtts.engine.model.sampling import NonFiniteError
from rvqtts.qwen.cloning import VoiceError, VoiceSource
from rvqtts.support.audio import AUDIO_FORMATS
from rvqtts.synthesis.settings import GenerationSettings, Line

FIELDS = {"text", "speaker", "language", "instruct", "out", "ref_audio", "ref_text", "x_vector_only", "voice"}


class BatchFileError(ValueError):
    """A batch file that cannot be used; the message names the file and the line."""


def _output_name(path: Path, line: int, out: object) -> str:
    if out is None:
        return f"{line:04d}.wav"
    if not isinstance(out, str) or not out.strip():
        raise BatchFileError(f'{path}:{line}: "out" must be a non-empty file name')
    name = PurePosixPath(out.strip())
    if name.is_absolute() or ".." in name.parts:
        raise BatchFileError(f'{path}:{line}: "out" must stay inside the output folder, got {out!r}')
    return str(name) if name.suffix.lower() in AUDIO_FORMATS else f"{name}.wav"


def _from_json(path: Path, line: int, raw: str) -> Line:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as error:
        raise BatchFileError(f"{path}:{line}: not valid JSON ({error.msg})") from error
    if not isinstance(record, dict):
        raise BatchFileError(f'{path}:{line}: expected a JSON object with a "text" field')
    unknown = sorted(set(record) - FIELDS)
    if unknown:
        raise BatchFileError(f"{path}:{line}: unknown field(s) {unknown}; allowed: {sorted(FIELDS)}")
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        raise BatchFileError(f'{path}:{line}: "text" must be a non-empty string')
    for key in ("speaker", "language", "instruct", "ref_audio", "ref_text", "voice"):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise BatchFileError(f'{path}:{line}: "{key}" must be a string')
    if not isinstance(record.get("x_vector_only", False), bool):
        raise BatchFileError(f'{path}:{line}: "x_vector_only" must be true or false')
    return Line(
        text=text.strip(),
        speaker=record.get("speaker"),
        language=record.get("language"),
        instruct=record.get("instruct"),
        clone=_voice_source(path, line, record),
        utterance=line,
        name=_output_name(path, line, record.get("out")),
    )


def _voice_source(path: Path, line: int, record: dict) -> VoiceSource | None:
    """A line's cloned voice, its files relative to the batch file's folder; None if it names none."""

    def located(key: str) -> Path | None:
        return None if record.get(key) is None else (path.parent / record[key]).expanduser().resolve()

    if not any(record.get(key) not in (None, False) for key in ("ref_audio", "ref_text", "x_vector_only", "voice")):
        return None
    try:
        return VoiceSource(
            located("ref_audio"), record.get("ref_text"), record.get("x_vector_only", False), located("voice")
        )
    except VoiceError as error:
        raise BatchFileError(f"{path}:{line}: {error}") from error


def read_batch(path: str | Path) -> list[Line]:
    """All utterances of a batch file, each with its line number as `utterance` (its noise key) and its output's
    `name`, checked; raises BatchFileError on the first fault."""
    path = Path(path)
    if path.suffix.lower() not in (".txt", ".jsonl"):
        raise BatchFileError(f"{path}: a batch file must end in .txt or .jsonl")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BatchFileError(f"cannot read batch file {path}: {error}") from error
    jsonl = path.suffix.lower() == ".jsonl"
    utterances = [
        _from_json(path, n, raw) if jsonl else Line(text=raw.strip(), utterance=n, name=f"{n:04d}.wav")
        for n, raw in enumerate(lines, start=1)
        if raw.strip()
    ]
    if not utterances:
        raise BatchFileError(f"{path}: no utterances (the file has no non-empty line)")
    seen: dict[str, int] = {}
    for item in utterances:
        if item.name in seen:
            raise BatchFileError(f"{path}:{item.utterance}: output {item.name} is also line {seen[item.name]}'s")
        seen[item.name] = item.utterance
    return utterances


@dataclass
class BatchResult:
    """What happened to one utterance: "done", "skipped" (its file already existed) or "failed"; on a
    cluster, `worker` is the rvqtts.serving.cluster.WorkerRecord of the worker that made it."""

    line: Line
    status: str
    record: dict | None = None
    error: str | None = None
    worker: object | None = None


@dataclass
class Rendered:
    """One utterance made and not yet written: its output file's bytes, its frame codes, its voice and its
    statistics. Made where the model is (here, or a cluster worker) and written where the batch is."""

    audio: bytes
    codes: np.ndarray
    voice: dict
    record: dict


def rendered(synth, line: Line, synthesis, source: VoiceSource | None) -> Rendered:
    """A made utterance (`line` as the model heard it, `Synthesizer.voiced`) as its output file's bytes."""
    from rvqtts.support.audio import audio_bytes, audio_format

    heard = {"speaker": line.speaker, "language": line.language}
    if line.instruct and synth.supports_instruct:
        heard["instruct"] = line.instruct
    return Rendered(
        audio_bytes(synthesis.audio, synthesis.sample_rate, audio_format(line.name)),
        synthesis.codes,
        {**heard, **(source.record() if source else {})},
        synthesis.record(),
    )


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


MANIFEST = "manifest.jsonl"


class Manifest:
    """`manifest.jsonl` of an output folder: one entry per output (its line, text, voice and statistics),
    in line order, rewritten atomically after each output. Entries of earlier runs are kept."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / MANIFEST
        self.entries: dict[str, dict] = {}
        if self.path.is_file():
            for raw in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(raw)
                    self.entries[entry["name"]] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a damaged line of an earlier run is dropped, not fatal

    def add(self, line: Line, rendered: Rendered) -> None:
        from rvqtts.support.files import write_atomically

        entry = {"name": line.name, "line": line.utterance, "text": line.text, **rendered.voice, **rendered.record}
        self.entries[line.name] = entry
        ordered = sorted(self.entries.values(), key=lambda e: (e.get("line", 0), e["name"]))
        write_atomically(self.path, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in ordered).encode())


def conclude(
    out_dir: Path,
    line: Line,
    status: str,
    value: object,
    manifest: Manifest,
    codes_dir: Path | None = None,
    worker: object | None = None,
) -> BatchResult:
    """A line's result from `attempt`'s answer, made here or on a worker. A made line is written: its codes (if
    asked), its audio file, then its manifest entry, each atomically, so an interrupted batch leaves whole files
    and a rerun redoes only what is missing; a write that fails fails the line."""
    from rvqtts.support.audio import write_codes
    from rvqtts.support.files import write_atomically

    if status == "done":
        try:
            if codes_dir is not None:
                write_codes(codes_dir / Path(line.name).with_suffix(".npy"), value.codes)
            write_atomically(out_dir / line.name, value.audio)
            manifest.add(line, value)
            return BatchResult(line, "done", value.record, worker=worker)
        except Exception as error:  # a full disk, a folder made unwritable: this line fails, the rest go on
            value = describe(error)
    return BatchResult(line, "failed", error=value, worker=worker)


def to_do(lines: list[Line], out_dir: Path, force: bool = False) -> list[Line]:
    """The lines whose output is not in `out_dir` yet, or not in its manifest (all of them with `force`).

    A file is written before its manifest entry, so a batch stopped between the two (killed, Ctrl-C) leaves a
    whole file that the manifest does not list: that line is made again (the same bytes: its noise is keyed
    by its line), so that a resumed batch's manifest lists every output, as a full run's does."""
    if force:
        return list(lines)
    listed = Manifest(out_dir).entries
    return [line for line in lines if line.name not in listed or not (out_dir / line.name).exists()]


def synthesize_batch(
    synth,
    lines: list[Line],
    out_dir: Path,
    defaults: Line,
    chunk_chars: float | None,
    *,
    force: bool = False,
    codes_dir: Path | None = None,
    on_done=None,
    batch_size: int = 1,
    on_notice=None,
) -> list[BatchResult]:
    """Synthesize every line (rvqtts.synthesis.batch_files.read_batch's) into `out_dir` here, skipping existing outputs
    unless `force`; with `batch_size` > 1, that many lines at once (Synthesizer.synthesize_many: the same files).

    A failing line is reported in its result and the rest go on, except a model that produced NaN or inf
    (NonFiniteError), which every line would meet: that stops the batch. `on_done(result)` is called after each
    one, as it ends, and `on_notice(text)` with a batch cut to fit in memory. Results come in line order.
    rvqtts.serving.cluster runs the same on Ray workers."""
    manifest = Manifest(out_dir)
    making = to_do(lines, out_dir, force)
    pending = {line.utterance for line in making}
    results: dict[int, BatchResult] = {}

    def finish(result: BatchResult) -> None:
        results[result.line.utterance] = result
        if on_done:
            on_done(result)

    for line in lines:
        if line.utterance not in pending:
            finish(BatchResult(line, "skipped"))
    for line, (status, value) in attempt(synth, making, defaults, chunk_chars, batch_size, on_notice):
        finish(conclude(out_dir, line, status, value, manifest, codes_dir))
    return [results[line.utterance] for line in lines]


def attempt(
    synth, lines: list[Line], defaults: Line, chunk_chars: float | None, batch_size: int | None, on_notice=None
) -> Iterator[tuple[Line, tuple]]:
    """Each line and its answer as it ends, the lines spoken `batch_size` at a time (Synthesizer.synthesize_many; None:
    the Synthesizer's, else measured): ("done", Rendered, its output file's bytes), or ("failed", why) for a line whose
    voice or synthesis failed. A line's voice is its own, else the run's; every code's noise (c0's included) is keyed
    by its line number, so any run, partial, resumed or on any worker, makes the same audio for it. A model that
    produced NaN or inf (NonFiniteError) is raised: every line would meet it."""
    voiced = []  # (the line, with the run's voice, as the model hears it)
    for line in lines:
        try:
            asked = line.under(defaults)
            voiced.append((line, asked, synth.voiced(asked)))
        except NonFiniteError:
            raise
        except Exception as error:  # this line's voice: it fails alone
            yield line, ("failed", describe(error))
    heard = [spoken for _, _, spoken in voiced]
    settings = defaults.settings or GenerationSettings()  # every heard line has its seed (Line.under)
    outcomes = synth.synthesize_many(
        heard, settings=settings, chunk_chars=chunk_chars, batch_size=batch_size, on_notice=on_notice
    )
    for index, outcome in outcomes:
        line, asked, spoken = voiced[index]
        if isinstance(outcome, NonFiniteError):  # an overflow in the dtype, which the other lines would meet too
            raise outcome
        if isinstance(outcome, Exception):
            yield line, ("failed", describe(outcome))
            continue
        try:
            answer = ("done", rendered(synth, spoken, outcome, asked.clone))
        except Exception as error:  # its output could not be made
            answer = ("failed", describe(error))
        yield line, answer
