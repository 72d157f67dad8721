"""Text to waveform through qwen-tts, with the code predictor's inner loop replaced by rvqtts's.

qwen-tts owns loading, prompts, speakers, the talker loop and the speech decoder. Inside its talker
loop, every frame calls `talker.code_predictor.generate(...)` for c1..c15; while a synthesis runs,
that call is answered by `InnerLoop.generate`, plain or speculative, with noise keyed by (seed,
utterance, frame, position). The talker's own sampling uses torch's generator, seeded per utterance,
which the inner loop never touches: the same seed gives the same codes, with or without speculation.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch

from rvqtts.compat import qwen_tts
from rvqtts.decode import DecodeStats, Speculation, decode_frame_plain, decode_frame_speculative
from rvqtts.predictor import PredictorRunner
from rvqtts.sampling import SamplingConfig, gumbel_noise

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class InnerLoop:
    """Produces c1..c_{G-1} for each frame the talker asks for, and counts what it did."""

    def __init__(self, code_predictor: torch.nn.Module, speculation: Speculation | None, seed: int):
        self.speculation = speculation
        self.seed = seed
        extra = speculation.tree.nodes + 1 if speculation else 0
        self.runner = PredictorRunner(code_predictor, code_predictor.config.num_code_groups + extra)
        self.offsets = (speculation.offsets.vectors.to(self.runner.device, self.runner.dtype)
                        if speculation else None)
        self.utterance = 0
        self.frame = 0
        self.stats = DecodeStats()
        self.seconds = 0.0

    def start_utterance(self, utterance: int) -> None:
        self.utterance, self.frame = utterance, 0

    def decode(self, prefix: torch.Tensor, sampling: SamplingConfig, utterance: int, frame: int) -> list[int]:
        """The codes c1..c_{G-1} of one frame; `prefix` is [h_t, embedding of c0], shape [2, E]."""
        positions = np.arange(1, self.runner.code_groups)
        noise = torch.from_numpy(gumbel_noise(self.seed, utterance, frame, positions, self.runner.vocab_size))
        noise = noise.to(self.runner.device)
        if self.speculation is None:
            return decode_frame_plain(self.runner, prefix, noise, sampling, self.stats)
        return decode_frame_speculative(self.runner, prefix, noise, sampling, self.speculation, self.offsets,
                                        self.stats)

    def generate(self, inputs_embeds: torch.Tensor, do_sample: bool = True, top_k: int = 50, top_p: float = 1.0,
                 temperature: float = 0.9, **_: object) -> SimpleNamespace:
        """Stands in for the code predictor's HF `generate()` as qwen-tts's talker calls it."""
        started = time.perf_counter()
        sampling = SamplingConfig(temperature=temperature, top_k=top_k or 0, top_p=top_p, do_sample=do_sample)
        rows = [self.decode(inputs_embeds[b], sampling, self.utterance + b, self.frame)
                for b in range(inputs_embeds.shape[0])]
        self.frame += 1
        _synchronize(self.runner.device)
        self.seconds += time.perf_counter() - started
        return SimpleNamespace(sequences=torch.tensor(rows, device=inputs_embeds.device))


@dataclass
class Synthesis:
    """One utterance: audio, its frame codes [frames, G], and what the run cost."""

    audio: np.ndarray
    sample_rate: int
    codes: np.ndarray
    stats: DecodeStats
    seconds: dict[str, float] = field(default_factory=dict)


class Synthesizer:
    """A loaded Qwen3-TTS 12 Hz CustomVoice model whose inner loop rvqtts runs.

    `speculation=None` runs the plain inner loop (one predictor call per code).
    """

    def __init__(self, tts: object, speculation: Speculation | None = None):
        self.tts = tts
        self.model = tts.model
        self.code_predictor = self.model.talker.code_predictor
        self.speculation = speculation

    @classmethod
    def load(cls, model: str | os.PathLike, device: str = "cpu", dtype: str = "float32",
             speculation: Speculation | None = None) -> "Synthesizer":
        """Load a checkpoint (hub id or local folder) the ordinary qwen-tts way."""
        tts = qwen_tts().Qwen3TTSModel.from_pretrained(str(model), device_map=device, dtype=DTYPES[dtype])
        return cls(tts, speculation)

    @property
    def hidden_size(self) -> int:
        return self.code_predictor.config.hidden_size

    @contextmanager
    def _inner_loop(self, loop: InnerLoop, captured: list, seconds: dict) -> Iterator[None]:
        speech_tokenizer = self.model.speech_tokenizer

        def decode(items):
            started = time.perf_counter()
            captured.extend(item["audio_codes"].detach().cpu().numpy() for item in items)
            result = type(speech_tokenizer).decode(speech_tokenizer, items)
            seconds["decoder"] = seconds.get("decoder", 0.0) + time.perf_counter() - started
            return result

        self.code_predictor.generate = loop.generate
        speech_tokenizer.decode = decode
        try:
            yield
        finally:
            del self.code_predictor.generate
            del speech_tokenizer.decode

    def synthesize(self, text: str, speaker: str, language: str = "auto", seed: int = 0, utterance: int = 0,
                   instruct: str | None = None, **sampling: object) -> Synthesis:
        """Synthesize one utterance. `sampling` takes qwen-tts's generate keywords (top_k, subtalker_top_k, ...).

        The noise key is (seed, utterance, frame, position); the talker's generator is seeded from
        (seed, utterance), so each utterance of a batch is reproducible on its own.
        """
        loop = InnerLoop(self.code_predictor, self.speculation, seed)
        loop.start_utterance(utterance)
        captured: list[np.ndarray] = []
        seconds: dict[str, float] = {}
        torch.manual_seed(seed * 1_000_003 + utterance)
        started = time.perf_counter()
        with self._inner_loop(loop, captured, seconds):
            wavs, sample_rate = self.tts.generate_custom_voice(text=text, speaker=speaker, language=language,
                                                               instruct=instruct, **sampling)
        seconds["wall"] = time.perf_counter() - started
        seconds["predictor"] = loop.seconds
        seconds["talker"] = seconds["wall"] - loop.seconds - seconds.get("decoder", 0.0)
        return Synthesis(audio=wavs[0], sample_rate=sample_rate, codes=captured[0].astype(np.int64),
                         stats=loop.stats, seconds=seconds)
