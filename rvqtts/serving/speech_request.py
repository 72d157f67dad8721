"""A speech request once checked (rvqtts.serving.request_parsing makes it): what to say and how to send it, and the
audio formats a response may take."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rvqtts.support.audio import AUDIO_FORMATS, audio_bytes, pcm16
from rvqtts.synthesis.settings import Line

RESPONSE_FORMATS = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
}
STREAMED_FORMATS = ("wav", "pcm")  # made as the samples come; the others are whole files


@dataclass(frozen=True)
class SpeechRequest:
    """One request, checked: what to say, in which voice and how to sample it (its line: a one-line run's, utterance
    0, with its own seed and settings, so its audio is `rvqtts synth`'s; streamed, its pacing), and how to send it."""

    line: Line
    response_format: str
    events: bool = False  # streamed as server-sent events (`stream_format: "sse"`), else as the audio itself

    @property
    def stream(self) -> bool:
        return self.line.stream is not None


def encode(audio: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """A whole response: the bytes `rvqtts synth` writes to a file of that suffix, or its raw PCM."""
    if response_format == "pcm":
        return pcm16(audio)
    return audio_bytes(audio, sample_rate, AUDIO_FORMATS[f".{response_format}"])
