"""Text to waveform: the Synthesizer a user holds, over qwen-tts's model, prompts and decoder, with both loops run
by rvqtts (docs/architecture.md)."""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from rvqtts.engine.backends.fused import FusedLoop
from rvqtts.engine.loop.runners import Runners
from rvqtts.engine.model.kernels import cpu_model
from rvqtts.engine.model.quantize import check_weights
from rvqtts.engine.model.sampling import FrameSampling
from rvqtts.engine.model.talker import Prompt
from rvqtts.engine.speculative.offsets import predictor_fingerprint, weight_digest
from rvqtts.engine.speculative.speculation import TreePolicy
from rvqtts.qwen.checkpoints import ModelVoices, load_tts
from rvqtts.qwen.cloning import ClonedVoice, ClonedVoices, VoiceSource
from rvqtts.qwen.codec import SpeechCodec, StreamPacing
from rvqtts.qwen.prompt import capture_prompt, qwen_generate
from rvqtts.support.memory import large_blocks_apart, tensors_mib
from rvqtts.synthesis.batch_size import choose_batch_size
from rvqtts.synthesis.loader import EngineChoices, load_model
from rvqtts.synthesis.pipeline import batch_rows, one_line, speak
from rvqtts.synthesis.settings import GenerationSettings, Line, Synthesis
from rvqtts.synthesis.text import MAX_CHUNK_WEIGHT

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
    """A loaded Qwen3-TTS 12 Hz model (CustomVoice, Base or VoiceDesign) and the loops rvqtts runs on its weights
    (rvqtts.engine.loop.runners, kept between utterances); qwen-tts builds the prompts and encodes cloned voices. Its
    engine is fixed when it is made (`speculation=None`: the plain inner loop); `using` makes another over the same
    model."""

    def __init__(
        self,
        tts: object,
        speculation: TreePolicy | None = None,
        weights: str = "native",
        source: str | None = None,
        cuda_graphs: bool = True,
        batch_size: int | None = None,
    ):
        self.tts = tts
        self.model = tts.model
        self.talker = self.model.talker
        self.code_predictor = self.talker.code_predictor
        check_weights(weights, self.talker.codec_head.weight.device)
        self.weights = weights  # "int8": both loops run 8-bit weights (rvqtts.engine.model.quantize)
        self.runners = Runners(self.talker, weights, speculation, cuda_graphs)  # and what the inner loop runs
        self.batch_size = batch_size  # lines `synthesize_many` speaks together (None: measured per batch)
        # Only CustomVoice models have built-in speakers (the others' voices are cloned or described).
        self.voices = ModelVoices(
            self.kind,
            sorted(tts.get_supported_speakers() or []) if self.kind == "custom_voice" else [],
            sorted(tts.get_supported_languages() or []),
        )
        self.codec = SpeechCodec(self.model, source, self.kind)  # `source`: the checkpoint (None: a model handed over)
        self.cloned = ClonedVoices(tts)  # each source encoded (or read) once
        self.sample_rate = self.codec.sample_rate
        # qwen-tts's generation default, in frames (N talker tokens make N - 1 frames).
        self.default_max_frames = int(tts.generate_defaults.get("max_new_tokens", 2048)) - 1

    def using(self, speculation: TreePolicy | None = None, fused: FusedLoop | None = None) -> "Synthesizer":
        """This model with another inner loop: `speculation` (None: the plain loop), or a Core ML package's `fused`
        calls (rvqtts.engine.backends.coreml.coreml_loop). It shares this one's weights, codec, voices and talker
        runner (so the two are not for use at once), and has its own inner loop's runner."""
        other = copy.copy(self)
        runners = self.runners
        other.runners = Runners(self.talker, self.weights, speculation, runners.cuda_graphs, fused, runners.talker())
        return other

    @classmethod
    def load(
        cls,
        model: str | os.PathLike,
        choices: EngineChoices = EngineChoices(),
        on_notice: Callable[[str], None] | None = None,
    ) -> "Synthesizer":
        """The engine `rvqtts synth` runs for `model` (hub id or local folder) with these choices, every `auto`
        decided on this machine (rvqtts.synthesis.loader); `on_notice` hears what the command line would tell its
        user."""
        with large_blocks_apart():  # what measuring and loading free goes back: a first run's peak as a cached run's
            loaded = load_model(model, choices, on_notice)
            synth = cls(
                loaded.tts, loaded.speculation, choices.weights, str(model), choices.cuda_graphs, choices.batch_size
            )
            synth.codec.use_dtype(loaded.decoder_dtype)
            synth.codec.release_unused_encoder()
            synth.runners.warm_up(synth.sampling(GenerationSettings()).predictor)  # a GPU's graphs captured now
        return synth

    @classmethod
    def from_checkpoint(
        cls,
        model: str | os.PathLike,
        device: str = "cpu",
        dtype: str = "float32",
        speculation: TreePolicy | None = None,
        weights: str = "native",
        decoder_dtype: str | None = None,
    ) -> "Synthesizer":
        """A checkpoint loaded the ordinary qwen-tts way in exactly these choices, nothing measured: the speech
        tokenizer in `decoder_dtype` where given (rvqtts.qwen.decoder_dtype), else in `dtype`."""
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
        caches = self.runners.caches_mib()
        caches["cloned_voices"] = tensors_mib(self.cloned.tensors())
        caches["primed_voices"] = tensors_mib(self.codec.primed.tensors())
        return caches

    @property
    def speculation(self) -> TreePolicy | None:
        """The tree policy the inner loop runs (None: the plain loop)."""
        return self.runners.speculation

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

    def sampling(self, settings: GenerationSettings) -> FrameSampling:
        """Both loops' sampling: the settings over the checkpoint's generation_config.json."""
        return settings.resolve(self.tts.generate_defaults)

    def check_voice(
        self, speaker: str | None, language: str, instruct: str | None = None, clone: ClonedVoice | None = None
    ) -> str | None:
        """The speaker to use (None: the default one, on a model with speakers); ValueError saying what to
        give when the voice is not one this model speaks (rvqtts.qwen.checkpoints.ModelVoices.check), or the cloned
        voice was encoded by another model's speaker encoder."""
        speaker = self.voices.check(speaker, language, instruct, cloned=clone is not None)
        self.cloned.check(clone)
        return speaker

    def clone_voice(
        self, ref_audio: str | os.PathLike, ref_text: str | None = None, x_vector_only: bool = False
    ) -> ClonedVoice:
        """A voice cloned from reference audio with qwen-tts's `create_voice_clone_prompt` (ICL mode with
        its transcript, or from the audio alone); VoiceError for unusable audio or arguments, ValueError
        on a model that is not a Base model."""
        return self.voice_of(VoiceSource(Path(ref_audio), ref_text, x_vector_only))

    def voiced(self, line: Line) -> Line:
        """`line` ready to speak: its cloned voice encoded (once per source), its language (None: auto) and its
        speaker (None: the model's default) checked; ValueError saying what to give."""
        clone = self.voice_of(line.clone) if isinstance(line.clone, VoiceSource) else line.clone
        language = line.language or "auto"
        speaker = self.check_voice(line.speaker, language, line.instruct, clone)
        return replace(line, speaker=speaker, language=language, clone=clone)

    def voice_of(self, source: VoiceSource) -> ClonedVoice:
        """The cloned voice a source names, encoded from reference audio or read from a voice file, once
        per source (a batch that repeats a voice encodes it once)."""
        if self.kind != "base":
            self.voices.check(None, "auto", cloned=True)  # refuses: only Base models clone voices
        return self.cloned.of(source)

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
            self.talker, lambda: qwen_generate(self, text, speaker, language, instruct, clone, max_new_tokens=2)
        )

    def identity(self) -> dict:
        """What decides this model's audio for a given request, to key stored audio by (rvqtts read's chunks): digests
        of its weights (its kind, the talker's head, the code predictor), the dtypes and weight format it runs in, and
        rvqtts's version."""
        engine = self.engine_record()
        return {
            "model": {
                "kind": self.kind,
                "talker": weight_digest(self.talker.codec_head.weight)[:16],
                "predictor": predictor_fingerprint(self.code_predictor),
            },
            "engine": {key: engine[key] for key in ("device", "dtype", "decoder_dtype", "weights")},
            "rvqtts": version("rvqtts"),
        }

    def engine_record(self) -> dict:
        """What ran (`--stats-json`'s "engine"): the device, dtypes and weight format, torch and the CPU, and each
        loop's kernels (Runners.kernels_record)."""
        weight = self.talker.codec_head.weight
        return {
            "device": str(weight.device),
            "dtype": str(weight.dtype).removeprefix("torch."),
            "decoder_dtype": self.codec.dtype,
            "weights": self.weights,
            "torch": torch.__version__,
            "cpu": cpu_model() if weight.device.type == "cpu" else None,
            "kernels": self.runners.kernels_record(),
        }

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
        pacing: StreamPacing | None = StreamPacing(),
        on_chunk: Callable[[int, int], None] | None = None,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
        clone: ClonedVoice | None = None,
    ) -> AudioStream:
        """Synthesize one utterance as a stream of audio pieces, decoded incrementally
        (rvqtts.engine.model.speech_decoder) as `pacing` says: the first after one frame, then every 4 frames by
        default (None: each text chunk whole, as `synthesize` makes it). Arguments as for `synthesize`, which makes
        the same codes and, up to float rounding, the same waveform."""
        line = Line(
            text=text,
            speaker=speaker,
            language=language,
            instruct=instruct,
            clone=clone,
            utterance=utterance,
            seed=seed,
            settings=settings,
            stream=pacing,
        )
        return AudioStream(one_line(self, line, chunk_chars, on_chunk, on_frame), self.sample_rate)

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

        Every code is drawn with noise keyed by (seed, utterance, frame, position) (rvqtts.engine.loop.frame_loop),
        so every utterance of a batch is reproducible on its own. `on_chunk(done, total)` reports
        progress after each chunk; `on_frame(prefix, codes)` sees every frame the inner loop decodes
        ([h_t, embedding of c0] and c1..c_{G-1}).
        """
        stream = self.stream(
            text,
            speaker=speaker,
            language=language,
            instruct=instruct,
            clone=clone,
            seed=seed,
            utterance=utterance,
            settings=settings,
            chunk_chars=chunk_chars,
            pacing=None,
            on_chunk=on_chunk,
            on_frame=on_frame,
        )
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
        stream: StreamPacing | None = None,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
    ) -> Iterator[tuple[int, np.ndarray | Synthesis | Exception]]:
        """Synthesize several utterances, up to `batch_size` of them in every call of both loops
        (rvqtts.engine.loop.frame_loop; None: the Synthesizer's `batch_size`, else the size measured best on this
        machine, rvqtts.synthesis.batch_size), each starting as soon as a row is free. Yields (index in `lines`, its
        Synthesis) as each one ends, or (index, the exception) for one that failed (a voice the model
        does not speak, an empty text, NaN or inf in its logits: NonFiniteError), the others going on.
        A line's noise is keyed by its `seed` (else `seed`) and its `utterance` (else its index).

        With `stream`, each line's samples come too as they are made, (index, float32 samples) paced by it, before
        its Synthesis (as `Synthesizer.stream` gives them); `on_frame` sees every frame.

        Each utterance's codes, and so its audio, are those `synthesize` gives it with the same seed and
        settings wherever the kernels keep rows invariant (`rvqtts tune` shows them): its rows get their
        own arithmetic whatever else shares the call. A batch's inner loop runs every row's frame in
        shared calls: plain, a given tree's rounds (B x (N + 1) rows a call), or, where the tree size is chosen
        online, the size measured to pay at these rows (`Runners.batch_speculation`); with `batch_size` 1, one line,
        or a Core ML package, the utterances run one after another through the same loop. A batch whose caches
        would not fit in memory is cut to one that does (rvqtts.synthesis.batch_size.fitting_rows), said through
        `on_notice`."""
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is None:
            batch_size, source = choose_batch_size(self, len(lines), on_notice)
            if on_notice and len(lines) > 1:
                on_notice(f"batch size {batch_size}: {source}")
        if batch_size < 1:
            raise ValueError(f"the batch size must be at least 1, got {batch_size}")
        defaults = Line(seed=seed, settings=settings, stream=stream)
        lines = [line.under(replace(defaults, utterance=index)) for index, line in enumerate(lines)]
        rows = batch_rows(self, lines, chunk_chars, batch_size, on_notice)
        try:
            for index, item in speak(self, lines, chunk_chars, rows, on_frame=on_frame):
                if stream or isinstance(item, (Synthesis, Exception)):
                    yield index, item
        finally:
            if rows > 1:  # a batch's rows are let go (one row's caches and captured graphs are kept)
                self.runners.release_rows()
