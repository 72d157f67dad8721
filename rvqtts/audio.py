"""Audio out: joining chunks with a short crossfade, and WAV files written atomically (or to stdout)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np

from rvqtts.files import write_atomically

CROSSFADE_SECONDS = 0.05


def join_chunks(parts: list[np.ndarray], sample_rate: int, crossfade: float = CROSSFADE_SECONDS) -> np.ndarray:
    """Concatenate chunk waveforms, overlapping each seam by a linear crossfade of `crossfade` seconds
    (shortened where a chunk is shorter than that)."""
    if not parts:
        return np.zeros(0, dtype=np.float32)
    joined = parts[0].astype(np.float32)
    for part in parts[1:]:
        part = part.astype(np.float32)
        overlap = min(int(crossfade * sample_rate), joined.size, part.size)
        if overlap:
            fade = np.linspace(0.0, 1.0, overlap + 2, dtype=np.float32)[1:-1]
            seam = joined[-overlap:] * (1.0 - fade) + part[:overlap] * fade
            joined = np.concatenate([joined[:-overlap], seam, part[overlap:]])
        else:
            joined = np.concatenate([joined, part])
    return joined


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    """A 16-bit PCM mono WAV file in memory."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(audio, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def write_wav(target: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    """Write a WAV to a path (atomically) or, for "-", to standard output."""
    data = wav_bytes(audio, sample_rate)
    if str(target) == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        write_atomically(Path(target), data)


def write_codes(path: Path, codes: np.ndarray) -> None:
    """Save frame codes [frames, G] as an int64 .npy file, atomically."""
    buffer = io.BytesIO()
    np.save(buffer, codes.astype(np.int64))
    write_atomically(Path(path), buffer.getvalue())
