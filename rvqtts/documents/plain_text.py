"""Plain text as a document: paragraphs at blank lines, chapters at paragraphs that look like headings (a short
line of its own such as "Chapter 3", "PART TWO", "Prologue" or "IV."); the text before the first heading opens
the first chapter."""

from __future__ import annotations

import re

from rvqtts.documents.document import Chapter, Document, collapse

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_HEADING_WORDS = re.compile(
    r"^(chapter|part|book|section|prologue|epilogue|preface|foreword|introduction|afterword|interlude|appendix)\b",
    re.IGNORECASE,
)
_NUMBERED = re.compile(r"^(\d{1,3}|(?=[IVXLC])C{0,3}(XC|XL|L?X{0,3})(IX|IV|V?I{0,3}))\.?$")  # 12, 12., XIV, XIV.
MAX_HEADING_CHARS = 80


def is_heading(paragraph: str) -> bool:
    """Whether a paragraph (one line, as written) reads as a chapter heading: short, not a sentence, and either
    opening with a word such as Chapter or Part, a bare number or roman numeral, or written in capitals."""
    if "\n" in paragraph.strip() or len(paragraph.strip()) > MAX_HEADING_CHARS:
        return False
    line = paragraph.strip()
    if not line or line[-1] in ",;" or (line[-1] in ".!?…" and not _NUMBERED.match(line)):
        return False
    letters = [c for c in line if c.isalpha()]
    quoted = line[0] in "\"'“‘«" or line[-1] in "\"'”’»!?"
    capitals = len(letters) >= 4 and all(c.isupper() for c in letters) and not quoted
    return bool(_HEADING_WORDS.match(line) or _NUMBERED.match(line) or capitals)


def read_plain_text(text: str, title: str) -> Document:
    """A plain-text document: its chapters (a heading's paragraph spoken first; a heading right after another, such
    as a chapter's name under its number, joins it; two at most), or one chapter named `title`."""
    opening: list[str] = []  # before the first heading
    chapters: list[tuple[list[str], list[str]]] = []  # (the heading's lines, the paragraphs)
    for raw in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n").replace("\r", "\n")):
        paragraph = collapse(raw)
        if not paragraph:
            continue
        if is_heading(raw):
            if chapters and len(chapters[-1][1]) == len(chapters[-1][0]) == 1:  # a heading's second line
                chapters[-1][0].append(paragraph)
            else:
                chapters.append(([paragraph], []))
            chapters[-1][1].append(paragraph)
        else:
            (chapters[-1][1] if chapters else opening).append(paragraph)
    if not chapters:
        return Document(title=title, chapters=(Chapter(title, tuple(opening)),) if opening else ())
    chapters[0] = (chapters[0][0], opening + chapters[0][1])
    named = tuple(Chapter(". ".join(heading), tuple(paragraphs)) for heading, paragraphs in chapters)
    return Document(title=title, chapters=named)
