"""Reading a document from a file or standard input: its kind by suffix (EPUB, Markdown, plain text), a text file's
encoding, and the reader for its kind (rvqtts.documents.epub, rvqtts.documents.markdown,
rvqtts.documents.plain_text)."""

from __future__ import annotations

import sys
from pathlib import Path

from rvqtts.documents import epub, markdown, plain_text
from rvqtts.documents.document import Document, DocumentError

DOCUMENT_KINDS = ("auto", "epub", "markdown", "text")
_SUFFIXES = {".epub": "epub", ".md": "markdown", ".markdown": "markdown", ".txt": "text", ".text": "text"}


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
