"""Text to waveform: qwen-tts's model, prompts and decoder, with both loops run by rvqtts.

qwen-tts owns loading, prompts, speakers and the speech decoder's weights. rvqtts runs the talker
(rvqtts.engine.talker), the inner loop (rvqtts.engine.inner_loop) and the frame loop joining them
(rvqtts.engine.frame_loop), with every code drawn from keyed noise: the same seed gives the same codes, with or
without speculation. Audio comes offline (qwen-tts's decoder over each text chunk) or streamed
(rvqtts.engine.streaming, a few frames at a time). Long text is spoken chunk by chunk (rvqtts.text) and joined with a
short crossfade (rvqtts.audio).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from rvqtts.audio import StreamJoiner
from rvqtts.batch_size import choose_batch_size, fitting_rows, row_bytes, rows_invariant
from rvqtts.cloning import (
    ClonedVoice,
    VoiceError,
    VoiceSource,
    encode_voice,
    encoder_fingerprint,
    load_voice,
)
from rvqtts.codec import SpeechCodec
from rvqtts.engine.frame_loop import ChunkDone, FrameDone, FrameLoop, Work, WorkFailed
from rvqtts.engine.fused import FusedDecoder
from rvqtts.engine.graphs import StaticCalls
from rvqtts.engine.inner_loop import LoopParts
from rvqtts.engine.kernels import cpu_model, kernels_used
from rvqtts.engine.online import OnlineSpeculation
from rvqtts.engine.policy import tree_nodes
from rvqtts.engine.predictor import PredictorRunner
from rvqtts.engine.quantize import check_weights
from rvqtts.engine.sampling import C0Rules, NonFiniteError
from rvqtts.engine.speculation import DEFAULT_DEPTH, LoopStats, Speculation
from rvqtts.engine.streaming import StreamingDecoder
from rvqtts.engine.talker import TalkerRunner
from rvqtts.loader import EngineChoices, load_engine
from rvqtts.loading import ModelVoices, load_tts
from rvqtts.memory import tensors_mib
from rvqtts.prompt import Prompt, capture_prompt
from rvqtts.settings import GenerationSettings, Line, ResolvedSampling, Synthesis
from rvqtts.text import FRAMES_PER_SECOND, MAX_CHUNK_WEIGHT, chunk_text, frame_budget

STREAM_FRAMES = 4  # frames per streamed audio chunk: 320 ms, the Qwen3-TTS report's packet
PROMPT_TOKENS = 64  # a prompt's tokens besides its text's (roles, codec tags, speaker), generously
INSTRUCT_IGNORED = (
    "warning: this model does not support --instruct (the 0.6B CustomVoice and the Base models take none); ignoring it"
)


class AudioStream:
    """Audio as it is made: iterate for float32 chunks at `sample_rate`; once the iteration ends, `result`
    holds the Synthesis (codes, statistics and the whole waveform)."""

    def __init__(self, run: Generator[np.ndarray, None, Synthesis], sample_rate: int):
        self._run = run
        self.sample_rate = sample_rate
        self.result: Synthesis | None = None

    def __iter__(self) -> Iterator[np.ndarray]:
        self.result = yield from self._run


class Synthesizer:
    """A loaded Qwen3-TTS 12 Hz model (CustomVoice, Base or VoiceDesign) and the loops rvqtts runs on its
    weights: the talker (rvqtts.engine.talker), the inner loop (rvqtts.engine.inner_loop) and the frame loop joining
    them (rvqtts.engine.frame_loop); qwen-tts builds the prompts (and encodes cloned voices) and decodes offline.

    `speculation=None` runs the plain inner loop (one predictor call per code). The runners are kept
    between utterances (a KV cache only grows; fused weights and captured graphs are reused).
    """

    def __init__(
        self, tts: object, speculation: Speculation | None = None, weights: str = "native", source: str | None = None
    ):
        self.tts = tts
        self.model = tts.model
        self.talker = self.model.talker
        self.code_predictor = self.talker.code_predictor
        self.speculation = speculation
        check_weights(weights, self.talker.codec_head.weight.device)
        self.weights = weights  # "int8": both loops run 8-bit weights (rvqtts.engine.quantize)
        self.cuda_graphs = True  # replay the talker's and the inner loop's calls from CUDA graphs on CUDA devices
        self.fused: FusedDecoder | None = None  # set (rvqtts.engine.coreml) to run the inner loop on a Core ML package
        self.batch_size: int | None = None  # lines `synthesize_many` speaks together (None: measured per batch)
        self._parts: LoopParts | None = None
        self._talker: TalkerRunner | None = None
        self._batch_runner: PredictorRunner | None = None
        # Only CustomVoice models have built-in speakers (the others' voices are cloned or described).
        self.voices = ModelVoices(
            self.kind,
            sorted(tts.get_supported_speakers() or []) if self.kind == "custom_voice" else [],
            sorted(tts.get_supported_languages() or []),
        )
        self.source = source  # the checkpoint it was loaded from (None: a model handed over)
        self.codec = SpeechCodec(self.model, source, self.kind)
        self._cloned: dict[VoiceSource, ClonedVoice] = {}  # each source encoded (or read) once
        # Base models: which speaker encoder made a cloned voice (its embedding means nothing to another).
        self.encoder_fingerprint = encoder_fingerprint(self.model) if self.kind == "base" else None
        self.sample_rate = self.codec.sample_rate
        # qwen-tts's generation default, in frames (N talker tokens make N - 1 frames).
        self.default_max_frames = int(tts.generate_defaults.get("max_new_tokens", 2048)) - 1

    @classmethod
    def load(
        cls,
        model: str | os.PathLike,
        choices: EngineChoices = EngineChoices(),
        on_notice: Callable[[str], None] | None = None,
    ) -> "Synthesizer":
        """The engine `rvqtts synth` runs for `model` (hub id or local folder) with these choices, every `auto`
        decided on this machine (rvqtts.loader); `on_notice` hears what the command line would tell its user."""
        return load_engine(model, choices, on_notice)

    @classmethod
    def from_checkpoint(
        cls,
        model: str | os.PathLike,
        device: str = "cpu",
        dtype: str = "float32",
        speculation: Speculation | None = None,
        weights: str = "native",
        decoder_dtype: str | None = None,
    ) -> "Synthesizer":
        """A checkpoint loaded the ordinary qwen-tts way in exactly these choices, nothing measured: the speech
        tokenizer in `decoder_dtype` where given (rvqtts.decoder_dtype), else in `dtype`."""
        check_weights(weights, torch.device(device))
        synth = cls(load_tts(model, device, dtype), speculation, weights, str(model))
        if decoder_dtype is not None:
            synth.codec.use_dtype(decoder_dtype)
        synth.codec.release_unused_encoder()
        return synth

    def cache_mib(self) -> dict[str, float]:
        """MiB held by what is kept between utterances and grows by use (the server's /health reports it): the
        talker's and the inner loop's KV caches, a batch's code predictor cache, the cloned voices, and the speech
        decoder's state after each ICL voice's reference."""
        inner = self._parts.runner if self._parts is not None else None
        runners = {"talker_kv": self._talker, "predictor_kv": inner, "batch_predictor_kv": self._batch_runner}
        caches = {
            name: tensors_mib([getattr(runner, "k_cache", None), getattr(runner, "v_cache", None)])
            for name, runner in runners.items()
        }
        voices = self._cloned.values()
        caches["cloned_voices"] = tensors_mib(t for voice in voices for t in (voice.embedding, voice.codes))
        caches["primed_voices"] = tensors_mib(self.codec.primed.tensors())
        return caches

    @property
    def hidden_size(self) -> int:
        return self.code_predictor.config.hidden_size

    @property
    def speakers(self) -> list[str]:
        return self.voices.speakers

    @property
    def languages(self) -> list[str]:
        return self.voices.languages

    @property
    def kind(self) -> str:
        """custom_voice, base or voice_design (the checkpoint's tts_model_type)."""
        return self.model.tts_model_type

    @property
    def supports_instruct(self) -> bool:
        """VoiceDesign speaks what its instruction describes; qwen-tts drops instructions for the 0.6B
        CustomVoice model, and its voice-clone call takes none."""
        return self.kind == "voice_design" or (self.kind == "custom_voice" and self.model.tts_model_size not in "0b6")

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

    def check_voice(
        self, speaker: str | None, language: str, instruct: str | None = None, clone: ClonedVoice | None = None
    ) -> str | None:
        """The speaker to use (None: the default one, on a model with speakers); ValueError saying what to
        give when the voice is not one this model speaks (rvqtts.loading.ModelVoices.check), or the cloned
        voice was encoded by another model's speaker encoder."""
        speaker = self.voices.check(speaker, language, instruct, cloned=clone is not None)
        if clone is not None and clone.encoder_fingerprint != self.encoder_fingerprint:
            raise VoiceError(
                f"the voice {clone.source or ''} was encoded by another model's speaker encoder "
                f"(fingerprint {clone.encoder_fingerprint}; this model's is {self.encoder_fingerprint}):"
                " encode the reference again with this model"
            )
        return speaker

    def clone_voice(
        self, ref_audio: str | os.PathLike, ref_text: str | None = None, x_vector_only: bool = False
    ) -> ClonedVoice:
        """A voice cloned from reference audio with qwen-tts's `create_voice_clone_prompt` (ICL mode with
        its transcript, or from the audio alone); VoiceError for unusable audio or arguments, ValueError
        on a model that is not a Base model."""
        return self.voice_of(VoiceSource(Path(ref_audio), ref_text, x_vector_only))

    def voice_of(self, source: VoiceSource) -> ClonedVoice:
        """The cloned voice a source names, encoded from reference audio or read from a voice file, once
        per source (a batch that repeats a voice encodes it once)."""
        if source not in self._cloned:
            if self.kind != "base":
                self.voices.check(None, "auto", cloned=True)  # refuses: only Base models clone voices
            if source.voice is not None:
                self._cloned[source] = load_voice(
                    source.voice,
                    self.talker.config.hidden_size,
                    self.encoder_fingerprint,
                    self.talker.config.num_code_groups,
                    self.code_predictor.config.vocab_size,
                )
            else:
                self._cloned[source] = encode_voice(self.tts, source)
        return self._cloned[source]

    def prompt(
        self,
        text: str,
        speaker: str | None,
        language: str = "auto",
        instruct: str | None = None,
        clone: ClonedVoice | None = None,
    ) -> Prompt:
        """The talker's prompt for one piece of text, as qwen-tts's own call for the model's kind builds
        it (`generate_custom_voice`, `generate_voice_design` or `generate_voice_clone`)."""
        return capture_prompt(
            self.talker, lambda: self.generate(text, speaker, language, instruct, clone, max_new_tokens=2)
        )

    def generate(
        self, text: str, speaker: str | None, language: str, instruct: str | None, clone: ClonedVoice | None, **options
    ):
        """qwen-tts's own generation call for this model's kind (the voice checked by the caller): its prompt
        builder (`prompt`), and stock qwen-tts for the benchmarks (rvqtts.bench.stock)."""
        if self.kind == "voice_design":
            return self.tts.generate_voice_design(text=text, instruct=instruct, language=language, **options)
        if self.kind == "base":
            return self.tts.generate_voice_clone(
                text=text, language=language, voice_clone_prompt=[clone.prompt_item(self.talker.device)], **options
            )
        return self.tts.generate_custom_voice(
            text=text,
            speaker=speaker,
            language=language,
            instruct=instruct if self.supports_instruct else None,
            **options,
        )

    def talker_runner(self) -> TalkerRunner:
        """The talker runner, made on first use (CUDA graphs per `cuda_graphs`)."""
        if (
            self._talker is None
            or (self._talker.calls.mode == "cuda") != self._cuda_graphs_on()
            or self._talker.weights != self.weights
        ):
            device = self.talker.codec_head.weight.device
            self._talker = TalkerRunner(
                self.talker, calls=StaticCalls.for_device(device, self.cuda_graphs), weights=self.weights
            )
        return self._talker

    def engine_record(self) -> dict:
        """What ran (`--stats-json`'s "engine"): the device, dtype and weight format, torch and the CPU, the
        kernels of each loop's linear maps (rvqtts.engine.kernels), how much of each runs natively
        (rvqtts.engine.native) and how the predictor attends (rvqtts.engine.attention)."""
        weight = self.talker.codec_head.weight
        kernels = {}
        if self._talker is not None:
            kernels["talker"] = kernels_used(self._talker.layer_maps() + [self._talker.head]) | {
                "native": self._talker.native_mode
            }
        if self._parts is not None and self._parts.runner is not None:
            runner = self._parts.runner
            kernels["predictor"] = kernels_used(runner.linear_maps()) | {
                "attention": "rows" if runner.row_attention else "gathered",
                "native": runner.native_mode,
            }
        return {
            "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."),
            "decoder_dtype": self.codec.dtype,
            "weights": self.weights,
            "torch": torch.__version__,
            "cpu": cpu_model() if weight.device.type == "cpu" else None,
            "kernels": kernels,
        }

    def _cuda_graphs_on(self) -> bool:
        return self.cuda_graphs and self.talker.codec_head.weight.device.type == "cuda"

    def inner_parts(self) -> LoopParts:
        """The inner loop's parts for the current speculation and backend, rebuilt when they change."""
        parts = self._parts
        if self.fused is not None:
            if parts is None or parts.fused is not self.fused or parts.speculation is not self.speculation:
                parts = self._parts = LoopParts.package(self.fused, self.speculation)
        elif (
            parts is None
            or parts.fused is not None
            or parts.speculation is not self.speculation
            or parts.cuda_graphs != self.cuda_graphs
            or parts.weights != self.weights
        ):
            parts = self._parts = LoopParts.build(self.code_predictor, self.speculation, self.cuda_graphs, self.weights)
        return parts

    def frame_loop(self, sampling: ResolvedSampling, rows: int = 1) -> FrameLoop:
        """The frame loop over the kept runners: one utterance's (the inner loop's parts and static calls), or
        `rows` at a time (the batch's runner and speculation, eagerly)."""
        talker = self.talker_runner()
        config = self.talker.config
        rules = C0Rules(config.vocab_size, config.codec_eos_token_id, sampling.repetition_penalty, talker.device)
        parts = self.inner_parts() if rows == 1 else LoopParts.of(self.batch_runner(), self.batch_speculation(rows))
        return FrameLoop(talker, parts, rules, sampling.talker, sampling.predictor, rows)

    def stream(
        self,
        text: str,
        speaker: str | None = None,
        language: str = "auto",
        seed: int = 0,
        utterance: int = 0,
        instruct: str | None = None,
        settings: GenerationSettings = GenerationSettings(),
        chunk_chars: float | None = MAX_CHUNK_WEIGHT,
        frames_per_chunk: int = STREAM_FRAMES,
        on_chunk: Callable[[int, int], None] | None = None,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
        clone: ClonedVoice | None = None,
    ) -> AudioStream:
        """Synthesize one utterance as a stream of audio chunks: every `frames_per_chunk` frames, their
        samples, decoded incrementally (rvqtts.engine.streaming). Arguments as for `synthesize`, which makes the
        same codes and, up to float rounding, the same waveform."""
        if frames_per_chunk < 1:
            raise ValueError(f"frames per stream chunk must be at least 1, got {frames_per_chunk}")
        line = Line(text, speaker, language, instruct, clone, utterance, seed)
        return AudioStream(
            self._one(line, settings, chunk_chars, frames_per_chunk, on_chunk, on_frame), self.sample_rate
        )

    def synthesize(
        self,
        text: str,
        speaker: str | None = None,
        language: str = "auto",
        seed: int = 0,
        utterance: int = 0,
        instruct: str | None = None,
        settings: GenerationSettings = GenerationSettings(),
        chunk_chars: float | None = MAX_CHUNK_WEIGHT,
        on_chunk: Callable[[int, int], None] | None = None,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
        clone: ClonedVoice | None = None,
    ) -> Synthesis:
        """Synthesize one utterance; long text is spoken in sentence chunks of at most `chunk_chars`
        (None: the whole text in one pass, as qwen-tts does) joined by a crossfade. The voice: a CustomVoice
        model's `speaker` (and, on the 1.7B, a style `instruct`), a VoiceDesign model's `instruct`, or a
        Base model's `clone` (`clone_voice`, `voice_of`).

        Every code is drawn with noise keyed by (seed, utterance, frame, position) (rvqtts.engine.frame_loop),
        so every utterance of a batch is reproducible on its own. `on_chunk(done, total)` reports
        progress after each chunk; `on_frame(prefix, codes)` sees every frame the inner loop decodes
        ([h_t, embedding of c0] and c1..c_{G-1}).
        """
        line = Line(text, speaker, language, instruct, clone, utterance, seed)
        stream = AudioStream(self._one(line, settings, chunk_chars, None, on_chunk, on_frame), self.sample_rate)
        for _ in stream:
            pass
        return stream.result

    def synthesize_many(
        self,
        lines: list[Line],
        seed: int = 0,
        settings: GenerationSettings = GenerationSettings(),
        chunk_chars: float | None = MAX_CHUNK_WEIGHT,
        batch_size: int | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> Iterator[tuple[int, Synthesis | Exception]]:
        """Synthesize several utterances, up to `batch_size` of them in every call of both loops
        (rvqtts.engine.frame_loop; None: the Synthesizer's `batch_size`, else the size measured best on this
        machine, rvqtts.batch_size), each starting as soon as a row is free. Yields (index in `lines`, its
        Synthesis) as each one ends, or (index, the exception) for one that failed (a voice the model
        does not speak, an empty text); a model that produced NaN or inf (NonFiniteError) stops it all.
        A line's noise is keyed by its `seed` (else `seed`) and its `utterance` (else its index).

        Each utterance's codes, and so its audio, are those `synthesize` gives it with the same seed and
        settings wherever the kernels keep rows invariant (`rvqtts tune` shows them): its rows get their
        own arithmetic whatever else shares the call. A batch's inner loop runs every row's frame in
        shared calls: plain, a given tree's rounds (B x (N + 1) rows a call), or, where the tree size is chosen
        online, the size measured to pay at these rows (`batch_speculation`); with `batch_size` 1, one line, or a Core
        ML package, the utterances run one after another as `synthesize` runs them. A batch whose caches would not fit
        in memory is cut to one that does (rvqtts.batch_size.fitting_rows), said through `on_notice`."""
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is None:
            batch_size, source = choose_batch_size(self, len(lines), on_notice)
            if on_notice and len(lines) > 1:
                on_notice(f"batch size {batch_size}: {source}")
        if batch_size < 1:
            raise ValueError(f"the batch size must be at least 1, got {batch_size}")
        lines = [
            replace(
                line,
                utterance=index if line.utterance is None else line.utterance,
                seed=seed if line.seed is None else line.seed,
            )
            for index, line in enumerate(lines)
        ]
        rows = min(batch_size, max(len(lines), 1))
        if rows > 1 and self.inner_parts().runner is not None:
            slots = max(self._row_slots(line, settings, chunk_chars) for line in lines)
            fitting = fitting_rows(self, rows, slots)
            if fitting < rows and on_notice:
                on_notice(
                    f"a batch of {rows} rows would hold {rows * row_bytes(self, slots) / 2**30:.1f} GiB of "
                    f"caches, more than half the memory free: speaking {fitting} at a time"
                )
            rows = fitting
            if rows > 1 and on_notice and not rows_invariant(self):
                on_notice(
                    "the kernels here are not known to keep rows invariant: a batched line's audio can "
                    "differ from its one-line run's in the last bits (--batch-size 1 keeps them)"
                )
        if rows <= 1 or self.inner_parts().runner is None:  # a Core ML package's calls carry one frame
            for index, line in enumerate(lines):  # one after another, as `synthesize` speaks each
                try:
                    yield (
                        index,
                        self.synthesize(
                            line.text,
                            speaker=line.speaker,
                            language=line.language,
                            seed=line.seed,
                            utterance=line.utterance,
                            instruct=line.instruct,
                            settings=settings,
                            chunk_chars=chunk_chars,
                            clone=line.clone,
                        ),
                    )
                except NonFiniteError:
                    raise
                except Exception as error:  # this utterance's: the rest go on
                    yield index, error
            return
        try:
            for index, item in self._speak(lines, settings, chunk_chars, rows):
                if isinstance(item, (Synthesis, Exception)):
                    yield index, item
        finally:  # a batch's rows are let go: a later one-line run grows from one row
            for runner in (self.talker_runner(), self.batch_runner()):
                runner.allocate(runner.max_len, 1)

    def _one(
        self,
        line: Line,
        settings: GenerationSettings,
        chunk_chars: float | None,
        stream_frames: int | None,
        on_chunk: Callable[[int, int], None] | None,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None,
    ) -> Generator[np.ndarray, None, Synthesis]:
        """One line's samples as `_speak` makes them ready, then its Synthesis (its failure raised)."""
        for _, item in self._speak([line], settings, chunk_chars, 1, stream_frames, on_chunk, on_frame):
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Synthesis):
                return item
            yield item

    def batch_runner(self) -> PredictorRunner:
        """The code predictor runner of batches (its cache grows by rows, each row with room for a tree
        round): the inner loop's where it runs eagerly; beside it where CUDA graphs read that one's cache
        tensors."""
        parts = self.inner_parts()
        if parts.calls.mode == "eager":
            return parts.runner
        if (
            self._batch_runner is None
            or self._batch_runner.weights != self.weights
            or self._batch_runner.max_len != parts.runner.max_len
        ):
            self._batch_runner = PredictorRunner(self.code_predictor, parts.runner.max_len, self.weights)
        return self._batch_runner

    def batch_speculation(self, rows: int) -> Speculation | OnlineSpeculation | None:
        """What a batch of `rows` lines speculates with: the plain loop or a given tree as for one line; where
        the tree size is chosen online, that choice's own for these rows (`OnlineSpeculation.for_rows`)."""
        online = self.speculation
        return online.for_rows(rows) if isinstance(online, OnlineSpeculation) else online

    def _row_slots(self, line: Line, settings: GenerationSettings, chunk_chars: float | None) -> int:
        """A generous count of the talker positions a line's longest chunk takes: its frame budget, two
        prompt tokens per character and the prompt's own, and an ICL voice's reference codes."""
        pieces = text_pieces(line.text, chunk_chars) or [line.text]
        reference = len(line.clone.codes) if line.clone is not None and line.clone.icl else 0
        return max(self.frame_budget(piece, settings) + 2 * len(piece) for piece in pieces) + PROMPT_TOKENS + reference

    def _speak(
        self,
        lines: list[Line],
        settings: GenerationSettings,
        chunk_chars: float | None,
        rows: int = 1,
        stream_frames: int | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
    ) -> Iterator[tuple[int, np.ndarray | Synthesis | Exception]]:
        """Speak `lines` (each with its seed and utterance set), `rows` at a time (rvqtts.engine.frame_loop), text
        chunk after text chunk. Yields (index in `lines`, item) as it goes: a line's samples ready to play (every
        `stream_frames` frames, decoded incrementally by the streaming decoder, or (None) each text chunk at once,
        `decode`), then its Synthesis; or, for a line whose voice, text or decoding fails, the exception, and no
        more of it (a model that produced NaN or inf, NonFiniteError, stops it all)."""
        sampling = self.sampling(settings)
        loop = self.frame_loop(sampling, rows)
        depth = loop.speculation.offsets.depth if loop.speculation else DEFAULT_DEPTH
        spoken: dict[int, _Spoken] = {}

        def chunks(index: int) -> Iterator[tuple[Prompt, int]]:
            decoder = self.codec.streaming_decoder() if stream_frames else None
            spoken[index] = _Spoken(time.perf_counter(), StreamJoiner(self.sample_rate), decoder)
            return self._prompts(lines[index], spoken[index], settings, chunk_chars)

        works = (
            Work(
                line.seed,
                line.utterance,
                chunks(index),
                tag=index,
                on_frame=on_frame,
                stats=LoopStats(accepted_per_depth=[0] * depth),
            )
            for index, line in enumerate(lines)
        )
        for event in loop.run(works):
            index = event.work.tag
            state = spoken.get(index)
            if state is None:  # failed: the rest of its chunks are not heard
                continue
            try:
                if isinstance(event, WorkFailed):
                    raise event.error
                if isinstance(event, FrameDone):
                    state.pending.append(event.codes)
                    if len(state.pending) == stream_frames:
                        yield index, self._ready_audio(state, event.work, lines[index].clone)
                elif isinstance(event, ChunkDone):
                    if state.pending:
                        yield index, self._ready_audio(state, event.work, lines[index].clone)
                    state.frames.extend(event.frames)
                    state.chunk_start, state.chunks_done = True, state.chunks_done + 1
                    if event.cut:
                        piece = state.pieces[state.chunks_done - 1]
                        state.warnings.append(cut_warning(state.chunks_done, len(state.pieces), event.budget, piece))
                    if on_chunk:
                        on_chunk(state.chunks_done, len(state.pieces))
                else:
                    yield index, state.joiner.finish()
                    yield index, self._synthesis(event.work, spoken.pop(index), sampling, loop, stream_frames)
            except NonFiniteError:
                raise
            except Exception as error:  # this line's: it fails alone
                del spoken[index]
                yield index, error

    def _prompts(
        self, line: Line, state: "_Spoken", settings: GenerationSettings, chunk_chars: float | None
    ) -> Iterator[tuple[Prompt, int]]:
        """The line's prompts, one per text chunk, with their frame budgets (its voice checked when it starts),
        the streaming decoder primed for each."""
        if not line.text.strip():
            raise ValueError("the text is empty: give something to say")
        speaker = self.check_voice(line.speaker, line.language, line.instruct, line.clone)
        state.pieces = text_pieces(line.text, chunk_chars)
        for piece in state.pieces:
            begun = time.perf_counter()
            if state.decoder:
                self.codec.start(state.decoder, line.clone)
                state.seconds["decoder"] += time.perf_counter() - begun  # a new voice's reference: decoded once
            begun = time.perf_counter()
            prompt = self.prompt(piece, speaker, line.language, line.instruct, line.clone)
            state.seconds["prompts"] += time.perf_counter() - begun
            state.seconds.setdefault("prompt", state.seconds["prompts"])  # the first chunk's, before any audio
            yield prompt, self.frame_budget(piece, settings)

    def _ready_audio(self, state: "_Spoken", work: Work, clone: ClonedVoice | None) -> np.ndarray:
        """Decode the line's pending frames, join them to what came before, and time both; the samples ready to
        play."""
        begun = time.perf_counter()
        codes = np.stack(state.pending)
        samples = state.decoder.push(codes) if state.decoder else self.codec.decode(codes, clone)
        ready = state.joiner.add(samples, new_part=state.chunk_start)
        state.pending, state.chunk_start = [], False
        state.seconds["decoder"] += time.perf_counter() - begun
        if ready.size and state.seconds["first_audio"] is None:
            state.seconds["first_audio"] = time.perf_counter() - state.started
            frames_seconds = work.seconds["talker"] + work.seconds["predictor"] - work.seconds["prefill"]
            state.seconds["first_audio_split"] = {
                "prefill": round(state.seconds["prompt"] + work.seconds["prefill"], 3),
                "frames": round(frames_seconds, 3),
                "decoder": round(state.seconds["decoder"], 3),
            }
        return ready

    def _synthesis(
        self, work: Work, state: "_Spoken", sampling: ResolvedSampling, loop: FrameLoop, stream_frames: int | None
    ) -> Synthesis:
        """The Synthesis of a line `_speak` finished. Its loops' seconds are its shares of the calls it was in;
        building its prompts counts as talker work, and the first one in the prefill."""
        seconds = state.seconds
        seconds.update(
            wall=time.perf_counter() - state.started,
            talker=work.seconds["talker"] + seconds["prompts"],
            predictor=work.seconds["predictor"],
            prefill=seconds["prompt"] + work.seconds["prefill"],
        )
        speculation = loop.speculation
        return Synthesis(
            audio=state.joiner.audio(),
            sample_rate=self.sample_rate,
            codes=np.stack(state.frames),
            stats=work.stats,
            seconds=seconds,
            talker_calls=work.talker_calls,
            chunks=len(state.pieces),
            spec=speculation is not None,
            tree_nodes=tree_nodes(speculation),
            seed=work.seed,
            sampling=sampling.record(),
            warnings=state.warnings,
            stream_frames=stream_frames,
            weights=self.weights,
            engine=self.engine_record(),
            batch_rows=loop.rows,
            batch_row_bytes=row_bytes(self, self.talker_runner().max_len) if loop.rows > 1 else None,
            online=speculation.record(work.frames_by_budget) if isinstance(speculation, OnlineSpeculation) else None,
        )


def text_pieces(text: str, chunk_chars: float | None) -> list[str]:
    """The pieces a text is spoken in: sentence chunks of at most `chunk_chars`, or (None) the whole text."""
    return chunk_text(text, chunk_chars) if chunk_chars else [" ".join(text.split())]


def cut_warning(chunk: int, chunks: int, budget: int, piece: str) -> str:
    """The warning of a chunk cut at its frame budget."""
    return (
        f"chunk {chunk} of {chunks} was cut at {budget} frames ({budget / FRAMES_PER_SECOND:.1f} s) for "
        f"{len(piece)} characters: the model did not end its speech (text: {piece[:40]!r})"
    )


@dataclass
class _Spoken:
    """What `Synthesizer._speak` gathers for one line while its chunks are spoken."""

    started: float
    joiner: StreamJoiner
    decoder: StreamingDecoder | None  # streamed: the incremental decoder
    pieces: list[str] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)  # spoken, chunk by chunk
    pending: list[np.ndarray] = field(default_factory=list)  # frames not decoded yet
    chunk_start: bool = True  # the next samples start a text chunk
    warnings: list[str] = field(default_factory=list)
    chunks_done: int = 0
    seconds: dict = field(default_factory=lambda: {"decoder": 0.0, "first_audio": None, "prompts": 0.0})
