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

from rvqtts.audio import AUDIO_FORMATS
from rvqtts.cloning import VoiceError, VoiceSource
from rvqtts.engine.sampling import NonFiniteError
from rvqtts.settings import RunSettings

FIELDS = {"text", "speaker", "language", "instruct", "out", "ref_audio", "ref_text", "x_vector_only", "voice"}


class BatchFileError(ValueError):
    """A batch file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Utterance:
    line: int
    text: str
    name: str
    speaker: str | None = None
    language: str | None = None
    instruct: str | None = None
    clone: VoiceSource | None = None  # this line's cloned voice (Base models), else the batch's

    def voice(self, speaker: str | None, language: str, instruct: str | None, clone: VoiceSource | None) -> dict:
        """This line's voice, the keywords of `voice_for`: its own fields, else the run's (given here)."""
        return dict(
            speaker=self.speaker or speaker,
            language=self.language or language,
            instruct=self.instruct or instruct,
            source=self.clone or clone,
        )


def _output_name(path: Path, line: int, out: object) -> str:
    if out is None:
        return f"{line:04d}.wav"
    if not isinstance(out, str) or not out.strip():
        raise BatchFileError(f'{path}:{line}: "out" must be a non-empty file name')
    name = PurePosixPath(out.strip())
    if name.is_absolute() or ".." in name.parts:
        raise BatchFileError(f'{path}:{line}: "out" must stay inside the output folder, got {out!r}')
    return str(name) if name.suffix.lower() in AUDIO_FORMATS else f"{name}.wav"


def _from_json(path: Path, line: int, raw: str) -> Utterance:
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
    return Utterance(
        line,
        text.strip(),
        _output_name(path, line, record.get("out")),
        record.get("speaker"),
        record.get("language"),
        record.get("instruct"),
        _voice_source(path, line, record),
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


def read_batch(path: str | Path) -> list[Utterance]:
    """All utterances of a batch file, checked; raises BatchFileError on the first fault."""
    path = Path(path)
    if path.suffix.lower() not in (".txt", ".jsonl"):
        raise BatchFileError(f"{path}: a batch file must end in .txt or .jsonl")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BatchFileError(f"cannot read batch file {path}: {error}") from error
    jsonl = path.suffix.lower() == ".jsonl"
    utterances = [
        _from_json(path, n, raw) if jsonl else Utterance(n, raw.strip(), f"{n:04d}.wav")
        for n, raw in enumerate(lines, start=1)
        if raw.strip()
    ]
    if not utterances:
        raise BatchFileError(f"{path}: no utterances (the file has no non-empty line)")
    seen: dict[str, int] = {}
    for item in utterances:
        if item.name in seen:
            raise BatchFileError(f"{path}:{item.line}: output {item.name} is also line {seen[item.name]}'s")
        seen[item.name] = item.line
    return utterances


@dataclass
class BatchResult:
    """What happened to one utterance: "done", "skipped" (its file already existed) or "failed"; on a
    cluster, `worker` is the rvqtts.cluster.WorkerRecord of the worker that made it."""

    utterance: Utterance
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


def voice_for(synth, speaker: str | None, language: str, instruct: str | None, source: VoiceSource | None) -> dict:
    """The voice keywords of `synth.synthesize` for one line (its fields, else the run's, given here):
    the speaker resolved, the cloned voice encoded (once per source); ValueError saying what to give."""
    clone = synth.voice_of(source) if source is not None else None
    return dict(
        speaker=synth.check_voice(speaker, language, instruct, clone), language=language, instruct=instruct, clone=clone
    )


def line_voice(synth, item: Utterance, run: RunSettings) -> tuple[dict, VoiceSource | None]:
    """The voice keywords of one line (`voice_for`) and its cloned voice's source, if any."""
    line = item.voice(run.speaker, run.language, run.instruct, run.clone)
    return voice_for(synth, **line), line["source"]


def rendered(synth, item: Utterance, synthesis, voice: dict, source: VoiceSource | None) -> Rendered:
    """A made utterance as its output file's bytes, with its voice as the model heard it."""
    from rvqtts.audio import audio_bytes, audio_format

    heard = {"speaker": voice["speaker"], "language": voice["language"]}
    if voice["instruct"] and synth.supports_instruct:
        heard["instruct"] = voice["instruct"]
    return Rendered(
        audio_bytes(synthesis.audio, synthesis.sample_rate, audio_format(item.name)),
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

    def add(self, item: Utterance, rendered: Rendered) -> None:
        from rvqtts.files import write_atomically

        self.entries[item.name] = {
            "name": item.name,
            "line": item.line,
            "text": item.text,
            **rendered.voice,
            **rendered.record,
        }
        ordered = sorted(self.entries.values(), key=lambda e: (e.get("line", 0), e["name"]))
        write_atomically(self.path, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in ordered).encode())


def save(out_dir: Path, item: Utterance, rendered: Rendered, manifest: Manifest, codes_dir: Path | None = None) -> None:
    """Write one made utterance: its codes (if asked), its audio file, then its manifest entry; each
    atomically, so an interrupted batch leaves whole files and a rerun redoes only what is missing."""
    from rvqtts.audio import write_codes
    from rvqtts.files import write_atomically

    if codes_dir is not None:
        write_codes(codes_dir / Path(item.name).with_suffix(".npy"), rendered.codes)
    write_atomically(out_dir / item.name, rendered.audio)
    manifest.add(item, rendered)


def conclude(
    out_dir: Path,
    item: Utterance,
    status: str,
    value: object,
    manifest: Manifest,
    codes_dir: Path | None = None,
    worker: object | None = None,
) -> BatchResult:
    """A line's result from `attempt`'s answer, made here or on a worker: a made line is written (`save`),
    and a write that fails fails the line."""
    if status == "done":
        try:
            save(out_dir, item, value, manifest, codes_dir)
            return BatchResult(item, "done", value.record, worker=worker)
        except Exception as error:  # a full disk, a folder made unwritable: this line fails, the rest go on
            value = describe(error)
    return BatchResult(item, "failed", error=value, worker=worker)


def to_do(utterances: list[Utterance], out_dir: Path, force: bool = False) -> list[Utterance]:
    """The utterances whose output is not in `out_dir` yet, or not in its manifest (all of them with `force`).

    A file is written before its manifest entry, so a batch stopped between the two (killed, Ctrl-C) leaves a
    whole file that the manifest does not list: that line is made again (the same bytes: its noise is keyed
    by its line), so that a resumed batch's manifest lists every output, as a full run's does."""
    if force:
        return list(utterances)
    listed = Manifest(out_dir).entries
    return [item for item in utterances if item.name not in listed or not (out_dir / item.name).exists()]


def synthesize_batch(
    synth,
    utterances: list[Utterance],
    out_dir: Path,
    run: RunSettings,
    *,
    force: bool = False,
    codes_dir: Path | None = None,
    on_done=None,
    batch_size: int = 1,
    on_notice=None,
) -> list[BatchResult]:
    """Synthesize every utterance into `out_dir` here, skipping existing outputs unless `force`; with
    `batch_size` > 1, that many lines at once (Synthesizer.synthesize_many: the same files).

    A failing utterance is reported in its result and the rest go on, except a model that produced NaN or
    inf (NonFiniteError), which every utterance would meet: that stops the batch. `on_done(result)` is
    called after each one, as it ends, and `on_notice(text)` with a batch cut to fit in memory. Results
    come in line order. rvqtts.cluster runs the same on Ray
    workers.
    """
    manifest = Manifest(out_dir)
    pending = {item.line for item in to_do(utterances, out_dir, force)}
    results: dict[int, BatchResult] = {}

    def finish(item: Utterance, result: BatchResult) -> None:
        results[item.line] = result
        if on_done:
            on_done(result)

    making = []
    for item in utterances:
        if item.line not in pending:
            finish(item, BatchResult(item, "skipped"))
        else:
            making.append(item)
    if making:
        for item, (status, value) in attempt(synth, making, run, batch_size, on_notice):
            finish(item, conclude(out_dir, item, status, value, manifest, codes_dir))
    return [results[item.line] for item in utterances]


def attempt(
    synth, items: list[Utterance], run: RunSettings, batch_size: int, on_notice=None
) -> Iterator[tuple[Utterance, tuple]]:
    """Each line and its answer as it ends, the lines spoken `batch_size` at a time (Synthesizer.synthesize_many):
    ("done", Rendered, its output file's bytes), or ("failed", why) for a line whose voice or synthesis failed. A
    line's voice is its own, else the run's; every code's noise (c0's included) is keyed by its line number, so any
    run, partial, resumed or on any worker, makes the same audio for it. A model that produced NaN or inf
    (NonFiniteError) is raised: every line would meet it."""
    from rvqtts.settings import Line

    voices, lines, failed = [], [], []
    for item in items:
        try:
            voice, source = line_voice(synth, item, run)
        except NonFiniteError:
            raise
        except Exception as error:  # this line's voice: it fails alone
            failed.append((item, ("failed", describe(error))))
            continue
        voices.append((item, voice, source))
        lines.append(Line(item.text, voice["speaker"], voice["language"], voice["instruct"], voice["clone"], item.line))
    yield from failed
    for index, outcome in synth.synthesize_many(lines, run.seed, run.settings, run.chunk_chars, batch_size, on_notice):
        item, voice, source = voices[index]
        if isinstance(outcome, Exception):
            yield item, ("failed", describe(outcome))
            continue
        try:
            yield item, ("done", rendered(synth, item, outcome, voice, source))
        except Exception as error:
            yield item, ("failed", describe(error))
