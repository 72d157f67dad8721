"""A document as the frame loop speaks it: each paragraph's sentences (its lexicon applied) packed into chunks of
at most the chunk weight, as `rvqtts synth` chunks a long text, and each chunk's seed derived from the document's
seed and the chunk's place, so that a chunk is spoken the same in any batch, run or resumed run, and exactly as
`rvqtts synth "<chunk>" --seed <its seed>` speaks it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from rvqtts.documents.document import Document, DocumentError
from rvqtts.documents.lexicon import Lexicon
from rvqtts.synthesis.text import MAX_CHUNK_WEIGHT, chunk_text, split_sentences, text_weight

MAX_SENTENCE_CHARS = 10_000  # over twelve minutes of speech without a sentence end: not prose that can be paced


@dataclass(frozen=True)
class PlannedChunk:
    """One utterance of the frame loop: its text as spoken, its seed, where it stands in its chapter, and the
    sentences (as written, numbered within the chapter) it holds with each one's share of its text's weight."""

    chapter: int  # 1-based
    number: int  # 1-based, within its chapter
    paragraph: int  # 1-based, within its chapter
    text: str
    seed: int
    sentences: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class ChapterPlan:
    """A chapter's chunks in order and its sentences as written (the captions' text)."""

    number: int  # 1-based
    title: str
    chunks: tuple[PlannedChunk, ...]
    sentences: tuple[str, ...]
    characters: int

    @property
    def weight(self) -> float:
        return sum(text_weight(chunk.text) for chunk in self.chunks)


def chunk_seed(seed: int, chapter: int, number: int) -> int:
    """A chunk's seed: the first 31 bits (big-endian) of SHA-256 of "SEED:CHAPTER:CHUNK" in ASCII, the chapter and
    the chunk counted from 1 (docs/documents.md)."""
    digest = hashlib.sha256(f"{seed}:{chapter}:{number}".encode("ascii")).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def plan_chapter(
    document: Document, number: int, seed: int, lexicon: Lexicon = Lexicon(), limit: float = MAX_CHUNK_WEIGHT
) -> ChapterPlan:
    """Chapter `number` (1-based) of `document` in chunks; DocumentError for a sentence too long to speak."""
    chapter = document.chapters[number - 1]
    chunks: list[PlannedChunk] = []
    sentences: list[str] = []
    for paragraph_number, paragraph in enumerate(chapter.paragraphs, start=1):
        texts: list[str] = []
        shares: list[list[tuple[int, float]]] = []
        for sentence in split_sentences(paragraph):
            if len(sentence) > MAX_SENTENCE_CHARS:
                raise DocumentError(
                    f'chapter {number} ("{chapter.title}"), paragraph {paragraph_number}: {len(sentence):,} characters '
                    f"without a sentence end (. ! ?), more than {MAX_SENTENCE_CHARS:,}: not text that can be paced "
                    "as speech; add punctuation or break it into paragraphs"
                )
            sentences.append(sentence)
            for part in chunk_text(lexicon.apply(sentence), limit):
                joined = f"{texts[-1]} {part}" if texts else part
                if texts and text_weight(joined) <= limit:
                    texts[-1] = joined
                    shares[-1].append((len(sentences), text_weight(part)))
                else:
                    texts.append(part)
                    shares.append([(len(sentences), text_weight(part))])
        for text, parts in zip(texts, shares):
            place = len(chunks) + 1
            total = sum(weight for _, weight in parts) or 1.0
            held: dict[int, float] = {}
            for sentence_number, weight in parts:
                held[sentence_number] = held.get(sentence_number, 0.0) + weight / total
            chunks.append(
                PlannedChunk(
                    number, place, paragraph_number, text, chunk_seed(seed, number, place), tuple(held.items())
                )
            )
    characters = sum(len(paragraph) for paragraph in chapter.paragraphs)
    return ChapterPlan(number, chapter.title, tuple(chunks), tuple(sentences), characters)


def plan_document(
    document: Document, seed: int, lexicon: Lexicon = Lexicon(), limit: float = MAX_CHUNK_WEIGHT
) -> list[ChapterPlan]:
    """Every chapter of `document` in chunks (rvqtts.documents.plan.plan_chapter)."""
    return [plan_chapter(document, number, seed, lexicon, limit) for number in range(1, len(document.chapters) + 1)]


def parse_chapters(selection: str, count: int) -> list[int]:
    """The chapters a selection such as "3", "3-5" or "1,4-6" names (1-based, in order); DocumentError for one
    outside 1..count."""
    chosen: set[int] = set()
    for part in selection.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise DocumentError(f"--chapters takes numbers and ranges such as 3, 3-5 or 1,4-6; got {selection!r}")
        if low > high:
            raise DocumentError(f"--chapters {selection}: a range goes from the lower number to the higher, e.g. 3-5")
        if not 1 <= low <= high <= count:
            raise DocumentError(f"--chapters {selection}: the document has chapters 1 to {count}")
        chosen.update(range(low, high + 1))
    return sorted(chosen)
