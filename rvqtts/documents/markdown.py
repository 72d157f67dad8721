"""Markdown as a document, through markdown-it-py (CommonMark): chapters at the top level of headings (below a
lone first heading, which is the title), every other heading, paragraph, list item and quote a paragraph, their
markup not spoken (emphasis marks, link targets, images); code blocks and HTML are left out."""

from __future__ import annotations

import re

from markdown_it import MarkdownIt
from markdown_it.token import Token

from rvqtts.documents.document import Chapter, Document, collapse

_SPOKEN_INLINE = ("text", "code_inline")  # an image's alt text and raw HTML are not spoken
_BREAKS = ("softbreak", "hardbreak")


def _inline_text(token: Token) -> str:
    """The words of an inline token, its markup left out."""
    children = token.children or []
    return collapse(
        "".join(c.content if c.type in _SPOKEN_INLINE else " " if c.type in _BREAKS else "" for c in children)
    )


_FRONT_MATTER = re.compile(r"\A---[ \t]*\n.*?\n(---|\.\.\.)[ \t]*(\n|\Z)", re.DOTALL)


def _blocks(text: str) -> list[tuple[int, str]]:
    """The document's text blocks in order: (heading level, text) for headings, (0, text) for the rest; YAML front
    matter (between --- lines at the top) is not text."""
    text = _FRONT_MATTER.sub("", text.lstrip("\ufeff"), count=1)
    blocks, level = [], 0
    for token in MarkdownIt("commonmark").parse(text):
        if token.type == "heading_open":
            level = int(token.tag[1])
        elif token.type == "heading_close":
            level = 0
        elif token.type == "inline" and (words := _inline_text(token)):
            blocks.append((level, words))
    return blocks


def read_markdown(text: str, title: str) -> Document:
    """A Markdown document: its chapters at the top heading level (the text before the first opens it), titled by
    their headings; a first heading alone at its level is the document's title (spoken at the start)."""
    blocks = _blocks(text)
    levels = [level for level, _ in blocks if level]
    top = min(levels, default=0)
    if levels.count(top) == 1 and blocks[0][0] == top and len(set(levels)) > 1:
        title = blocks[0][1]
        top = min(level for level in levels if level != top)
    chapters: list[tuple[str, list[str]]] = []
    opening: list[str] = []
    for level, words in blocks:
        if level == top and top:
            chapters.append((words, []))
        (chapters[-1][1] if chapters else opening).append(words)
    if not chapters:
        return Document(title=title, chapters=(Chapter(title, tuple(opening)),) if opening else ())
    chapters[0] = (chapters[0][0], opening + chapters[0][1])
    return Document(title=title, chapters=tuple(Chapter(name, tuple(paragraphs)) for name, paragraphs in chapters))
