"""Text to waveform through qwen-tts, with the code predictor's inner loop replaced by rvqtts's.

qwen-tts owns loading, prompts, speakers, the talker loop and the speech decoder. Inside its talker
loop, every frame calls `talker.code_predictor.generate(...)` for c1..c15; while a synthesis runs,
that call is answered by `InnerLoop.generate`, plain or speculative, with noise keyed by (seed,
utterance, frame, position). The talker's own sampling uses torch's generator, seeded per chunk,
which the inner loop never touches: the same seed gives the same codes, with or without speculation.
Long text is spoken chunk by chunk (rvqtts.text) and joined with a short crossfade (rvqtts.audio).
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Iterator

import numpy as np
import torch

from rvqtts.audio import join_chunks
from rvqtts.decode import (DEFAULT_DEPTH, EAGER, DecodeStats, Speculation, decode_frame_plain,
                           decode_frame_speculative)
from rvqtts.fused import FusedDecoder
from rvqtts.graphs import StaticCalls
from rvqtts.loading import check_voice, load_tts
from rvqtts.offsets import Offsets, load_offsets, predictor_fingerprint, shipped_offsets_for
from rvqtts.predictor import PredictorRunner
from rvqtts.sampling import SamplingConfig, check_finite, gumbel_noise
from rvqtts.text import FRAMES_PER_SECOND, MAX_CHUNK_WEIGHT, chunk_text, frame_budget
from rvqtts.tree import best_budget, platform_key, resolve_tree


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that host clocks measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seed_talker(seed: int, utterance: int, chunk: int) -> None:
    """Seed torch's generator, which the talker samples c0 with, for one chunk of one utterance."""
    torch.manual_seed((seed * 1_000_003 + utterance) * 1_009 + chunk)


@dataclass(frozen=True)
class LoopParts:
    """What an inner loop runs on: the runner (KV cache, fused weights), the offsets on its device, and
    the static calls (CUDA graphs capture these very tensors); or, for Core ML, a fused decoder over a
    package's calls and no runner. Reusable from one utterance to the next, since every frame writes the
    KV slots it reads, as long as the speculation stays the same."""

    speculation: Speculation | None
    cuda_graphs: bool
    runner: PredictorRunner | None
    offsets: torch.Tensor | None
    calls: StaticCalls
    fused: FusedDecoder | None = None

    @classmethod
    def build(cls, code_predictor: torch.nn.Module, speculation: Speculation | None,
              cuda_graphs: bool) -> "LoopParts":
        extra = speculation.tree.nodes + 1 if speculation else 0
        runner = PredictorRunner(code_predictor, code_predictor.config.num_code_groups + extra)
        offsets = speculation.offsets.vectors.to(runner.device, runner.dtype) if speculation else None
        return cls(speculation, cuda_graphs, runner, offsets, StaticCalls.for_device(runner.device, cuda_graphs))

    @classmethod
    def package(cls, decoder: FusedDecoder, speculation: Speculation | None) -> "LoopParts":
        """Parts whose frames run fused calls (a Core ML package's): speculative with a speculation,
        else the plain q = 1 step."""
        return cls(speculation, False, None, None, EAGER, decoder)


class InnerLoop:
    """Produces c1..c_{G-1} for each frame the talker asks for, and counts what it did.

    Frames are numbered from 0 within an utterance, across its chunks, so no two frames share noise.
    """

    def __init__(self, code_predictor: torch.nn.Module, speculation: Speculation | None, seed: int,
                 utterance: int = 0, on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
                 cuda_graphs: bool = True, parts: LoopParts | None = None):
        self.speculation = speculation
        self.on_frame = on_frame
        self.seed = seed
        self.utterance = utterance
        parts = parts or LoopParts.build(code_predictor, speculation, cuda_graphs)
        self.runner, self.offsets, self.calls, self.fused = parts.runner, parts.offsets, parts.calls, parts.fused
        self.code_groups = code_predictor.config.num_code_groups
        self.vocab_size = code_predictor.config.vocab_size
        self.device = self.fused.device if self.fused else self.runner.device
        self.frame = 0
        # One entry per draft depth K, also when nothing is accepted (or nothing is drafted: --no-spec).
        self.stats = DecodeStats(accepted_per_depth=[0] * (speculation.offsets.depth if speculation
                                                           else DEFAULT_DEPTH))
        self.seconds = 0.0

    def decode(self, prefix: torch.Tensor, sampling: SamplingConfig, utterance: int, frame: int) -> list[int]:
        """The codes c1..c_{G-1} of one frame; `prefix` is [h_t, embedding of c0], shape [2, E]."""
        positions = np.arange(1, self.code_groups)
        noise = torch.from_numpy(gumbel_noise(self.seed, utterance, frame, positions, self.vocab_size))
        noise = noise.to(self.device)
        if self.fused is not None:
            if sampling != self.fused.sampling:
                raise ValueError(f"the Core ML package samples with {self.fused.sampling}, but this frame asks "
                                 f"for {sampling}: export a package for these settings")
            decode = self.fused.decode if self.speculation else self.fused.decode_plain
            codes = decode(prefix, noise, self.stats)
        elif self.speculation is None:
            codes = decode_frame_plain(self.runner, prefix, noise, sampling, self.stats, self.calls)
        else:
            codes = decode_frame_speculative(self.runner, prefix, noise, sampling, self.speculation, self.offsets,
                                             self.stats, self.calls)
        if self.on_frame:
            self.on_frame(prefix, codes)
        return codes

    def generate(self, inputs_embeds: torch.Tensor, do_sample: bool = True, top_k: int = 50, top_p: float = 1.0,
                 temperature: float = 0.9, **_: object) -> SimpleNamespace:
        """Stands in for the code predictor's HF `generate()` as qwen-tts's talker calls it."""
        started = time.perf_counter()
        sampling = SamplingConfig(temperature=temperature, top_k=top_k or 0, top_p=top_p, do_sample=do_sample)
        rows = [self.decode(inputs_embeds[b], sampling, self.utterance + b, self.frame)
                for b in range(inputs_embeds.shape[0])]
        self.frame += 1
        synchronize(self.device)
        self.seconds += time.perf_counter() - started
        return SimpleNamespace(sequences=torch.tensor(rows, device=inputs_embeds.device))


QWEN_TTS_DEFAULTS = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                         subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0,
                         subtalker_temperature=0.9)  # qwen-tts's own, for keys a checkpoint does not set


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
        # The same checks as the sampler's, with their messages, on whatever was given.
        for temperature, top_k, top_p in ((self.temperature, self.top_k, self.top_p),
                                          (self.predictor_temperature, self.predictor_top_k, self.predictor_top_p)):
            SamplingConfig(0.9 if temperature is None else temperature, 50 if top_k is None else top_k,
                           1.0 if top_p is None else top_p)
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty must be positive, got {self.repetition_penalty}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max frames must be at least 1, got {self.max_frames}")

    def resolve(self, defaults: dict) -> "ResolvedSampling":
        """The sampling both loops run with: given values first, then `defaults` (the checkpoint's
        generation config), then qwen-tts's own defaults."""

        def pick(key: str, *given):
            """The first value given, else the checkpoint's, else qwen-tts's."""
            stored = defaults.get(key)
            return next((v for v in given if v is not None), QWEN_TTS_DEFAULTS[key] if stored is None else stored)

        talker = SamplingConfig(pick("temperature", self.temperature), pick("top_k", self.top_k) or 0,
                                pick("top_p", self.top_p), bool(pick("do_sample")))
        predictor = SamplingConfig(pick("subtalker_temperature", self.predictor_temperature, self.temperature),
                                   pick("subtalker_top_k", self.predictor_top_k, self.top_k) or 0,
                                   pick("subtalker_top_p", self.predictor_top_p, self.top_p),
                                   bool(pick("subtalker_dosample")))
        return ResolvedSampling(talker, predictor, float(pick("repetition_penalty", self.repetition_penalty)))


@dataclass(frozen=True)
class ResolvedSampling:
    """The sampling of one run: the talker's (c0, with its repetition penalty) and the code predictor's."""

    talker: SamplingConfig
    predictor: SamplingConfig
    repetition_penalty: float

    def generate_kwargs(self, max_frames: int) -> dict:
        """qwen-tts keywords. N generated talker tokens make N - 1 frames, hence the + 1."""
        return dict(do_sample=self.talker.do_sample, temperature=self.talker.temperature,
                    top_k=self.talker.top_k, top_p=self.talker.top_p, repetition_penalty=self.repetition_penalty,
                    subtalker_dosample=self.predictor.do_sample, subtalker_temperature=self.predictor.temperature,
                    subtalker_top_k=self.predictor.top_k, subtalker_top_p=self.predictor.top_p,
                    max_new_tokens=max_frames + 1)

    def record(self) -> dict:
        """What `--stats-json` shows under "sampling"."""
        def loop(config: SamplingConfig) -> dict:
            return dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                        do_sample=config.do_sample)

        return {"talker": {**loop(self.talker), "repetition_penalty": self.repetition_penalty},
                "predictor": loop(self.predictor)}


@dataclass
class Synthesis:
    """One utterance: audio, its frame codes [frames, G], and what the run did and cost."""

    audio: np.ndarray
    sample_rate: int
    codes: np.ndarray
    stats: DecodeStats
    seconds: dict[str, float]
    talker_calls: int
    chunks: int
    spec: bool
    tree_nodes: int
    seed: int
    sampling: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def record(self) -> dict:
        """The statistics users see (`--stats-json`, the table). rtf = compute seconds / audio seconds."""
        audio_seconds = self.audio.size / self.sample_rate
        wall = self.seconds["wall"]
        return {
            "frames": int(self.codes.shape[0]), "audio_seconds": round(audio_seconds, 3), "chunks": self.chunks,
            "talker_calls": self.talker_calls, "predictor_calls": self.stats.calls,
            "predictor_codes": self.stats.codes, "codes_per_call": round(self.stats.codes_per_call, 4),
            "accepted_per_depth": list(self.stats.accepted_per_depth), "wall_seconds": round(wall, 3),
            "talker_seconds": round(self.seconds["talker"], 3),
            "predictor_seconds": round(self.seconds["predictor"], 3),
            "decoder_seconds": round(self.seconds["decoder"], 3),
            "rtf": round(wall / audio_seconds, 4) if audio_seconds else None,
            "spec": self.spec, "tree_nodes": self.tree_nodes, "seed": self.seed, "sampling": self.sampling,
            "warnings": list(self.warnings),
        }


class Synthesizer:
    """A loaded Qwen3-TTS 12 Hz CustomVoice model whose inner loop rvqtts runs.

    `speculation=None` runs the plain inner loop (one predictor call per code).
    """

    def __init__(self, tts: object, speculation: Speculation | None = None):
        self.tts = tts
        self.model = tts.model
        self.talker = self.model.talker
        self.code_predictor = self.talker.code_predictor
        self.speculation = speculation
        self.cuda_graphs = True  # replay the inner loop's calls from CUDA graphs on CUDA devices
        self.fused: FusedDecoder | None = None  # set (rvqtts.coreml) to run the inner loop on a Core ML package
        self._parts: LoopParts | None = None  # kept between utterances: no re-fusing, no re-capture
        self.speakers = sorted(tts.get_supported_speakers() or [])
        self.languages = sorted(tts.get_supported_languages() or [])
        # qwen-tts's generation default, in frames (N talker tokens make N - 1 frames).
        self.default_max_frames = int(tts.generate_defaults.get("max_new_tokens", 2048)) - 1

    @classmethod
    def load(cls, model: str | os.PathLike, device: str = "cpu", dtype: str = "float32",
             speculation: Speculation | None = None) -> "Synthesizer":
        """Load a checkpoint (hub id or local folder) the ordinary qwen-tts way."""
        return cls(load_tts(model, device, dtype), speculation)

    @property
    def hidden_size(self) -> int:
        return self.code_predictor.config.hidden_size

    @property
    def supports_instruct(self) -> bool:
        """qwen-tts drops instructions for the 0.6B CustomVoice model."""
        return self.model.tts_model_size not in "0b6"

    def frame_budget(self, text: str, settings: GenerationSettings) -> int:
        """Most frames one piece of text may take: the settings' limit when given (it may exceed the text's
        warrant), else as many as its length warrants (a model that never ends its speech is cut there)
        within the model's own limit."""
        if settings.max_frames is not None:
            return settings.max_frames
        return min(self.default_max_frames, frame_budget(text))

    def sampling(self, settings: GenerationSettings) -> ResolvedSampling:
        """Both loops' sampling: the settings over the checkpoint's generation_config.json."""
        return settings.resolve(self.tts.generate_defaults)

    def check_voice(self, speaker: str, language: str) -> None:
        """Raise ValueError naming the valid choices when the speaker or language is not the model's."""
        check_voice(self.speakers, self.languages, speaker, language)

    @contextmanager
    def _hooks(self, loop: InnerLoop, captured: list, seconds: dict, counts: dict,
               forced_c0: list[int] | None = None) -> Iterator[None]:
        """Route qwen-tts's inner-loop calls to `loop`; record the codes the speech decoder gets, time it,
        and count the talker's forward calls. With `forced_c0`, the talker's n-th call may only emit
        forced_c0[n] (then end of speech): its logits become -inf elsewhere (teacher forcing)."""
        speech_tokenizer = self.model.speech_tokenizer
        talker_forward = self.talker.forward

        def decode(items):
            started = time.perf_counter()
            captured.extend(item["audio_codes"].detach().cpu().numpy() for item in items)
            result = type(speech_tokenizer).decode(speech_tokenizer, items)
            seconds["decoder"] += time.perf_counter() - started
            return result

        @functools.wraps(talker_forward)  # HF's generate() checks its keywords against this signature
        def forward(*args, **kwargs):
            counts["talker"] += 1
            output = talker_forward(*args, **kwargs)
            check_finite(output.logits[:, -1], "talker")
            if forced_c0 is not None:
                step = counts["talker"] - 1
                code = forced_c0[step] if step < len(forced_c0) else self.talker.config.codec_eos_token_id
                forced = torch.full_like(output.logits[:, -1], float("-inf"))
                forced[:, code] = 0.0
                output.logits[:, -1] = forced
            return output

        self.code_predictor.generate = loop.generate
        speech_tokenizer.decode = decode
        self.talker.forward = forward
        try:
            yield
        finally:
            del self.code_predictor.generate, speech_tokenizer.decode, self.talker.forward

    def synthesize(self, text: str, speaker: str, language: str = "auto", seed: int = 0, utterance: int = 0,
                   instruct: str | None = None, settings: GenerationSettings = GenerationSettings(),
                   chunk_chars: float | None = MAX_CHUNK_WEIGHT, on_chunk: Callable[[int, int], None] | None = None,
                   on_frame: Callable[[torch.Tensor, list[int]], None] | None = None) -> Synthesis:
        """Synthesize one utterance; long text is spoken in sentence chunks of at most `chunk_chars`
        (None: the whole text in one pass, as qwen-tts does) joined by a crossfade.

        The noise key is (seed, utterance, frame, position) and the talker's generator is seeded from
        (seed, utterance, chunk), so every utterance of a batch is reproducible on its own.
        `on_chunk(done, total)` reports progress after each chunk; `on_frame(prefix, codes)` sees every
        frame the inner loop decodes ([h_t, embedding of c0] and c1..c_{G-1}).
        """
        if not text.strip():
            raise ValueError("the text is empty: give something to say")
        self.check_voice(speaker, language)
        pieces = chunk_text(text, chunk_chars) if chunk_chars else [" ".join(text.split())]
        sampling = self.sampling(settings)
        parts = self._parts
        if self.fused is not None:
            if parts is None or parts.fused is not self.fused or parts.speculation is not self.speculation:
                parts = self._parts = LoopParts.package(self.fused, self.speculation)
        elif (parts is None or parts.fused is not None or parts.speculation is not self.speculation
              or parts.cuda_graphs != self.cuda_graphs):
            parts = self._parts = LoopParts.build(self.code_predictor, self.speculation, self.cuda_graphs)
        loop = InnerLoop(self.code_predictor, self.speculation, seed, utterance, on_frame, self.cuda_graphs, parts)
        captured: list[np.ndarray] = []
        seconds = {"decoder": 0.0}
        counts = {"talker": 0}
        audio: list[np.ndarray] = []
        warnings: list[str] = []
        started = time.perf_counter()
        with self._hooks(loop, captured, seconds, counts):
            for index, piece in enumerate(pieces):
                budget = self.frame_budget(piece, settings)
                seed_talker(seed, utterance, index)
                wavs, sample_rate = self.tts.generate_custom_voice(
                    text=piece, speaker=speaker, language=language,
                    instruct=instruct if self.supports_instruct else None, **sampling.generate_kwargs(budget))
                audio.append(wavs[0])
                if captured[-1].shape[0] >= budget:
                    warnings.append(f"chunk {index + 1} of {len(pieces)} was cut at {budget} frames "
                                    f"({budget / FRAMES_PER_SECOND:.1f} s) for {len(piece)} characters: the model did not end "
                                    f"its speech (text: {piece[:40]!r})")
                if on_chunk:
                    on_chunk(index + 1, len(pieces))
        seconds["wall"] = time.perf_counter() - started
        seconds["predictor"] = loop.seconds
        seconds["talker"] = seconds["wall"] - loop.seconds - seconds["decoder"]
        return Synthesis(audio=join_chunks(audio, sample_rate), sample_rate=sample_rate,
                         codes=np.concatenate(captured).astype(np.int64), stats=loop.stats, seconds=seconds,
                         talker_calls=counts["talker"], chunks=len(pieces), spec=self.speculation is not None,
                         tree_nodes=self.speculation.tree.nodes if self.speculation else 0, seed=seed,
                         sampling=sampling.record(), warnings=warnings)


    def synthesize_stock(self, text: str, speaker: str, language: str = "auto", seed: int = 0,
                         settings: GenerationSettings = GenerationSettings()) -> dict:
        """Stock qwen-tts on the same text and talker seed: its own HF loops for talker and code predictor,
        timed but untouched (the code predictor's `generate()` and the speech decoder are wrapped only to
        clock them). Returns the timing fields of `Synthesis.record()`."""
        self.check_voice(speaker, language)
        predictor_generate, speech_tokenizer = self.code_predictor.generate, self.model.speech_tokenizer
        seconds = {"predictor": 0.0, "decoder": 0.0}
        frames: list[int] = []

        def clocked(name: str, call: Callable) -> Callable:
            def run(*args, **kwargs):
                started = time.perf_counter()
                result = call(*args, **kwargs)
                seconds[name] += time.perf_counter() - started
                return result
            return run

        def decode(items):
            frames.extend(item["audio_codes"].shape[0] for item in items)
            return type(speech_tokenizer).decode(speech_tokenizer, items)

        self.code_predictor.generate = clocked("predictor", predictor_generate)
        speech_tokenizer.decode = clocked("decoder", decode)
        started = time.perf_counter()
        try:
            seed_talker(seed, 0, 0)
            budget = self.frame_budget(text, settings)
            wavs, sample_rate = self.tts.generate_custom_voice(
                text=" ".join(text.split()), speaker=speaker, language=language,
                **self.sampling(settings).generate_kwargs(budget))
        finally:
            del self.code_predictor.generate, speech_tokenizer.decode
        wall = time.perf_counter() - started
        audio_seconds = wavs[0].size / sample_rate
        return {"frames": sum(frames), "audio_seconds": round(audio_seconds, 3), "wall_seconds": round(wall, 3),
                "talker_seconds": round(wall - seconds["predictor"] - seconds["decoder"], 3),
                "predictor_seconds": round(seconds["predictor"], 3), "decoder_seconds": round(seconds["decoder"], 3),
                "rtf": round(wall / audio_seconds, 4) if audio_seconds else None}

    def force(self, text: str, speaker: str, language: str, codes: np.ndarray,
              on_frame: Callable[[torch.Tensor, list[int]], None]) -> None:
        """Teacher forcing: run the talker over `text` while it emits exactly these frame codes [frames, G]
        (c0 forced through its logits, c1.. returned by the inner loop), and show `on_frame` each frame's
        predictor prefix [h_t, embedding of c0] with the frame's codes c1.. ."""
        self.check_voice(speaker, language)
        loop = ForcedLoop(self.code_predictor, codes, on_frame)
        captured: list[np.ndarray] = []
        with self._hooks(loop, captured, {"decoder": 0.0}, {"talker": 0}, forced_c0=codes[:, 0].tolist()):
            self.tts.generate_custom_voice(text=" ".join(text.split()), speaker=speaker, language=language,
                                           **self.sampling(GenerationSettings()).generate_kwargs(len(codes)))
        if loop.frame != len(codes):
            raise RuntimeError(f"teacher forcing stopped after {loop.frame} of {len(codes)} frames")


class ForcedLoop(InnerLoop):
    """An inner loop that returns recorded codes instead of sampling them (teacher forcing)."""

    def __init__(self, code_predictor: torch.nn.Module, codes: np.ndarray,
                 on_frame: Callable[[torch.Tensor, list[int]], None]):
        super().__init__(code_predictor, None, 0, on_frame=on_frame)
        self.codes = codes

    def decode(self, prefix: torch.Tensor, sampling: SamplingConfig, utterance: int, frame: int) -> list[int]:
        codes = [int(c) for c in self.codes[frame, 1:]]
        self.on_frame(prefix, codes)
        return codes


def choose_speculation(code_predictor: torch.nn.Module, tree: str | os.PathLike = "auto",
                       offsets: str | os.PathLike | None = None, allow_plain: bool = False,
                       device_type: str | None = None) -> tuple[Speculation | None, str | None]:
    """The tree and offsets to draft with, and a notice for the user (or None).

    `tree` is a node budget N (a shipped tree, preferring one calibrated for this model), `auto` (the best
    N measured for this model on this platform: the kind of device, by default the model's (cpu, cuda,
    mps) or `device_type` (coreml), and the dtype) or a file. With `allow_plain`, `auto` returns no
    speculation (None) where speculation was measured not to pay (best N = 0), or was not measured on a
    CPU. Without an offsets file, shipped offsets whose fingerprint matches the model are used, else
    zero offsets (reused heads). Raises TreeFileError / OffsetsFileError / ValueError with their messages.
    """
    fingerprint = predictor_fingerprint(code_predictor)
    hidden = code_predictor.config.hidden_size
    weight = code_predictor.lm_head[0].weight
    platform = platform_key(device_type, "float16") if device_type == "coreml" else platform_key(
        weight.device.type, weight.dtype)
    if allow_plain and str(tree) == "auto":
        budget, source = best_budget(platform, fingerprint)
        if budget == 0:
            return None, (f"plain inner loop: no tree was measured to pay for this model on {platform} ({source});"
                          f" --tree N forces speculation")
    chosen = resolve_tree(tree, fingerprint, platform)
    notice = None
    if offsets is not None:
        drafts = load_offsets(offsets, hidden_size=hidden, fingerprint=fingerprint)
    else:
        drafts = shipped_offsets_for(fingerprint, hidden)
        if drafts is None:
            drafts = Offsets.zeros(max(DEFAULT_DEPTH, chosen.depth), hidden)
            notice = "no shipped offsets match this model: drafting with zero offsets (reused heads)"
    try:
        return Speculation(chosen, drafts), notice
    except ValueError as error:
        raise ValueError(f"tree {tree} with offsets {offsets}: {error}") from error
