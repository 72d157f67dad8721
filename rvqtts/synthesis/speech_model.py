"""What the pipeline and the batch sizing need of a loaded model, as a small typed interface: they take the model
from below through it instead of calling back into the Synthesizer above them (which is one)."""

from __future__ import annotations

from typing import Protocol

import torch

from rvqtts.engine.loop.runners import Runners
from rvqtts.engine.model.sampling import FrameSampling
from rvqtts.engine.model.talker import Prompt
from rvqtts.qwen.cloning import ClonedVoice
from rvqtts.qwen.codec import SpeechCodec
from rvqtts.synthesis.settings import GenerationSettings, Line


class SpeechModel(Protocol):
    """A loaded Qwen3-TTS model as the pipeline speaks with it."""

    runners: Runners  # both loops' runners, kept between utterances
    codec: SpeechCodec
    talker: torch.nn.Module  # qwen-tts's talker module (its config)
    sample_rate: int
    weights: str  # native or int8
    default_max_frames: int  # the model's own frame limit

    def voiced(self, line: Line) -> Line:
        """The line ready to speak: its cloned voice encoded, its voice checked."""

    def prompt(
        self, text: str, speaker: str | None, language: str, instruct: str | None, clone: ClonedVoice | None
    ) -> Prompt:
        """The talker's prompt for one piece of text."""

    def sampling(self, settings: GenerationSettings) -> FrameSampling:
        """Both loops' sampling: the settings over the checkpoint's."""

    def engine_record(self) -> dict:
        """What ran, for the statistics."""
