"""The speech codec: qwen-tts's 12 Hz speech tokenizer as rvqtts runs it. Its decoder turns frame codes into
samples, in pieces or incrementally (rvqtts.engine.model.speech_decoder), in a dtype of its own
(rvqtts.qwen.decoder_dtype), a cloned ICL voice's reference decoded once per voice (rvqtts.qwen.cloning.PrimedVoices);
its encoder turns audio into codes, and is let go where only a Base model's cloning would run it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rvqtts.engine.model.speech_decoder import StreamingDecoder
from rvqtts.qwen.checkpoints import DTYPES, load_speech_tokenizer
from rvqtts.qwen.cloning import ClonedVoice, PrimedVoices


@dataclass(frozen=True)
class StreamPacing:
    """How a streamed line's audio comes: its first piece after `first_frames` frames (one: first audio after the
    prompt's prefill, one frame and one decoder step), then a piece every `frames` frames (4: 320 ms, the Qwen3-TTS
    report's packet)."""

    first_frames: int = 1
    frames: int = 4

    def __post_init__(self) -> None:
        if self.first_frames < 1 or self.frames < 1:
            raise ValueError(
                f"a streamed piece needs at least one frame, got first {self.first_frames} and then {self.frames}"
            )

    def due(self, started: bool) -> int:
        """The frames the next piece waits for: the first's until audio has come out, then the rest's."""
        return self.frames if started else self.first_frames


class SpeechCodec:
    """The speech tokenizer of a loaded qwen-tts model (`model.speech_tokenizer`), loaded from `source` (a
    checkpoint, None where unknown) and used by a model of `kind` (only a Base model encodes audio to speak)."""

    def __init__(self, model: object, source: str | None, kind: str):
        self.model = model
        self.source = source
        self.kind = kind
        self.primed = PrimedVoices()  # the streaming decoder after each ICL voice's reference
        self._encoding: object | None = None  # a speech tokenizer with its encoder, where the model's was released
        self.sample_rate = int(model.speech_tokenizer.model.get_output_sample_rate())

    @property
    def device(self) -> str:
        return str(self.model.talker.codec_head.weight.device)

    @property
    def dtype(self) -> str:
        """The dtype the speech tokenizer (its decoder, and the encoder cloning uses) runs in."""
        return str(self.model.speech_tokenizer.model.dtype).removeprefix("torch.")

    def use_dtype(self, dtype: str) -> None:
        """Run the speech tokenizer in `dtype`, apart from the loops' (rvqtts.qwen.decoder_dtype): loaded again from the
        checkpoint's stored weights in that dtype; voices primed by the old one are primed again."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown decoder dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        if dtype == self.dtype:
            return
        if self.source is None:
            raise ValueError("the speech decoder's dtype is set on a Synthesizer loaded from a checkpoint")
        self.model.load_speech_tokenizer(load_speech_tokenizer(self.source, self.device, dtype))
        self.primed = PrimedVoices()
        self.release_unused_encoder()

    def release_unused_encoder(self) -> None:
        """Let go of the encoder where only a Base model's cloning would run it (a 112 MB copy in bfloat16 at 0.6B:
        docs/usage.md); `encoding_tokenizer` loads it again from the checkpoint, so a codec without one keeps it."""
        tokenizer = self.model.speech_tokenizer.model
        if self.kind != "base" and self.source is not None and getattr(tokenizer, "encoder", None) is not None:
            tokenizer.encoder = None

    def encoding_tokenizer(self) -> object:
        """A speech tokenizer that can encode audio: the model's, or (its encoder released) one loaded again."""
        if getattr(self.model.speech_tokenizer.model, "encoder", None) is not None:
            return self.model.speech_tokenizer
        if self._encoding is None:
            self._encoding = load_speech_tokenizer(self.source, self.device, self.dtype)
        return self._encoding

    def streaming_decoder(self) -> StreamingDecoder:
        """An incremental decoder over the model's (rvqtts.engine.model.speech_decoder); `start` it for each text
        chunk."""
        return StreamingDecoder(self.model.speech_tokenizer.model.decoder)

    def start(self, decoder: StreamingDecoder, clone: ClonedVoice | None) -> None:
        """Reset `decoder` for a text chunk, continuing an ICL voice's reference (decoded once per voice)."""
        self.primed.start(decoder, clone)

    def warm_up(self, pacing: StreamPacing) -> None:
        """Stream a throwaway utterance in the pieces `pacing` makes (its first, then two more, which carry what came
        before), so that a first piece does not pay the decoder's cold start at each shape (0.37-0.45 s for a first
        piece of 4 frames at the released 0.6B dimensions on a 2-vCPU Zen 4 EPYC, where a steady frame costs 25 ms)."""
        decoder = self.streaming_decoder()
        quantizers = decoder.decoder.config.num_quantizers
        for frames in (pacing.first_frames, pacing.frames, pacing.frames):
            decoder.push(np.zeros((frames, quantizers), dtype=np.int64))

    def decode(self, codes: np.ndarray, clone: ClonedVoice | None = None) -> np.ndarray:
        """The waveform of frame codes [frames, G], all at once: qwen-tts's speech decoder run by rvqtts in pieces
        (rvqtts.engine.model.speech_decoder: the same audio up to float rounding, faster, its memory bounded), for a
        voice cloned in ICL mode as the continuation of its reference (docs/model-kinds.md, "Decoding (ICL)")."""
        decoder = self.streaming_decoder()
        self.start(decoder, clone)
        return decoder.decode(codes)
