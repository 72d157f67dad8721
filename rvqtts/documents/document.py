"""A document as rvqtts reads it: its title, author, language and cover, and its chapters of paragraphs (the text as
written, whitespace collapsed). `read_document` picks the reader by the file's suffix (rvqtts.documents.epub,
rvqtts.documents.markdown, rvqtts.documents.plain_text)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

DOCUMENT_KINDS = ("auto", "epub", "markdown", "text")
_SUFFIXES = {".epub": "epub", ".md": "markdown", ".markdown": "markdown", ".txt": "text", ".text": "text"}


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


def document_kind(path: str, kind: str = "auto") -> str:
    """epub, markdown or text for `path` ("-": standard input, plain text) under `kind` (auto: by its suffix)."""
    if kind not in DOCUMENT_KINDS:
        raise DocumentError(f"unknown document kind {kind!r}: choose {', '.join(DOCUMENT_KINDS)}")
    if kind != "auto":
        return kind
    return "text" if path == "-" else _SUFFIXES.get(Path(path).suffix.lower(), "text")


def read_document(path: str | Path, kind: str = "auto", encoding: str | None = None) -> Document:
    """The document at `path` ("-": standard input) read as `kind` (auto: .epub, .md/.markdown, else plain text);
    `encoding` for a text or Markdown file that is not UTF-8. DocumentError for one that cannot be read, is not what
    it claims, or has nothing to say."""
    from rvqtts.documents import epub, markdown, plain_text

    path = str(path)
    kind = document_kind(path, kind)
    if kind == "epub":
        if path == "-":
            raise DocumentError("an EPUB cannot be read from standard input: give its file")
        document = epub.read_epub(Path(path))
    else:
        title = "Untitled" if path == "-" else Path(path).stem
        text = _read_text(path, encoding)
        document = (markdown.read_markdown if kind == "markdown" else plain_text.read_plain_text)(text, title)
    if not document.chapters:
        where = "standard input" if path == "-" else path
        raise DocumentError(f"{where}: nothing to say (no text in the document)")
    return document


def _read_text(path: str, encoding: str | None) -> str:
    """A text file's (or standard input's) characters, UTF-8 unless `encoding` says otherwise."""
    where = "standard input" if path == "-" else path
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as error:
        raise DocumentError(f"cannot read {where}: {error.strerror or error}") from error
    try:
        return data.decode(encoding or "utf-8-sig")
    except LookupError as error:
        raise DocumentError(f"unknown --encoding {encoding!r} (e.g. utf-8, latin-1, cp1252)") from error
    except UnicodeDecodeError as error:
        shown = data[error.start : error.start + 1]
        raise DocumentError(
            f"{where} is not {encoding or 'UTF-8'} text (byte {error.start} is {shown!r}): give its encoding with "
            "--encoding (e.g. --encoding latin-1)"
        ) from error
