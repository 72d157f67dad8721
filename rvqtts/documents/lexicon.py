"""A lexicon: words or phrases and how to say them, applied to a document's text before it is chunked (captions keep
the text as written). Its file holds one entry a line, `written = spoken`; blank lines and lines starting with #
are skipped. An entry matches whole words only, as written (case counts), the longest first."""

from __future__ import annotations

import re
from pathlib import Path

from rvqtts.documents.document import DocumentError


class Lexicon:
    """Written forms and their spoken forms; `apply` rewrites a text in one pass."""

    def __init__(self, entries: dict[str, str] | None = None):
        self.entries = dict(entries or {})
        written = sorted(self.entries, key=len, reverse=True)
        alternatives = "|".join(re.escape(w) for w in written)
        self._pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)") if written else None

    def apply(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda match: self.entries[match.group(0)], text)


def read_lexicon(path: str | Path) -> Lexicon:
    """A lexicon file's entries; DocumentError naming the line of one that is not `written = spoken`."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DocumentError(f"cannot read lexicon {path}: {error}") from error
    entries: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        written, equals, spoken = line.partition("=")
        if not equals or not written.strip() or not spoken.strip():
            raise DocumentError(f"{path}:{number}: a lexicon entry is `written = spoken`, got {line.strip()!r}")
        entries[" ".join(written.split())] = " ".join(spoken.split())
    return Lexicon(entries)
