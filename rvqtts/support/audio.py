"""Audio out: chunks joined with a short crossfade; WAV, FLAC or Ogg files written atomically, whole or as
a stream; WAV or raw PCM on standard output. Audio in: files read and resampled as qwen-tts would."""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path
from typing import Iterable

import numpy as np

from rvqtts.support.files import atomic_path, write_atomically

CROSSFADE_SECONDS = 0.05


class UnreadableAudio(Exception):
    """A file soundfile cannot read: not audio, or a format it does not know (its message says which)."""


def read_mono(path: str | Path) -> tuple[np.ndarray, int]:
    """A sound file's float32 samples, its channels averaged, and their rate: librosa.load(path, sr=None)'s
    for a file soundfile reads (the channels' mean is taken over the same contiguous axis); UnreadableAudio
    for one it cannot read."""
    import soundfile

    try:
        samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError, OSError) as error:
        raise UnreadableAudio(str(error)) from error
    return samples.mean(axis=1), int(rate)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Mono float32 samples at `target` Hz as qwen-tts resamples them with librosa.resample's default (soxr at
    high quality, cut or zero-padded to ceil(n * target / rate) samples), without librosa's numba functions
    (docs/model-kinds.md)."""
    if rate == target:
        return samples
    import soxr

    length = int(np.ceil(samples.shape[0] * float(target) / rate))
    out = soxr.resample(samples, rate, target, quality="soxr_hq")[:length]
    return np.pad(out, (0, length - out.shape[0])).astype(samples.dtype, copy=False)


class StreamJoiner:
    """Joins chunk waveforms as they arrive, overlapping each seam by a linear crossfade of `crossfade`
    seconds (shortened where either side is shorter). The last samples of the output so far are held back
    until the next chunk's start (or the end) is known."""

    def __init__(self, sample_rate: int, crossfade: float = CROSSFADE_SECONDS):
        self.overlap = int(crossfade * sample_rate)
        self.tail = np.zeros(0, dtype=np.float32)  # output not yet handed out
        self.head = np.zeros(0, dtype=np.float32)  # the start of a chunk waiting for its crossfade
        self.mixing = False
        self.started = False
        self.out: list[np.ndarray] = []

    def add(self, samples: np.ndarray, new_part: bool = False) -> np.ndarray:
        """Take the next samples (`new_part`: the first of a chunk); return those ready to play."""
        samples = samples.astype(np.float32)
        if new_part and self.started:
            if self.mixing:
                self._mix()
            self.mixing = True
        self.started = True
        if self.mixing:
            self.head = np.concatenate([self.head, samples])
            if self.head.size >= self.overlap:
                self._mix()
        else:
            self.tail = np.concatenate([self.tail, samples])
        ready = max(self.tail.size - self.overlap, 0)
        return self._hand_out(ready)

    def finish(self) -> np.ndarray:
        """The samples still held, at the end of the last chunk."""
        if self.mixing:
            self._mix()
        return self._hand_out(self.tail.size)

    def audio(self) -> np.ndarray:
        """Everything handed out so far."""
        return np.concatenate(self.out) if self.out else np.zeros(0, dtype=np.float32)

    def _mix(self) -> None:
        overlap = min(self.overlap, self.tail.size, self.head.size)
        if overlap:
            fade = np.linspace(0.0, 1.0, overlap + 2, dtype=np.float32)[1:-1]
            seam = self.tail[-overlap:] * (1.0 - fade) + self.head[:overlap] * fade
            self.tail = np.concatenate([self.tail[:-overlap], seam, self.head[overlap:]])
        else:
            self.tail = np.concatenate([self.tail, self.head])
        self.head = np.zeros(0, dtype=np.float32)
        self.mixing = False

    def _hand_out(self, count: int) -> np.ndarray:
        ready, self.tail = self.tail[:count], self.tail[count:]
        self.out.append(ready)
        return ready


# Output containers soundfile writes, by file suffix; standard output ("-") always gets a WAV.
AUDIO_FORMATS = {
    ".wav": ("WAV", "PCM_16"),
    ".flac": ("FLAC", "PCM_16"),
    ".ogg": ("OGG", "VORBIS"),
    ".mp3": ("MP3", "MPEG_LAYER_III"),
    ".opus": ("OGG", "OPUS"),  # Ogg Opus, which takes 24 kHz as it is
}


def audio_format(target: str | Path) -> tuple[str, str]:
    """soundfile's (format, subtype) for an output name; ValueError for a suffix rvqtts cannot write."""
    if str(target) == "-":
        return AUDIO_FORMATS[".wav"]
    suffix = Path(target).suffix.lower()
    if suffix not in AUDIO_FORMATS:
        raise ValueError(
            f"{target}: rvqtts writes {', '.join(AUDIO_FORMATS)} files (or - for a WAV on standard "
            f"output), not {suffix or 'a name without a suffix'}"
        )
    return AUDIO_FORMATS[suffix]


def audio_bytes(audio: np.ndarray, sample_rate: int, container: tuple[str, str] = AUDIO_FORMATS[".wav"]) -> bytes:
    """A mono audio file in memory (16-bit PCM WAV unless `container` says otherwise)."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(audio, -1.0, 1.0), sample_rate, format=container[0], subtype=container[1])
    return buffer.getvalue()


STDOUT_FORMATS = ("wav", "raw")  # what `-o -` carries: a 16-bit PCM WAV, or the bare 16-bit little-endian samples
UNKNOWN_SIZE = 0xFFFFFFFF  # the RIFF and data sizes of a WAV stream whose length is not known yet


def pcm16(audio: np.ndarray) -> bytes:
    """Mono samples in [-1, 1] as 16-bit little-endian PCM."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV stream of unknown length: both sizes 0xFFFFFFFF, which
    sox, ffmpeg and common players read as "until the end of the input"."""
    fmt = (16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return struct.pack("<4sI8sIHHIIHH4sI", b"RIFF", UNKNOWN_SIZE, b"WAVEfmt ", *fmt, b"data", UNKNOWN_SIZE)


def _stdout_write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def write_audio(target: str | Path, audio: np.ndarray, sample_rate: int, stdout_format: str = "wav") -> None:
    """Write audio in the format its suffix names (AUDIO_FORMATS) atomically, or to standard output
    for "-" (`stdout_format`: wav or raw)."""
    if str(target) == "-":
        _stdout_write(audio_bytes(audio, sample_rate) if stdout_format == "wav" else pcm16(audio))
    else:
        write_atomically(Path(target), audio_bytes(audio, sample_rate, audio_format(target)))


def write_stream(
    target: str | Path, chunks: Iterable[np.ndarray], sample_rate: int, stdout_format: str = "wav"
) -> None:
    """Write audio chunk by chunk as `chunks` yields them: to standard output for "-" (a WAV of unknown
    length, or raw PCM), flushed after every chunk; else to a file in the format its suffix names, which
    appears complete when the stream ends (and not at all if it fails)."""
    if str(target) == "-":
        if stdout_format == "wav":
            _stdout_write(wav_header(sample_rate))
        for chunk in chunks:
            _stdout_write(pcm16(chunk))
        return
    import soundfile

    container, subtype = audio_format(target)
    with atomic_path(target) as partial:
        with soundfile.SoundFile(partial, "w", sample_rate, 1, subtype, format=container) as sink:
            for chunk in chunks:
                sink.write(np.clip(chunk, -1.0, 1.0))


def write_codes(path: Path, codes: np.ndarray) -> None:
    """Save frame codes [frames, G] as an int64 .npy file, atomically."""
    buffer = io.BytesIO()
    np.save(buffer, codes.astype(np.int64))
    write_atomically(Path(path), buffer.getvalue())
