"""A chapter's files from the chunk store: its audio (the chunks joined, paragraphs paused, at a loudness where asked)
and its captions, written whole, and its manifest entry; the audiobook and the cover from the chapters' files."""

from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path

import numpy as np

from rvqtts.documents.audiobook import BookChapter, write_audiobook
from rvqtts.documents.captions import sentence_cues, srt, webvtt
from rvqtts.documents.chunk_store import ChunkStore, chapter_blocks
from rvqtts.documents.document import Cover, Document
from rvqtts.documents.loudness import LoudnessMeter
from rvqtts.documents.plan import ChapterPlan
from rvqtts.support.audio import audio_format
from rvqtts.support.files import atomic_path, write_atomically

BLOCK = 1 << 16  # samples read at a time from a chapter's file for the audiobook
COVER_SUFFIXES = {"image/jpeg": ".jpg", "image/png": ".png", "image/gif": ".gif", "image/webp": ".webp"}


def slug(text: str, limit: int = 48) -> str:
    """A file-name-safe form of a title: ASCII letters, digits and dashes."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[^A-Za-z0-9]+", "-", ascii_text).strip("-").lower()[:limit].strip("-")


def chapter_file(plan: ChapterPlan, suffix: str) -> str:
    """A chapter's audio file name: its number (two digits at least) and its title's slug."""
    name = slug(plan.title)
    return f"{plan.number:02d}{'-' + name if name else ''}{suffix}"


def write_chapter(
    store: ChunkStore, plan: ChapterPlan, keys: list[str], out_dir: Path, sample_rate: int, assembly: dict, suffix: str
) -> dict:
    """A chapter's audio file and (with `assembly["captions"]`) captions from its stored chunks, each written
    atomically, at `assembly`'s paragraph pause and loudness; its manifest entry."""
    import soundfile

    name = chapter_file(plan, suffix)
    placements: list = []
    pause = assembly["paragraph_pause"]
    gain = chapter_gain(store, plan, keys, sample_rate, pause, assembly["loudness"])
    factor = 10 ** (gain["gain_db"] / 20) if gain else 1.0
    container, subtype = audio_format(name)
    frames = 0
    with atomic_path(out_dir / name) as partial:
        with soundfile.SoundFile(partial, "w", sample_rate, 1, subtype, format=container) as sink:
            for block in chapter_blocks(store, plan, keys, sample_rate, pause, placements):
                sink.write(np.clip(block * factor if gain else block, -1.0, 1.0))
                frames += block.size
    cues = sentence_cues([(start, end, chunk.sentences) for chunk, start, end in placements], plan.sentences)
    captions = [f"{Path(name).stem}.srt", f"{Path(name).stem}.vtt"] if assembly["captions"] else []
    if captions:
        write_atomically(out_dir / captions[0], srt(cues).encode())
        write_atomically(out_dir / captions[1], webvtt(cues).encode())
    chunks = [
        {
            "number": chunk.number,
            "paragraph": chunk.paragraph,
            "text": chunk.text,
            "seed": chunk.seed,
            "start": round(start, 3),
            "end": round(end, 3),
            "warnings": store.warnings(key),
        }
        for (chunk, start, end), key in zip(placements, keys)
    ]
    entry = {"number": plan.number, "title": plan.title, "file": name, "captions": captions}
    entry |= {"seconds": round(frames / sample_rate, 3), "characters": plan.characters, "keys": keys}
    return entry | {"assembly": assembly, "chunks": chunks} | ({"loudness": gain} if gain else {})


def chapter_gain(
    store: ChunkStore, plan: ChapterPlan, keys: list[str], sample_rate: int, pause: float, target: float | None
) -> dict | None:
    """With a loudness target, the chapter's integrated loudness (a first pass over its chunks) and the gain in dB
    that brings it there; None without one, or for a silent chapter."""
    if target is None:
        return None
    meter = LoudnessMeter(sample_rate)
    for block in chapter_blocks(store, plan, keys, sample_rate, pause, []):
        meter.push(block)
    measured = meter.integrated()
    if not math.isfinite(measured):
        return None
    return {"measured_lufs": round(measured, 2), "gain_db": round(target - measured, 2)}


def write_book(path: Path, entries: list[dict], document: Document, sample_rate: int, chapter_pause: float) -> dict:
    """The .m4b of the chapters' files (`entries`, in order), read back block by block, a chapter pause after each;
    its manifest record."""
    import soundfile

    def blocks(name: str):
        return lambda: soundfile.blocks(str(path.parent / name), blocksize=BLOCK, dtype="float32")

    chapters = [BookChapter(entry["title"], blocks(entry["file"])) for entry in entries]
    marks = write_audiobook(path, chapters, sample_rate, document.title, document.author, chapter_pause)
    return {
        "file": path.name,
        "chapters": [
            {"title": entry["title"], "start": round(start, 3), "end": round(end, 3)}
            for entry, (start, end) in zip(entries, marks)
        ],
    }


def write_cover(out_dir: Path, cover: Cover | None, force: bool) -> None:
    """The document's cover image beside the chapters (cover.jpg, cover.png, ...), where it has one."""
    suffix = COVER_SUFFIXES.get(cover.media_type) if cover else None
    if suffix and (force or not (out_dir / f"cover{suffix}").is_file()):
        write_atomically(out_dir / f"cover{suffix}", cover.data)
