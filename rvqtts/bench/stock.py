"""Stock qwen-tts timed as `rvqtts bench e2e` compares it: its own loops and decoder, untouched, split into talker,
code predictor and decoder time by forward hooks, each clock read after the device's work is done."""

from __future__ import annotations

import time
from typing import Callable

import torch

from rvqtts.engine.model.devices import synchronize
from rvqtts.qwen.cloning import ClonedVoice
from rvqtts.qwen.prompt import qwen_generate
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.text import FRAMES_PER_SECOND, frame_limit


def stock_synthesis(
    synth,
    text: str,
    speaker: str | None,
    language: str = "auto",
    seed: int = 0,
    settings: GenerationSettings = GenerationSettings(),
    instruct: str | None = None,
    clone: ClonedVoice | None = None,
) -> dict:
    """Stock qwen-tts on `synth`'s model and the same text, untouched: its own HF loops for talker and code
    predictor, sampling with torch's generator (seeded with `seed`), then its decoder. Timed through forward
    hooks: the talker's calls minus their transformer are the code predictor (which qwen-tts runs
    inside the talker's forward), and what follows the last talker call is the decoder. Returns the
    timing fields of `Synthesis.record()`."""
    speaker = synth.check_voice(speaker, language, instruct, clone)
    device = synth.talker.codec_head.weight.device
    clock = {"calls": 0.0, "transformer": 0.0, "last": 0.0}
    handles = _timing_hooks(synth.talker, device, clock)
    limit = frame_limit(text, settings.max_frames, synth.default_max_frames)
    torch.manual_seed(seed)
    started = _device_now(device)
    try:
        spoken = (" ".join(text.split()), speaker, language, instruct, clone)
        wavs, sample_rate = qwen_generate(synth, *spoken, **synth.sampling(settings).generate_kwargs(limit))
    finally:
        for handle in handles:
            handle.remove()
    ended = _device_now(device)
    predictor, decoder = clock["calls"] - clock["transformer"], ended - clock["last"]
    return _stock_record(ended - started, predictor, decoder, wavs[0].size / sample_rate)


def _device_now(device: torch.device) -> float:
    """The clock, read once the device's work is done: a GPU's calls are queued, and a clock read before they
    finish would time their launch."""
    synchronize(device)
    return time.perf_counter()


def _timing_hooks(talker: torch.nn.Module, device: torch.device, clock: dict[str, float]) -> list:
    """Forward hooks on the talker and its transformer adding the seconds inside each (`calls`, `transformer`)
    to `clock`, with the time the last of them ended (`last`); returns their handles, to remove."""
    opened: dict[str, float] = {}

    def enter(name: str) -> Callable:
        return lambda *_: opened.__setitem__(name, _device_now(device))

    def leave(name: str) -> Callable:
        def hook(*_: object) -> None:
            read = _device_now(device)
            clock[name] += read - opened[name]
            clock["last"] = read

        return hook

    return [
        talker.register_forward_pre_hook(enter("calls")),
        talker.register_forward_hook(leave("calls")),
        talker.model.register_forward_pre_hook(enter("transformer")),
        talker.model.register_forward_hook(leave("transformer")),
    ]


def _stock_record(wall: float, predictor: float, decoder: float, audio_seconds: float) -> dict:
    """The timing fields of `Synthesis.record()` from a stock run's seconds: the talker's are what the code
    predictor and decoder leave of the wall time, and the whole audio comes at once (its first audio: the wall)."""
    return {
        "frames": round(audio_seconds * FRAMES_PER_SECOND),
        "audio_seconds": round(audio_seconds, 3),
        "wall_seconds": round(wall, 3),
        "talker_seconds": round(wall - predictor - decoder, 3),
        "predictor_seconds": round(predictor, 3),
        "decoder_seconds": round(decoder, 3),
        "first_audio_seconds": round(wall, 3),
        "rtf": round(wall / audio_seconds, 4) if audio_seconds else None,
    }
