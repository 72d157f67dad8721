"""Captions of a chapter's audio as SubRip (.srt) and WebVTT (.vtt): a cue per sentence as written, its times taken
from where its chunk's samples lie in the chapter; where a chunk holds several sentences, each gets its share of the
chunk's time by the weight of its text (an estimate: the model does not say where a sentence ends)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cue:
    start: float  # seconds from the chapter's start
    end: float
    text: str


def sentence_cues(placements: list[tuple[float, float, tuple[tuple[int, float], ...]]], sentences: tuple[str, ...]):
    """Cues for `sentences` (numbered from 1) from each chunk's (start, end, its sentences' shares), in order; a
    sentence spread over chunks spans them, and no cue starts before the one before it ends."""
    spans: dict[int, list[float]] = {}
    for start, end, shares in placements:
        at = start
        for number, share in shares:
            until = at + share * (end - start)
            span = spans.setdefault(number, [at, until])
            span[1] = until
            at = until
    cues, previous_end = [], 0.0
    for number, (start, end) in sorted(spans.items()):  # a crossfade's overlap goes to the later sentence's cue
        start = min(max(start, previous_end), end)
        cues.append(Cue(round(start, 3), round(end, 3), sentences[number - 1]))
        previous_end = end
    return cues


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{separator}{millis % 1000:03d}"


def srt(cues: list[Cue]) -> str:
    """SubRip: numbered cues, times as HH:MM:SS,mmm."""
    return "".join(
        f"{number}\n{_clock(cue.start, ',')} --> {_clock(cue.end, ',')}\n{cue.text}\n\n"
        for number, cue in enumerate(cues, start=1)
    )


def webvtt(cues: list[Cue]) -> str:
    """WebVTT: times as HH:MM:SS.mmm, the text escaped (&, <, > are markup there)."""

    def escaped(text: str) -> str:
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    body = "".join(f"{_clock(c.start, '.')} --> {_clock(c.end, '.')}\n{escaped(c.text)}\n\n" for c in cues)
    return "WEBVTT\n\n" + body
