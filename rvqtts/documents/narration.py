"""A document spoken to a folder: every chunk of the chapters asked for is an utterance of the frame loop, B rows at
a time (Synthesizer.synthesize_many), each chunk's audio kept in the folder's chunk store as it ends, keyed by its
text and everything that changes its audio; a chapter's file and captions are assembled from the store once its
chunks are there, the audiobook once every chapter is. A run stopped at any moment resumes where it stopped and
ends with the files an uninterrupted run writes (docs/documents.md)."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import time
import unicodedata
from dataclasses import asdict, dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from rvqtts.documents.audiobook import BookChapter, write_audiobook
from rvqtts.documents.captions import sentence_cues, srt, webvtt
from rvqtts.documents.document import Document
from rvqtts.documents.lexicon import Lexicon
from rvqtts.documents.loudness import LoudnessMeter, check_loudness_target
from rvqtts.documents.plan import ChapterPlan, PlannedChunk, plan_document
from rvqtts.support.audio import AUDIO_FORMATS, StreamJoiner, audio_format
from rvqtts.support.files import atomic_path, read_records, write_atomically, write_json
from rvqtts.support.memory import memory_record
from rvqtts.synthesis.batch_files import BatchResult, Rendered, attempt
from rvqtts.synthesis.batch_size import choose_batch_size
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.text import LATIN_CHARS_PER_SECOND, MAX_CHUNK_WEIGHT

CHUNK_STORE = ".chunks"  # in the output folder: each chunk's audio (FLAC, 16-bit) and record, by key
MANIFEST = "manifest.json"
CHUNK_FORMAT = ".flac"  # a chunk's samples as `rvqtts synth` writes them in its 16-bit WAV, losslessly
BLOCK = 1 << 16  # samples read at a time from a chapter's file for the audiobook
COVER_SUFFIXES = {"image/jpeg": ".jpg", "image/png": ".png", "image/gif": ".gif", "image/webp": ".webp"}
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


def slug(text: str, limit: int = 48) -> str:
    """A file-name-safe form of a title: ASCII letters, digits and dashes."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[^A-Za-z0-9]+", "-", ascii_text).strip("-").lower()[:limit].strip("-")


def chapter_file(plan: ChapterPlan, suffix: str) -> str:
    """A chapter's audio file name: its number (two digits at least) and its title's slug."""
    name = slug(plan.title)
    return f"{plan.number:02d}{'-' + name if name else ''}{suffix}"


def document_language(languages: list[str], document: Document, asked: str | None) -> str | None:
    """The language to speak in: the one asked for, else the document's where the model (speaking `languages`) names
    it, else auto."""
    if asked not in (None, "auto") or not document.language:
        return asked
    named = LANGUAGES.get(document.language.split("-")[0].lower())
    return named if named in languages else asked


def speech_identity(model: dict, voice: Line, chunk_chars: float) -> dict:
    """Everything besides a chunk's text and seed that decides its audio: the model's identity (Synthesizer.identity:
    its weights' digests, dtypes, weight format, rvqtts's version), the voice (a cloned one's files by content), the
    sampling and the chunking."""
    clone = voice.clone
    cloned = None
    if clone is not None:
        sources = [path for path in (clone.ref_audio, clone.voice) if path is not None]
        files = {"ref_audio", "voice"}  # known by their content, so a folder moved or mounted elsewhere keeps its keys
        cloned = {key: value for key, value in clone.record().items() if key not in files}
        cloned["digest"] = [hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in sources]
    return {
        **model,
        "voice": {"speaker": voice.speaker, "language": voice.language, "instruct": voice.instruct, "clone": cloned},
        "settings": asdict(voice.settings or GenerationSettings()),
        "chunk_chars": chunk_chars,
    }


def chunk_key(identity: dict, chunk: PlannedChunk) -> str:
    """A chunk's name in the store: a digest of its text, its seed and the speech identity."""
    keyed = json.dumps({**identity, "text": chunk.text, "seed": chunk.seed}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(keyed.encode()).hexdigest()[:32]


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
    if lines:
        rows = options.batch_size or synth.batch_size
        if rows is None:
            rows, source = choose_batch_size(synth, len(lines), on_notice)
            if on_notice:
                on_notice(f"batch size {rows}: {source}")
        job.rows = rows
        for line, (status, value) in attempt(synth, lines, job.defaults, options.chunk_chars, rows, on_notice):
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
    job.rows = max((worker.rows for worker in batch.workers), default=1)
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
        self.store = self.out_dir / CHUNK_STORE
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
        self.rows = 1
        self.identity: dict = {}
        self.keys: dict[int, list[str]] = {}
        self.sample_rate = 0
        self.waiting: dict[int, int] = {}  # chunks each chapter being made waits for
        self.by_key: dict[str, tuple[ChapterPlan, PlannedChunk]] = {}

    def stored(self, key: str) -> bool:
        return (self.store / f"{key}{CHUNK_FORMAT}").is_file()

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
            if not self.stored(key)
        ]
        self.waiting = {plan.number: sum(1 for p, _, _ in missing if p is plan) for plan in self.making}
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
        self.chunks_done = self.chunks_total - sum(len(plan.chunks) for plan in self.making)
        self.chunks_done += sum(self.stored(key) for plan in self.making for key in self.keys[plan.number])
        self.report()

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
        """A chunk's record, then its audio (whose presence means done), into the store: the 16-bit samples of its
        WAV (`rendered.audio`, the bytes `rvqtts synth -o chunk.wav` writes) in FLAC, half the size."""
        import soundfile

        write_json(self.store / f"{key}.json", {"warnings": rendered.record["warnings"], "record": rendered.record})
        samples, rate = soundfile.read(io.BytesIO(rendered.audio), dtype="int16")
        flac = io.BytesIO()
        soundfile.write(flac, samples, rate, format="FLAC", subtype="PCM_16")
        write_atomically(self.store / f"{key}{CHUNK_FORMAT}", flac.getvalue())
        self.chunks_done += 1
        self.made_chunks += 1
        self.audio_made += rendered.record["audio_seconds"]
        self.report()

    def fail(self, plan: ChapterPlan, error: str) -> None:
        name = chapter_file(plan, self.options.audio_suffix)
        self.results[plan.number] = ChapterResult(plan.number, plan.title, "failed", name, error=error)
        self.notices.append(f"chapter {plan.number} failed: {error}")

    def assemble(self, plan: ChapterPlan) -> None:
        """A chapter's file and captions from its stored chunks (written atomically), and its manifest entry."""
        import soundfile

        name = chapter_file(plan, self.options.audio_suffix)
        keys = self.keys[plan.number]
        placements: list = []
        gain = self.gain(plan)
        blocks = chapter_blocks(self.store, plan, keys, self.sample_rate, self.options.paragraph_pause, placements)
        container, subtype = audio_format(name)
        frames = 0
        with atomic_path(self.out_dir / name) as partial:
            with soundfile.SoundFile(partial, "w", self.sample_rate, 1, subtype, format=container) as sink:
                for block in blocks:
                    sink.write(np.clip(block * gain["factor"] if gain else block, -1.0, 1.0))
                    frames += block.size
        seconds = round(frames / self.sample_rate, 3)
        cues = sentence_cues([(start, end, chunk.sentences) for chunk, start, end in placements], plan.sentences)
        if self.options.captions:
            stem = self.out_dir / Path(name).stem
            write_atomically(stem.with_suffix(".srt"), srt(cues).encode())
            write_atomically(stem.with_suffix(".vtt"), webvtt(cues).encode())
        self.entries[plan.number] = self.entry(plan, name, keys, seconds, placements)
        if gain:
            del gain["factor"]
            self.entries[plan.number]["loudness"] = gain
        self.results[plan.number] = ChapterResult(plan.number, plan.title, "made", name, seconds)
        self.write_manifest(None)
        self.report()

    def gain(self, plan: ChapterPlan) -> dict | None:
        """With a loudness target, the chapter's integrated loudness (a first pass over its chunks) and the gain that
        brings it there; None without one, or for a silent chapter."""
        target = self.options.loudness
        if target is None:
            return None
        meter = LoudnessMeter(self.sample_rate)
        keys = self.keys[plan.number]
        for block in chapter_blocks(self.store, plan, keys, self.sample_rate, self.options.paragraph_pause, []):
            meter.push(block)
        measured = meter.integrated()
        if not math.isfinite(measured):
            return None
        gain_db = target - measured
        return {"measured_lufs": round(measured, 2), "gain_db": round(gain_db, 2), "factor": 10 ** (gain_db / 20)}

    def entry(self, plan: ChapterPlan, name: str, keys: list[str], seconds: float, placements: list) -> dict:
        """A chapter's manifest entry: its files, length, and chunks with their places and warnings."""
        chunks = []
        for (chunk, start, end), key in zip(placements, keys):
            warnings = read_records(self.store / f"{key}.json").get("warnings", [])
            chunks.append(
                {
                    "number": chunk.number,
                    "paragraph": chunk.paragraph,
                    "text": chunk.text,
                    "seed": chunk.seed,
                    "start": round(start, 3),
                    "end": round(end, 3),
                    "warnings": warnings,
                }
            )
        captions = [f"{Path(name).stem}.srt", f"{Path(name).stem}.vtt"] if self.options.captions else []
        return {
            "number": plan.number,
            "title": plan.title,
            "file": name,
            "captions": captions,
            "seconds": seconds,
            "characters": plan.characters,
            "keys": keys,
            "assembly": self.assembly,
            "chunks": chunks,
        }

    def warnings(self) -> list[str]:
        """The chunks' warnings (cut at their frame limit), chapter by chapter."""
        return [
            f"chapter {entry['number']}, chunk {chunk['number']}: {warning}"
            for entry in sorted(self.entries.values(), key=lambda e: e["number"])
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
                "chapters": [self.entries[number] for number in sorted(self.entries)],
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
                audiobook = self.write_audiobook(audiobook_path) | {"source": made_as}
        elif self.options.audiobook and not failed:
            self.notices.append("the audiobook is made once every chapter is (run without --chapters)")
        self.write_cover()
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
        entries = [self.entries[number] for number in sorted(self.entries)]
        return {
            "chapters": [
                [entry["file"], entry["title"], entry.get("keys"), entry.get("assembly")] for entry in entries
            ],
            "chapter_pause": self.options.chapter_pause,
            "title": self.document.title,
            "author": self.document.author,
        }

    def write_cover(self) -> None:
        """The document's cover image beside the chapters (cover.jpg, cover.png, ...), where it has one."""
        cover = self.document.cover
        suffix = COVER_SUFFIXES.get(cover.media_type) if cover else None
        if suffix and (self.options.force or not (self.out_dir / f"cover{suffix}").is_file()):
            write_atomically(self.out_dir / f"cover{suffix}", cover.data)

    def write_audiobook(self, path: Path) -> dict:
        """The .m4b of every chapter's file, read back block by block, a chapter pause after each."""
        import soundfile

        def blocks(name: str):
            return lambda: soundfile.blocks(str(self.out_dir / name), blocksize=BLOCK, dtype="float32")

        entries = [self.entries[number] for number in sorted(self.entries)]
        chapters = [BookChapter(entry["title"], blocks(entry["file"])) for entry in entries]
        document = self.document
        marks = write_audiobook(
            path, chapters, self.sample_rate, document.title, document.author, self.options.chapter_pause
        )
        return {
            "file": path.name,
            "chapters": [
                {"title": entry["title"], "start": round(start, 3), "end": round(end, 3)}
                for entry, (start, end) in zip(entries, marks)
            ],
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


def chapter_blocks(
    store: Path, plan: ChapterPlan, keys: list[str], sample_rate: int, paragraph_pause: float, placements: list
) -> Iterator[np.ndarray]:
    """A chapter's samples from its stored chunks, block by block: the chunks of a paragraph joined by a crossfade
    (rvqtts.support.audio.StreamJoiner, as a long line's chunks are), a pause of silence between paragraphs. Each
    chunk's (chunk, start, end) in seconds is appended to `placements`."""
    import soundfile

    silence = np.zeros(int(round(paragraph_pause * sample_rate)), dtype=np.float32)
    position = 0
    paired = list(zip(plan.chunks, keys))
    for index, (_, group) in enumerate(groupby(paired, key=lambda pair: pair[0].paragraph)):
        if index:
            yield silence
            position += silence.size
        joiner, joined = StreamJoiner(sample_rate), 0
        for chunk, key in group:
            samples, _ = soundfile.read(str(store / f"{key}{CHUNK_FORMAT}"), dtype="float32")
            overlap = min(joiner.overlap, joined, samples.size)
            start = position + joined - overlap
            placements.append((chunk, start / sample_rate, (start + samples.size) / sample_rate))
            joined += samples.size - overlap
            yield joiner.add(samples, new_part=True)
        yield joiner.finish()
        position += joined
