"""Long text: sentence splitting, chunks the model handles well, and how many frames a chunk may need.

Qwen3-TTS degrades on long inputs and sometimes misses its end-of-speech code and runs on. rvqtts
speaks long text as a sequence of chunks cut at sentence ends (then at clause marks, then at spaces),
and caps each chunk's frames at a generous multiple of what its text can need.
"""

from __future__ import annotations

import re
import unicodedata

_CLOSERS = re.escape("\"'”’)]」』）")
# A sentence ends after . ! ? … (and any closing quote or bracket) before a space, or after a CJK full
# stop, which needs no space.
_SENTENCE_END = re.compile(
    rf"(?<=[.!?…])\s+|(?<=[.!?…][{_CLOSERS}])\s+|(?<=[。！？])(?![{_CLOSERS}])|(?<=[。！？][{_CLOSERS}])"
)
_CLAUSE_END = re.compile(r"(?<=[,;:，；：、])\s*")
_SPACES = re.compile(r"\s+")
MAX_CHUNK_WEIGHT = 240  # about 17 s of English speech
FRAMES_PER_SECOND = 12.5
LATIN_CHARS_PER_SECOND = 14.0


def char_weight(char: str) -> float:
    """How much speech a character stands for, relative to a Latin letter (ideographs and kana are syllables)."""
    return 2.5 if unicodedata.name(char, "").startswith(("CJK", "HIRAGANA", "KATAKANA", "HANGUL")) else 1.0


def text_weight(text: str) -> float:
    return sum(char_weight(c) for c in text)


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, whitespace-normalised, punctuation kept."""
    return [s.strip() for s in _SENTENCE_END.split(" ".join(text.split())) if s.strip()]


def complete_sentences(text: str) -> tuple[list[str], str]:
    """The whole sentences at the start of text that is still being written (an LLM's words as they come), and what
    follows them: a sentence counts as whole once the space after its end has come (or, in CJK, its full stop)."""
    ends = list(_SENTENCE_END.finditer(text))
    if not ends:
        return [], text
    return split_sentences(text[: ends[-1].end()]), text[ends[-1].end() :]


def _cut_by_weight(text: str, limit: float) -> list[str]:
    """Last resort for a run with no break point (ideographs without punctuation)."""
    pieces, start, weight = [], 0, 0.0
    for i, char in enumerate(text):
        if weight + char_weight(char) > limit and i > start:
            pieces.append(text[start:i])
            start, weight = i, 0.0
        weight += char_weight(char)
    return pieces + [text[start:]]


def _pack(pieces: list[str], limit: float, breaks: list[re.Pattern]) -> list[str]:
    """Join consecutive pieces into chunks of at most `limit`; split heavier pieces at the next kind of break."""
    chunks: list[str] = []
    for piece in pieces:
        if text_weight(piece) <= limit:
            parts = [piece]
        elif breaks and len(finer := [p for p in breaks[0].split(piece) if p]) > 1:
            parts = _pack(finer, limit, breaks[1:])
        elif breaks:
            parts = _pack([piece], limit, breaks[1:])
        else:
            parts = _cut_by_weight(piece, limit)
        for part in parts:
            joined = f"{chunks[-1]} {part}" if chunks else part
            if chunks and text_weight(joined) <= limit:
                chunks[-1] = joined
            else:
                chunks.append(part)
    return chunks


def chunk_text(text: str, limit: float = MAX_CHUNK_WEIGHT) -> list[str]:
    """Consecutive chunks of whole sentences, each at most `limit` in weight (long sentences are cut)."""
    return _pack(split_sentences(text), limit, [_CLAUSE_END, _SPACES])


def frames_warranted(text: str) -> int:
    """The most frames a chunk may take before it counts as runaway generation: three times the
    speaking time its text needs at about 14 Latin characters per second, plus two seconds."""
    seconds = text_weight(text) / LATIN_CHARS_PER_SECOND
    return int(FRAMES_PER_SECOND * (3.0 * seconds + 2.0))


def frame_limit(text: str, max_frames: int | None, model_limit: int) -> int:
    """The most frames a chunk of `text` may take: `max_frames` where the user gave it (it may exceed the text's
    warrant), else as many as the text warrants within the model's own limit (a model that never ends its speech is
    cut there)."""
    return max_frames if max_frames is not None else min(model_limit, frames_warranted(text))
