"""What a user asks of a synthesis and what comes back: the sampling settings (over the checkpoint's
generation config and qwen-tts's defaults), one line of a batch, and the record of one utterance."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from rvqtts.engine.loop.frame_loop import WorkSeconds
from rvqtts.engine.model.sampling import FrameSampling, SamplingConfig
from rvqtts.engine.speculative.speculation import LoopStats
from rvqtts.qwen.cloning import ClonedVoice, VoiceSource
from rvqtts.qwen.codec import StreamPacing
from rvqtts.support.stretch import check_speed

QWEN_TTS_DEFAULTS = dict(
    do_sample=True,
    top_k=50,
    top_p=1.0,
    temperature=0.9,
    repetition_penalty=1.05,
    subtalker_dosample=True,
    subtalker_top_k=50,
    subtalker_top_p=1.0,
    subtalker_temperature=0.9,
)  # qwen-tts's own, for keys a checkpoint does not set
# The repetition penalty divides c0's positive scores by it and multiplies its negative ones: within this range the
# scores stay finite in float32, and beyond it the penalty alone would decide c0.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """What the user asked for; None means the checkpoint's generation_config.json, as qwen-tts reads it
    (talker and code predictor separately), else qwen-tts's defaults. `temperature`, `top_k` and `top_p`
    set both loops; the `predictor_*` fields set the code predictor's apart. `max_frames` caps every chunk
    (None: as long as its text warrants, within the model's limit). `speed` plays the audio that many times faster,
    its pitch kept (rvqtts.support.stretch; None: 1, as the model speaks)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_frames: int | None = None
    predictor_temperature: float | None = None
    predictor_top_k: int | None = None
    predictor_top_p: float | None = None
    speed: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty", "predictor_temperature", "predictor_top_p"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        for prefix in ("", "predictor_"):  # the sampler's checks, with their messages, on whatever was given
            given = {key: getattr(self, prefix + key) for key in ("temperature", "top_k", "top_p")}
            SamplingConfig(**{key: value for key, value in given.items() if value is not None})
        low, high = REPETITION_PENALTY_RANGE
        if self.repetition_penalty is not None and not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition penalty must be between {low} and {high}, got {self.repetition_penalty}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max frames must be at least 1, got {self.max_frames}")
        if self.speed is not None:
            check_speed(self.speed)

    def resolve(self, defaults: dict) -> FrameSampling:
        """The sampling both loops run with: given values first, then `defaults` (the checkpoint's
        generation config), then qwen-tts's own defaults."""

        def pick(key: str, *given):
            """The first value given, else the checkpoint's, else qwen-tts's."""
            stored = defaults.get(key)
            return next((v for v in given if v is not None), QWEN_TTS_DEFAULTS[key] if stored is None else stored)

        talker = SamplingConfig(
            pick("temperature", self.temperature),
            pick("top_k", self.top_k) or 0,
            pick("top_p", self.top_p),
            bool(pick("do_sample")),
        )
        predictor = SamplingConfig(
            pick("subtalker_temperature", self.predictor_temperature, self.temperature),
            pick("subtalker_top_k", self.predictor_top_k, self.top_k) or 0,
            pick("subtalker_top_p", self.predictor_top_p, self.top_p),
            bool(pick("subtalker_dosample")),
        )
        return FrameSampling(talker, predictor, float(pick("repetition_penalty", self.repetition_penalty)))


@dataclass
class LineTimings(WorkSeconds):
    """Where a line's time went, in seconds: the frame loop's shares (talker, predictor, the first prefill), the speech
    decoder's, its prompts' (all chunks', and the first one's, before any audio), its first audio and that wait's
    parts, and its wall time. Once the line ends, `talker` counts its prompts and `prefill` its first prompt."""

    decoder: float = 0.0
    prompts: float = 0.0
    prompt: float | None = None
    first_audio: float | None = None
    first_audio_split: dict[str, float] | None = None  # prefill, frames, decoder (the server adds its queue)
    wall: float = 0.0


@dataclass
class Synthesis:
    """One utterance: audio, its frame codes [frames, G], and what the run did and cost."""

    audio: np.ndarray
    sample_rate: int
    codes: np.ndarray
    stats: LoopStats
    seconds: LineTimings
    talker_calls: int
    chunks: int
    spec: bool
    tree_nodes: int
    seed: int
    sampling: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    stream: StreamPacing | None = None  # streamed: how its pieces came
    weights: str = "native"
    engine: dict = field(default_factory=dict)
    online: dict | None = None  # --tree auto's online choice (rvqtts.engine.speculative.online): what ran and why
    batch_rows: int = 1  # utterances spoken together in each call (synthesize_many)
    batch_row_bytes: int | None = None  # the caches each batch row holds: its talker and code predictor regions

    def record(self) -> dict:
        """The statistics users see (`--stats-json`, the table). rtf = compute seconds / audio seconds."""
        audio_seconds = self.audio.size / self.sample_rate
        seconds = self.seconds
        return {
            "frames": int(self.codes.shape[0]),
            "audio_seconds": round(audio_seconds, 3),
            "chunks": self.chunks,
            "talker_calls": self.talker_calls,
            "predictor_calls": self.stats.calls,
            "predictor_codes": self.stats.codes,
            "codes_per_call": round(self.stats.codes_per_call, 4),
            "accepted_per_depth": list(self.stats.accepted_per_depth),
            "wall_seconds": round(seconds.wall, 3),
            "talker_seconds": round(seconds.talker, 3),
            "predictor_seconds": round(seconds.predictor, 3),
            # the inner loop's time per frame by part, where its calls run eagerly: plain steps, or the tree rounds'
            # prefill, layout, drafts, forward, heads, draws and walk (the frame's share of the calls it was in)
            "inner_loop_ms_by_part": {
                part: round(1e3 * spent / max(self.stats.frames, 1), 3)
                for part, spent in self.stats.seconds_by_part.items()
            },
            "decoder_seconds": round(seconds.decoder, 3),
            "prefill_seconds": round(seconds.prefill, 3),
            "first_audio_seconds": round(seconds.first_audio, 3),
            "first_audio_split": seconds.first_audio_split,
            "stream_frames": self.stream and self.stream.frames,
            "first_stream_frames": self.stream and self.stream.first_frames,
            "rtf": round(seconds.wall / audio_seconds, 4) if audio_seconds else None,
            "spec": self.spec,
            "tree_nodes": self.tree_nodes,
            "weights": self.weights,
            "seed": self.seed,
            "sampling": self.sampling,
            "engine": self.engine,
            "online": self.online,
            "batch_rows": self.batch_rows,
            "batch_row_mib": None if self.batch_row_bytes is None else round(self.batch_row_bytes / 2**20, 2),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, kw_only=True)
class Line:
    """One utterance asked for, wherever it comes from (a batch file's line, a server request, the Python API): what
    to say, in which voice, its noise keys, its sampling and frame limit (`settings`), its output. A run's defaults are
    a Line without text: fields left None take theirs (`under`). `clone` is a cloned voice's source until the model
    encodes it (`Synthesizer.voiced`). `seed` and `utterance` key its noise (a batch file's line number), so it is
    spoken the same wherever it runs and whatever shares its calls."""

    text: str = ""
    speaker: str | None = None
    language: str | None = None  # None: the defaults', else auto
    instruct: str | None = None
    clone: ClonedVoice | VoiceSource | None = None
    utterance: int | None = None  # None: its index in the batch
    seed: int | None = None  # None: the defaults', else 0
    name: str | None = None  # its output file, in a batch
    settings: GenerationSettings | None = None  # its sampling and frame limit (None: the defaults')
    stream: StreamPacing | None = None  # how its streamed audio is paced (None: the defaults')

    def under(self, defaults: Line) -> Line:
        """This line whole: the voice, seed, utterance, sampling and pacing of `defaults` where it names none of its
        own, and past those the library's (language auto, seed 0, utterance 0, the checkpoint's sampling, not
        streamed). Every request is filled here, whoever makes it (rvqtts.synthesis.pipeline.speak takes lines
        whole)."""
        return replace(
            self,
            speaker=self.speaker or defaults.speaker,
            language=self.language or defaults.language or "auto",
            instruct=self.instruct or defaults.instruct,
            clone=self.clone or defaults.clone,
            seed=next((seed for seed in (self.seed, defaults.seed) if seed is not None), 0),
            utterance=next((u for u in (self.utterance, defaults.utterance) if u is not None), 0),
            settings=self.settings or defaults.settings or GenerationSettings(),
            stream=self.stream or defaults.stream,
        )
