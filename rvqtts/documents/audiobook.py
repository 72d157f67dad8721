"""An audiobook file: the chapters' audio in one .m4b (AAC in MP4, through PyAV, whose wheel ships FFmpeg's AAC
encoder), a chapter mark at each chapter's first sample, the title and author as tags. Written block by block
(memory stays flat) and atomically."""

from __future__ import annotations

import fractions
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from rvqtts.support.files import atomic_path

AAC_BIT_RATE = 64_000  # mono speech at 24 kHz
AAC_FRAME = 1024  # samples an AAC frame holds: a chapter mark's precision


@dataclass(frozen=True)
class BookChapter:
    """A chapter of the audiobook: its title and its samples as blocks of float32 in [-1, 1] (read when written)."""

    title: str
    blocks: Callable[[], Iterable[np.ndarray]]


class AudiobookError(RuntimeError):
    """PyAV is missing or could not write the file."""


def _pcm16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype(np.int16)


def write_audiobook(
    path: Path,
    chapters: list[BookChapter],
    sample_rate: int,
    title: str,
    author: str | None = None,
    pause_seconds: float = 0.0,
) -> list[tuple[float, float]]:
    """Write the .m4b at `path` (each chapter followed by `pause_seconds` of silence, the last one too); returns each
    chapter's (start, end) in seconds, as its marks say."""
    try:
        import av
    except ImportError as error:
        raise AudiobookError("the .m4b audiobook needs PyAV: pip install av (or --no-audiobook)") from error
    try:
        return _written(av, path, chapters, sample_rate, title, author, pause_seconds)
    except av.FFmpegError as error:
        if isinstance(error, OSError):  # the disk full, the folder gone: the caller's to say
            raise
        raise AudiobookError(f"cannot write the audiobook {path.name}: {error}") from error


def _written(av, path, chapters, sample_rate, title, author, pause_seconds) -> list[tuple[float, float]]:
    marks: list[tuple[int, int]] = []
    with atomic_path(path) as partial:
        with av.open(str(partial), "w", format="ipod") as container:
            stream = container.add_stream("aac", rate=sample_rate, layout="mono")
            stream.bit_rate = AAC_BIT_RATE
            container.metadata.update({"title": title, "album": title, "genre": "Audiobook"})
            if author:
                container.metadata.update({"artist": author, "album_artist": author})
            position = 0
            silence = np.zeros(int(round(pause_seconds * sample_rate)), dtype=np.float32)
            for chapter in chapters:
                start = position
                for block in _with_pause(chapter.blocks(), silence):
                    frame = av.AudioFrame.from_ndarray(_pcm16(block)[None, :], format="s16", layout="mono")
                    frame.sample_rate, frame.pts = sample_rate, position
                    position += block.size
                    for packet in stream.encode(frame):
                        container.mux(packet)
                marks.append((start, position))
            for packet in stream.encode(None):
                container.mux(packet)
            container.set_chapters(
                [
                    {
                        "id": number,
                        "start": start,
                        "end": end,
                        "time_base": fractions.Fraction(1, sample_rate),
                        "metadata": {"title": chapter.title},
                    }
                    for number, (chapter, (start, end)) in enumerate(zip(chapters, marks), start=1)
                ]
            )
    return [(start / sample_rate, end / sample_rate) for start, end in marks]


def _with_pause(blocks: Iterable[np.ndarray], silence: np.ndarray) -> Iterator[np.ndarray]:
    for block in blocks:
        if block.size:
            yield block
    if silence.size:
        yield silence
