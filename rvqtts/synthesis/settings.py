"""What a user asks of a synthesis and what comes back: the sampling settings (over the checkpoint's
generation config and qwen-tts's defaults), one line of a batch, and the record of one utterance."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from rvqtts.engine.model.sampling import FrameSampling, SamplingConfig
from rvqtts.engine.speculative.speculation import LoopStats
from rvqtts.qwen.cloning import ClonedVoice, VoiceSource
from rvqtts.qwen.codec import StreamPacing
from rvqtts.synthesis.text import MAX_CHUNK_WEIGHT

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


@dataclass(frozen=True)
class GenerationSettings:
    """What the user asked for; None means the checkpoint's generation_config.json, as qwen-tts reads it
    (talker and code predictor separately), else qwen-tts's defaults. `temperature`, `top_k` and `top_p`
    set both loops; the `predictor_*` fields set the code predictor's apart. `max_frames` caps every chunk
    (None: as long as its text warrants, within the model's limit)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_frames: int | None = None
    predictor_temperature: float | None = None
    predictor_top_k: int | None = None
    predictor_top_p: float | None = None

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

    def resolve(self, defaults: dict) -> "ResolvedSampling":
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
        return ResolvedSampling(talker, predictor, float(pick("repetition_penalty", self.repetition_penalty)))


@dataclass(frozen=True)
class ResolvedSampling(FrameSampling):
    """The sampling of a run or a line as the frame loop draws it, and as qwen-tts's stock loops are asked for it."""

    def generate_kwargs(self, max_frames: int) -> dict:
        """qwen-tts keywords, for its stock loops. N generated talker tokens make N - 1 frames, hence the + 1."""
        return dict(
            do_sample=self.talker.do_sample,
            temperature=self.talker.temperature,
            top_k=self.talker.top_k,
            top_p=self.talker.top_p,
            repetition_penalty=self.repetition_penalty,
            subtalker_dosample=self.predictor.do_sample,
            subtalker_temperature=self.predictor.temperature,
            subtalker_top_k=self.predictor.top_k,
            subtalker_top_p=self.predictor.top_p,
            max_new_tokens=max_frames + 1,
        )

    def record(self) -> dict:
        """What `--stats-json` shows under "sampling"."""
        return {
            "talker": {**asdict(self.talker), "repetition_penalty": self.repetition_penalty},
            "predictor": asdict(self.predictor),
        }


@dataclass
class Synthesis:
    """One utterance: audio, its frame codes [frames, G], and what the run did and cost."""

    audio: np.ndarray
    sample_rate: int
    codes: np.ndarray
    stats: LoopStats
    seconds: dict[str, float]
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
        wall = self.seconds["wall"]
        return {
            "frames": int(self.codes.shape[0]),
            "audio_seconds": round(audio_seconds, 3),
            "chunks": self.chunks,
            "talker_calls": self.talker_calls,
            "predictor_calls": self.stats.calls,
            "predictor_codes": self.stats.codes,
            "codes_per_call": round(self.stats.codes_per_call, 4),
            "accepted_per_depth": list(self.stats.accepted_per_depth),
            "wall_seconds": round(wall, 3),
            "talker_seconds": round(self.seconds["talker"], 3),
            "predictor_seconds": round(self.seconds["predictor"], 3),
            "decoder_seconds": round(self.seconds["decoder"], 3),
            "prefill_seconds": round(self.seconds["prefill"], 3),
            "first_audio_seconds": round(self.seconds["first_audio"], 3),
            "first_audio_split": self.seconds["first_audio_split"],
            "stream_frames": self.stream and self.stream.frames,
            "first_stream_frames": self.stream and self.stream.first_frames,
            "rtf": round(wall / audio_seconds, 4) if audio_seconds else None,
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


@dataclass(frozen=True)
class Line:
    """One utterance asked for (a batch file's line, a server request, a line of `Synthesizer.synthesize_many`):
    what to say, in which voice, its noise keys and its output. Voice fields left None take the run's (`under`);
    `clone` is a cloned voice's source until the model encodes it (`Synthesizer.voiced`). `seed` and `utterance`
    key its noise (a batch file's line number), so it is spoken the same wherever it runs and whatever shares its
    calls. `settings` samples it (None: the run's); `stream` paces its streamed audio (None: the run's)."""

    text: str
    speaker: str | None = None
    language: str | None = None  # None: the run's, else auto
    instruct: str | None = None
    clone: ClonedVoice | VoiceSource | None = None
    utterance: int | None = None  # None: its index in the batch
    seed: int | None = None  # None: the batch's
    name: str | None = None  # its output file, in a batch
    settings: GenerationSettings | None = None
    stream: StreamPacing | None = None

    def under(self, run: RunSettings) -> Line:
        """This line in the run's voice and seed where it names none of its own."""
        return replace(
            self,
            speaker=self.speaker or run.speaker,
            language=self.language or run.language,
            instruct=self.instruct or run.instruct,
            clone=self.clone or run.clone,
            seed=run.seed if self.seed is None else self.seed,
            settings=self.settings or run.settings,
        )


@dataclass(frozen=True)
class RunSettings:
    """What every line of a run shares (a batch file's lines, or one text): the default voice (a line's own fields
    win, Line.under), the seed, the sampling and the text's chunking."""

    speaker: str | None = None
    language: str = "auto"
    instruct: str | None = None
    seed: int = 0
    settings: GenerationSettings = GenerationSettings()
    clone: VoiceSource | None = None  # a Base model's cloned voice, where the lines name none
    chunk_chars: float | None = MAX_CHUNK_WEIGHT  # None: each text in one pass
