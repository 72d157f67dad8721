"""A document as rvqtts reads it: its title, author, language and cover, and its chapters of paragraphs (the text as
written, whitespace collapsed); what every reader makes (rvqtts.documents.reading picks the reader)."""

from __future__ import annotations

from dataclasses import dataclass, field


class DocumentError(ValueError):
    """A document that cannot be read as one; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Chapter:
    """A chapter: its title and its paragraphs, each a block of text to speak (headings and list items are
    paragraphs too)."""

    title: str
    paragraphs: tuple[str, ...]


@dataclass(frozen=True)
class Cover:
    """A cover image as stored in the document."""

    data: bytes
    media_type: str


@dataclass(frozen=True)
class Document:
    """A document's metadata and its chapters with text; `notices` say what was left out (chapters without text)."""

    title: str
    chapters: tuple[Chapter, ...]
    author: str | None = None
    language: str | None = None  # the document's own language tag (BCP 47, e.g. "en-GB"), where it names one
    cover: Cover | None = None
    notices: tuple[str, ...] = field(default_factory=tuple)

    @property
    def characters(self) -> int:
        return sum(len(paragraph) for chapter in self.chapters for paragraph in chapter.paragraphs)


def collapse(text: str) -> str:
    """Whitespace runs as single spaces, the ends trimmed."""
    return " ".join(text.split())
