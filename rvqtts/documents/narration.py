"""A document spoken to a folder: every chunk of the chapters asked for is an utterance of the frame loop, B rows at
a time (Synthesizer.synthesize_many), each chunk's audio kept in the folder's chunk store as it ends, keyed by its
text and everything that changes its audio; a chapter's file and captions are assembled from the store once its
chunks are there, the audiobook once every chapter is. A run stopped at any moment resumes where it stopped and
ends with the files an uninterrupted run writes (docs/documents.md)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from rvqtts.documents.chapter_files import chapter_file, slug, write_book, write_chapter, write_cover
from rvqtts.documents.chunk_store import ChunkStore, chunk_key, speech_identity
from rvqtts.documents.document import Document
from rvqtts.documents.lexicon import Lexicon
from rvqtts.documents.loudness import check_loudness_target
from rvqtts.documents.plan import ChapterPlan, PlannedChunk, plan_document
from rvqtts.support.audio import AUDIO_FORMATS
from rvqtts.support.files import read_records, write_json
from rvqtts.support.memory import memory_record
from rvqtts.synthesis.batch_files import BatchResult, Rendered, attempt
from rvqtts.synthesis.settings import Line
from rvqtts.synthesis.text import LATIN_CHARS_PER_SECOND, MAX_CHUNK_WEIGHT

MANIFEST = "manifest.json"
LANGUAGES = {  # a document's language tag -> the language Qwen3-TTS names
    "zh": "chinese", "en": "english", "ja": "japanese", "ko": "korean", "de": "german", "fr": "french",
    "ru": "russian", "pt": "portuguese", "es": "spanish", "it": "italian",
}  # fmt: skip


@dataclass(frozen=True)
class ReadingOptions:
    """How a document is spoken and written. `chapters`: the chapters to speak (1-based; None: all). `force`: remake
    their files (and the audiobook) even where they are there. Pauses in seconds; `audio_suffix` names the chapter
    files' format (.wav, .flac, .ogg, .mp3, .opus)."""

    seed: int = 0
    chapters: tuple[int, ...] | None = None
    audio_suffix: str = ".wav"
    paragraph_pause: float = 0.5
    chapter_pause: float = 2.0
    captions: bool = True
    audiobook: bool = True
    force: bool = False
    chunk_chars: float = MAX_CHUNK_WEIGHT
    batch_size: int | None = None  # None: the Synthesizer's, else measured on this machine
    lexicon: Lexicon = field(default_factory=Lexicon)
    loudness: float | None = None  # each chapter normalized to this integrated loudness, in LUFS (None: as spoken)

    def __post_init__(self) -> None:
        if self.loudness is not None:
            check_loudness_target(self.loudness)
        if self.audio_suffix.lower() not in AUDIO_FORMATS:
            formats = ", ".join(suffix.lstrip(".") for suffix in AUDIO_FORMATS)
            raise ValueError(f"chapter files can be {formats}, not {self.audio_suffix.lstrip('.') or 'nothing'}")
        for name in ("paragraph_pause", "chapter_pause"):
            if not 0 <= getattr(self, name) <= 60:
                raise ValueError(f"{name.replace('_', ' ')} must be 0 to 60 seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class ReadingProgress:
    """Where a reading stands, said after every chunk and chapter: chunks and chapters done of those asked for (the
    ones already in the store count as done), the audio made by this run and the wall time it took."""

    chunks_done: int
    chunks: int
    chapters_done: int
    chapters: int
    audio_seconds: float
    wall_seconds: float
    chunks_made: int = 0  # by this run

    @property
    def seconds_left(self) -> float | None:
        """The time left at this run's pace so far (None until it has made a chunk)."""
        if not self.chunks_made:
            return None
        return (self.chunks - self.chunks_done) * self.wall_seconds / self.chunks_made


@dataclass
class ChapterResult:
    """A chapter asked for: "made" this run, "done" before (its file kept), "kept" (there, made with other settings:
    --force remakes it) or "failed" (`error` says why; its chunks made are kept for a rerun)."""

    number: int
    title: str
    status: str
    file: str
    seconds: float | None = None
    error: str | None = None


@dataclass
class ReadingResult:
    chapters: list[ChapterResult]
    audiobook: Path | None
    manifest: Path
    statistics: dict
    notices: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # chunks cut at their frame limit

    @property
    def failed(self) -> list[ChapterResult]:
        return [chapter for chapter in self.chapters if chapter.status == "failed"]


def document_language(languages: list[str], document: Document, asked: str | None) -> str | None:
    """The language to speak in: the one asked for, else the document's where the model (speaking `languages`) names
    it, else auto."""
    if asked not in (None, "auto") or not document.language:
        return asked
    named = LANGUAGES.get(document.language.split("-")[0].lower())
    return named if named in languages else asked


def expected_seconds(plan: ChapterPlan) -> float:
    """A chapter's audio length expected from its text (about 14 Latin characters a second)."""
    return plan.weight / LATIN_CHARS_PER_SECOND


def narrate(
    synth,
    document: Document,
    out_dir: str | Path,
    voice: Line = Line(),
    options: ReadingOptions = ReadingOptions(),
    on_progress: Callable[[ReadingProgress], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> ReadingResult:
    """Speak `document` into `out_dir` in `voice` (speaker, language, instruct, cloned voice and sampling settings;
    its seed and text are not used: each chunk has its own, rvqtts.documents.plan). Writes each chapter's audio and
    captions as it is finished, the audiobook (.m4b) once every chapter is there, and manifest.json. Raises OSError
    where the folder cannot be written (a full disk: the chapters finished stay whole, a rerun resumes) and
    NonFiniteError for a model that made NaN or inf; a chunk that fails fails its chapter, the others go on."""
    job = _Job(document, out_dir, voice, synth.languages, options, on_progress)
    lines = job.begin(synth.identity(), synth.sample_rate)
    if lines:  # `synthesize_many` takes the batch size None as the Synthesizer's, else measures it, and says so
        answers = attempt(synth, lines, job.defaults, options.chunk_chars, options.batch_size, on_notice)
        for line, (status, value) in answers:
            job.answer(line, status, value)
    return job.finish()


def narrate_on_ray(
    spec,
    document: Document,
    out_dir: str | Path,
    voice: Line = Line(),
    options: ReadingOptions = ReadingOptions(),
    address: str = "auto",
    workers: int | None = None,
    on_progress: Callable[[ReadingProgress], None] | None = None,
):
    """`narrate` with the chunks made by Ray workers (rvqtts.serving.cluster.WorkerSpec `spec`: each loads the model
    once); this process stores every chunk and writes every file, as it would alone. The chunks to make are known
    once the first worker has loaded the model (its identity keys them). Returns the ReadingResult and the
    ClusterBatch (workers, wall time, retries); raises ClusterError where the cluster cannot run it."""
    from rvqtts.qwen.checkpoints import model_voices
    from rvqtts.serving.cluster import render_on_ray

    job = _Job(document, out_dir, voice, model_voices(spec.model).languages, options, on_progress)
    upper = sum(len(plan.chunks) for plan in job.asked)

    batch = render_on_ray(
        lambda loaded: job.begin(loaded["identity"], loaded["sample_rate"]),
        spec,
        job.defaults,
        options.chunk_chars,
        lambda line, status, value, worker: job.answer(line, status, value),
        upper,
        address=address,
        workers=workers,
    )
    return job.finish(), batch


class _Job:
    """One run of `narrate`: the chapters' states, the chunks' store, the manifest and the progress. `begin` plans it
    once the model's identity is known, `answer` takes each chunk made (here or on a Ray worker), `finish` ends it."""

    def __init__(self, document, out_dir, voice, languages, options, on_progress):
        self.began = time.perf_counter()
        self.document, self.out_dir, self.options, self.on_progress = document, Path(out_dir), options, on_progress
        self.voice = replace(voice, language=document_language(languages, document, voice.language))
        self.defaults = replace(self.voice, text="", seed=None, utterance=None, name=None)  # every chunk's voice
        self.plans = plan_document(document, options.seed, options.lexicon, options.chunk_chars)
        chosen = sorted(set(options.chapters or range(1, len(self.plans) + 1)))
        if not chosen or chosen[0] < 1 or chosen[-1] > len(self.plans):
            raise ValueError(f"chapters {options.chapters}: the document has chapters 1 to {len(self.plans)}")
        self.asked = [self.plans[n - 1] for n in chosen]
        self.store = ChunkStore(self.out_dir)
        self.previous = read_records(self.out_dir / MANIFEST)
        self.results: dict[int, ChapterResult] = {}
        self.entries = _previous_entries(self.previous, len(document.chapters))
        # how a chapter's file is made from its chunks: a file made otherwise is not this run's
        self.assembly = {
            "paragraph_pause": options.paragraph_pause,
            "captions": options.captions,
            "loudness": options.loudness,
        }
        self.making: list[ChapterPlan] = []
        self.notices: list[str] = []  # this run's; the document's own are the caller's (Document.notices)
        self.chunks_total = self.chunks_done = 0
        self.made_chunks = 0
        self.audio_made = 0.0
        self.rows = 1  # the most rows a chunk of this run was spoken in (its record's batch_rows)
        self.identity: dict = {}
        self.keys: dict[int, list[str]] = {}
        self.sample_rate = 0
        self.waiting: Counter[int] = Counter()  # chunks each chapter being made waits for
        self.by_key: dict[str, tuple[ChapterPlan, PlannedChunk]] = {}

    def begin(self, model: dict, sample_rate: int) -> list[Line]:
        """The job planned for the model whose identity (Synthesizer.identity) and sample rate are given: the
        chapters' states, those whose chunks are all stored assembled, and the chunks to make as lines (their output
        name their key)."""
        self.sample_rate = sample_rate
        self.identity = speech_identity(model, self.voice, self.options.chunk_chars)
        self.keys = {plan.number: [chunk_key(self.identity, chunk) for chunk in plan.chunks] for plan in self.asked}
        self.start(self.asked)
        missing = [
            (plan, chunk, key)
            for plan in self.making
            for chunk, key in zip(plan.chunks, self.keys[plan.number])
            if not self.store.has(key)
        ]
        self.chunks_done = self.chunks_total - len(missing)
        self.report()
        self.waiting = Counter(plan.number for plan, _, _ in missing)
        self.by_key = {key: (plan, chunk) for plan, chunk, key in missing}
        for plan in self.making:
            if not self.waiting[plan.number]:
                self.assemble(plan)
        return [Line(text=chunk.text, seed=chunk.seed, utterance=0, name=f"{key}.wav") for _, chunk, key in missing]

    def start(self, asked: list[ChapterPlan]) -> None:
        """Each chapter asked for: done before (its file there with these chunks), kept (there, other settings), or to
        make (its file missing, not in the manifest, or --force)."""
        for plan in asked:
            name = chapter_file(plan, self.options.audio_suffix)
            entry = self.entries.get(plan.number)
            there = (self.out_dir / name).is_file() and entry is not None and entry.get("file") == name
            made_so = entry is not None and (entry.get("keys"), entry.get("assembly"))
            same = made_so == (self.keys[plan.number], self.assembly)
            if there and not self.options.force and same:
                self.results[plan.number] = ChapterResult(plan.number, plan.title, "done", name, entry.get("seconds"))
            elif there and not self.options.force:
                self.results[plan.number] = ChapterResult(plan.number, plan.title, "kept", name, entry.get("seconds"))
                self.notices.append(
                    f"chapter {plan.number}: {name} was made with other text, settings or pauses and is kept; --force "
                    f"--chapters {plan.number} remakes it"
                )
            else:
                self.making.append(plan)
        self.chunks_total = sum(len(self.keys[plan.number]) for plan in asked)

    def report(self) -> None:
        if self.on_progress:
            done = sum(result.status != "failed" for result in self.results.values())
            self.on_progress(
                ReadingProgress(
                    self.chunks_done,
                    self.chunks_total,
                    done,
                    len(self.asked),
                    self.audio_made,
                    time.perf_counter() - self.began,
                    self.made_chunks,
                )
            )

    def answer(self, line: Line, status: str, value) -> BatchResult:
        """A chunk made ("done", its Rendered) or not ("failed", why): stored, its chapter assembled once its last
        chunk is, or failed with its first failed chunk (the chunks it made are kept for a rerun)."""
        key = line.name.removesuffix(".wav")
        plan, chunk = self.by_key[key]
        if status != "done":
            if plan.number not in self.results:
                self.fail(plan, f"chunk {chunk.number} ({chunk.text[:40]!r}...): {value}")
            return BatchResult(line, "failed", error=value)
        self.keep(key, value)
        self.waiting[plan.number] -= 1
        if not self.waiting[plan.number] and plan.number not in self.results:
            self.assemble(plan)
        return BatchResult(line, "done", value.record)

    def keep(self, key: str, rendered: Rendered) -> None:
        """A chunk made, into the store, and counted."""
        self.store.keep(key, rendered)
        self.rows = max(self.rows, rendered.record["batch_rows"])
        self.chunks_done += 1
        self.made_chunks += 1
        self.audio_made += rendered.record["audio_seconds"]
        self.report()

    def fail(self, plan: ChapterPlan, error: str) -> None:
        name = chapter_file(plan, self.options.audio_suffix)
        self.results[plan.number] = ChapterResult(plan.number, plan.title, "failed", name, error=error)
        self.notices.append(f"chapter {plan.number} failed: {error}")

    def assemble(self, plan: ChapterPlan) -> None:
        """A chapter's files from its stored chunks (rvqtts.documents.chapter_files), its manifest entry."""
        keys = self.keys[plan.number]
        suffix = self.options.audio_suffix
        entry = write_chapter(self.store, plan, keys, self.out_dir, self.sample_rate, self.assembly, suffix)
        self.entries[plan.number] = entry
        self.results[plan.number] = ChapterResult(plan.number, plan.title, "made", entry["file"], entry["seconds"])
        self.write_manifest(None)
        self.report()

    def ordered_entries(self) -> list[dict]:
        """The chapters' manifest entries in chapter order."""
        return [self.entries[number] for number in sorted(self.entries)]

    def warnings(self) -> list[str]:
        """The chunks' warnings (cut at their frame limit), chapter by chapter."""
        return [
            f"chapter {entry['number']}, chunk {chunk['number']}: {warning}"
            for entry in self.ordered_entries()
            for chunk in entry["chunks"]
            for warning in chunk["warnings"]
        ]

    def write_manifest(self, audiobook: dict | None, statistics: dict | None = None) -> None:
        document = self.document
        write_json(
            self.out_dir / MANIFEST,
            {
                "document": {
                    "title": document.title,
                    "author": document.author,
                    "language": document.language,
                    "chapters": len(document.chapters),
                },
                "settings": {
                    "seed": self.options.seed,
                    "paragraph_pause": self.options.paragraph_pause,
                    "chapter_pause": self.options.chapter_pause,
                    "chunk_chars": self.options.chunk_chars,
                    "lexicon_entries": len(self.options.lexicon.entries),
                    "seed_rule": "sha256('SEED:CHAPTER:CHUNK')[:4] >> 1 (docs/documents.md)",
                },
                "chapters": self.ordered_entries(),
                "audiobook": audiobook or self.previous.get("audiobook"),
                "warnings": self.warnings(),
                "notices": [*self.document.notices, *self.notices],
                "statistics": statistics or self.previous.get("statistics"),
            },
        )

    def finish(self) -> ReadingResult:
        """The audiobook once every chapter of the document is there (remade when a chapter was), the manifest."""
        audiobook_path, audiobook = None, None
        failed = any(result.status == "failed" for result in self.results.values())
        plans = self.plans
        there = [p.number in self.entries and (self.out_dir / self.entries[p.number]["file"]).is_file() for p in plans]
        if self.options.audiobook and all(there) and not failed:
            audiobook_path = self.out_dir / f"{slug(self.document.title) or 'audiobook'}.m4b"
            made_as = self.audiobook_source()
            before = self.previous.get("audiobook") or {}
            if self.options.force or not audiobook_path.is_file() or before.get("source") != made_as:
                pause = self.options.chapter_pause
                book = write_book(audiobook_path, self.ordered_entries(), self.document, self.sample_rate, pause)
                audiobook = book | {"source": made_as}
        elif self.options.audiobook and not failed:
            self.notices.append("the audiobook is made once every chapter is (run without --chapters)")
        write_cover(self.out_dir, self.document.cover, self.options.force)
        wall = time.perf_counter() - self.began
        statistics = {
            "chunks": self.chunks_total,
            "chunks_made": self.made_chunks,
            "audio_seconds_made": round(self.audio_made, 3),
            "wall_seconds": round(wall, 3),
            "audio_per_wall_second": round(self.audio_made / wall, 4) if self.made_chunks else None,
            "batch_rows": self.rows,
            "memory": memory_record(),
            "identity": self.identity,
        }
        self.write_manifest(audiobook, statistics)
        return ReadingResult(
            [self.results[n] for n in sorted(self.results)],
            audiobook_path if audiobook_path and audiobook_path.is_file() else None,
            self.out_dir / MANIFEST,
            statistics,
            self.notices,
            self.warnings(),
        )

    def audiobook_source(self) -> dict:
        """What the audiobook is made of: the chapter files (with their chunks), the chapter pause and the tags; a
        change in any of them remakes it."""
        return {
            "chapters": [
                [entry["file"], entry["title"], entry.get("keys"), entry.get("assembly")]
                for entry in self.ordered_entries()
            ],
            "chapter_pause": self.options.chapter_pause,
            "title": self.document.title,
            "author": self.document.author,
        }


def _previous_entries(previous: dict, chapters: int) -> dict[int, dict]:
    """The chapter entries of an earlier run's manifest for chapters this document has (a damaged or foreign
    manifest's are dropped: those chapters are made again)."""
    entries = {}
    for entry in previous.get("chapters", []) if isinstance(previous.get("chapters"), list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("number"), int) and 1 <= entry["number"] <= chapters:
            if isinstance(entry.get("file"), str) and isinstance(entry.get("chunks"), list):
                entries[entry["number"]] = entry
    return entries
