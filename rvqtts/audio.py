"""Audio out: joining chunks with a short crossfade, and WAV, FLAC or Ogg files written atomically (or a WAV
to stdout)."""

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


# Output containers soundfile writes, by file suffix; standard output ("-") always gets a WAV.
AUDIO_FORMATS = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".ogg": ("OGG", "VORBIS")}


def audio_format(target: str | Path) -> tuple[str, str]:
    """soundfile's (format, subtype) for an output name; ValueError for a suffix rvqtts cannot write."""
    if str(target) == "-":
        return AUDIO_FORMATS[".wav"]
    suffix = Path(target).suffix.lower()
    if suffix not in AUDIO_FORMATS:
        raise ValueError(f"{target}: rvqtts writes {', '.join(AUDIO_FORMATS)} files (or - for a WAV on standard "
                         f"output), not {suffix or 'a name without a suffix'}")
    return AUDIO_FORMATS[suffix]


def audio_bytes(audio: np.ndarray, sample_rate: int, container: tuple[str, str] = AUDIO_FORMATS[".wav"]) -> bytes:
    """A mono audio file in memory (16-bit PCM WAV unless `container` says otherwise)."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(audio, -1.0, 1.0), sample_rate, format=container[0], subtype=container[1])
    return buffer.getvalue()


def write_audio(target: str | Path, audio: np.ndarray, sample_rate: int) -> None:
    """Write audio in the format its suffix names (.wav, .flac, .ogg) atomically, or a WAV to standard
    output for "-"."""
    data = audio_bytes(audio, sample_rate, audio_format(target))
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
