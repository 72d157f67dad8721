"""Cloned voices for Base models: reference audio in (read and checked here, encoded by qwen-tts's
`create_voice_clone_prompt`), the voice the talker's prompt embeds out, kept as a voice file so a voice is
encoded once. ICL and x-vector-only modes, the checks and the file format: docs/model-kinds.md."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from rvqtts.engine.speculative.offsets import weight_digest
from rvqtts.support.audio import UnreadableAudio, read_mono, resample
from rvqtts.support.files import write_atomically

VOICE_FORMAT = "rvqtts-voice"
MIN_REFERENCE_SECONDS = 1.0  # below this the speaker encoder and the codec see too little to clone from
PRIMED_VOICES = 32  # decoder states kept after ICL references (a few MB each at the released dimensions)
SILENCE_PEAK = 1e-3  # a reference whose loudest sample is below this (-60 dBFS) holds no voice


class VoiceError(ValueError):
    """Reference audio or a voice file that cannot be used; the message names the file and the fault."""


@dataclass(frozen=True)
class VoiceSource:
    """Where a cloned voice comes from: reference audio (with its transcript, or `x_vector_only`), or a
    voice file written by `save_voice`. Hashable, so a run encodes each source once."""

    ref_audio: Path | None = None
    ref_text: str | None = None
    x_vector_only: bool = False
    voice: Path | None = None

    def __post_init__(self) -> None:
        if self.voice is not None:
            if self.ref_audio is not None or self.ref_text is not None or self.x_vector_only:
                raise VoiceError("give a voice file or reference audio (with its text), not both")
        elif self.ref_audio is None:
            if self.ref_text is not None or self.x_vector_only:
                raise VoiceError(
                    "the reference text and x-vector-only mode go with reference audio: give it too (--ref-audio FILE)"
                )
        elif self.x_vector_only and self.ref_text is not None:
            raise VoiceError(
                "x-vector-only mode clones from the audio alone: drop the reference text, or drop "
                "--x-vector-only to clone in ICL mode with it"
            )
        elif not self.x_vector_only and not (self.ref_text or "").strip():
            raise VoiceError(
                "cloning a voice in ICL mode needs the reference audio's transcript (--ref-text "
                '"..."), or --x-vector-only to clone from the audio alone'
            )

    def record(self) -> dict:
        """What a manifest says about the voice."""
        if self.voice is not None:
            return {"voice": str(self.voice)}
        return {"ref_audio": str(self.ref_audio), "ref_text": self.ref_text, "x_vector_only": self.x_vector_only}


@dataclass(frozen=True, eq=False)
class ClonedVoice:
    """An encoded voice: the speaker embedding [hidden], the reference codes [frames, 16] and transcript
    (ICL mode; None in x-vector-only mode), and which speaker encoder made it. Compared and hashed by
    identity (its tensors have no truth value)."""

    embedding: torch.Tensor
    codes: torch.Tensor | None
    ref_text: str | None
    encoder_fingerprint: str
    source: str = ""

    @property
    def icl(self) -> bool:
        return self.codes is not None

    def prompt_item(self, device: torch.device):
        """The voice as qwen-tts's VoiceClonePromptItem, for `generate_voice_clone(voice_clone_prompt=[...])`."""
        from rvqtts.qwen.compat import qwen_tts

        return qwen_tts().VoiceClonePromptItem(
            ref_code=None if self.codes is None else self.codes.to(device),
            ref_spk_embedding=self.embedding.to(device),
            x_vector_only_mode=not self.icl,
            icl_mode=self.icl,
            ref_text=self.ref_text,
        )


def encoder_fingerprint(model: torch.nn.Module) -> str:
    """A short hash that tells speaker encoders apart (docs/model-kinds.md): an embedding means something only to
    the encoder's own model."""
    config = model.config.speaker_encoder_config.to_dict()  # its numbers: the dtype's name is left out
    summary = {
        "config": {k: v for k, v in sorted(config.items()) if isinstance(v, (int, float, list))},
        "weights": weight_digest(model.speaker_encoder.fc.weight),
    }
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]


def read_reference(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Reference audio as float32 mono samples and their rate; VoiceError for a file that is missing,
    unreadable, too short, silent or not finite."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise VoiceError(f"no reference audio file {path}")
    try:
        samples, rate = read_mono(path)
    except UnreadableAudio as error:
        raise VoiceError(f"cannot read reference audio {path}: {error} (give a .wav, .flac or .ogg file)") from error
    seconds = samples.size / rate
    if seconds < MIN_REFERENCE_SECONDS:
        raise VoiceError(
            f"reference audio {path} is {seconds:.2f} s long: give at least {MIN_REFERENCE_SECONDS:g} s "
            "of the voice speaking"
        )
    if not np.isfinite(samples).all():
        raise VoiceError(f"reference audio {path} holds NaN or infinite samples")
    if np.abs(samples).max() < SILENCE_PEAK:
        raise VoiceError(
            f"reference audio {path} is silent (its loudest sample is below -60 dBFS): give a "
            "recording of the voice speaking"
        )
    return samples, rate


def encode_voice(tts: object, source: VoiceSource) -> ClonedVoice:
    """Encode reference audio with qwen-tts's `create_voice_clone_prompt` on the Base model `tts`;
    VoiceError for audio that cannot be read or encoded."""
    samples, rate = read_reference(source.ref_audio)
    speech_rate = int(tts.model.speech_tokenizer.feature_extractor.sampling_rate)
    if tts.model.speaker_encoder_sample_rate == speech_rate:  # both encoders take it at this rate: the same bits
        samples, rate = resample(samples, rate, speech_rate), speech_rate
    try:
        (item,) = tts.create_voice_clone_prompt(
            ref_audio=(samples, rate), ref_text=source.ref_text, x_vector_only_mode=source.x_vector_only
        )
    except (RuntimeError, ValueError) as error:  # out of memory on a long reference, a resampling fault
        raise VoiceError(f"cannot clone a voice from {source.ref_audio}: {error}") from error
    codes = None if item.ref_code is None else item.ref_code.detach().to(torch.long).cpu()
    return ClonedVoice(
        item.ref_spk_embedding.detach().float().cpu(),
        codes,
        source.ref_text,
        encoder_fingerprint(tts.model),
        str(source.ref_audio),
    )


def save_voice(voice: ClonedVoice, path: str | os.PathLike) -> None:
    """Write a voice file (atomically; its format: docs/model-kinds.md)."""
    from safetensors.torch import save

    tensors = {"embedding": voice.embedding.float().contiguous()}
    if voice.codes is not None:
        tensors["codes"] = voice.codes.to(torch.int64).contiguous()
    meta = {
        "format": VOICE_FORMAT,
        "mode": "icl" if voice.icl else "x-vector-only",
        "ref_text": voice.ref_text or "",
        "encoder_fingerprint": voice.encoder_fingerprint,
        "source": voice.source,
    }
    write_atomically(path, save(tensors, metadata=meta))


def load_voice(
    path: str | os.PathLike,
    hidden_size: int | None = None,
    fingerprint: str | None = None,
    code_groups: int | None = None,
    codebook: int | None = None,
) -> ClonedVoice:
    """Read and check a voice file; VoiceError naming the file for every fault. With the model's talker
    `hidden_size`, its `code_groups`, `codebook` size and its speaker encoder's `fingerprint`, a voice
    another model encoded is refused."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise VoiceError(f"no voice file {path} (write one with rvqtts synth --ref-audio ... --save-voice {path})")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises several types for corrupt files
        raise VoiceError(f"cannot read voice file {path}: {error}") from error
    if meta.get("format") != VOICE_FORMAT:
        raise VoiceError(f"{path} is not an rvqtts voice file (metadata format != {VOICE_FORMAT!r})")
    embedding, codes, icl = tensors.get("embedding"), tensors.get("codes"), meta.get("mode") == "icl"
    if embedding is None or embedding.dim() != 1 or icl != (codes is not None) or (icl and not meta.get("ref_text")):
        raise VoiceError(
            f"voice file {path} is damaged: it needs an embedding [hidden] and, in ICL mode, codes "
            "and the reference text"
        )
    if codes is not None and (
        codes.dim() != 2
        or codes.dtype != torch.int64
        or codes.shape[0] < 1
        or (code_groups is not None and codes.shape[1] != code_groups)
    ):
        raise VoiceError(
            f"voice file {path} is damaged: its codes must be int64 [frames, {code_groups or 'groups'}], "
            f"got {codes.dtype} {list(codes.shape)}"
        )
    if codes is not None and (int(codes.min()) < 0 or (codebook is not None and int(codes.max()) >= codebook)):
        raise VoiceError(
            f"voice file {path} is damaged: its codes must lie in 0..{(codebook or 0) - 1}, got "
            f"{int(codes.min())}..{int(codes.max())}"
        )
    if not torch.isfinite(embedding).all():
        raise VoiceError(f"voice file {path} holds NaN or infinite values")
    theirs = meta.get("encoder_fingerprint", "")
    if (hidden_size is not None and embedding.shape[0] != hidden_size) or (fingerprint and theirs != fingerprint):
        raise VoiceError(
            f"voice file {path} was encoded by another model's speaker encoder (fingerprint {theirs}, "
            f"embedding {embedding.shape[0]}; this model's: {fingerprint}, {hidden_size}): encode the "
            "reference again with this model (--ref-audio ... --save-voice)"
        )
    return ClonedVoice(embedding.float(), codes, meta.get("ref_text") or None, theirs, meta.get("source", ""))


class ClonedVoices(dict):
    """The voices cloned for one loaded model (VoiceSource -> ClonedVoice), each source encoded from reference audio
    or read from a voice file once (a batch that repeats a voice encodes it once); a voice file replaced since it was
    read (another server sharing its folder may have deleted it and uploaded another of the same name) is read anew.
    `fingerprint` names a Base model's speaker encoder, whose embeddings mean nothing to another's."""

    def __init__(self, tts: object):
        super().__init__()
        self.tts = tts
        self.fingerprint = encoder_fingerprint(tts.model) if tts.model.tts_model_type == "base" else None
        self.stamps: dict[VoiceSource, tuple | None] = {}  # each voice file's identity when it was read

    def of(self, source: VoiceSource) -> ClonedVoice:
        """The cloned voice `source` names (the model's kind checked by the caller)."""
        stamp = None if source.voice is None else file_stamp(source.voice)
        if source not in self or self.stamps.get(source) != stamp:
            talker = self.tts.model.talker
            if source.voice is None:
                self[source] = encode_voice(self.tts, source)
            else:
                groups, codebook = talker.config.num_code_groups, talker.code_predictor.config.vocab_size
                self[source] = load_voice(source.voice, talker.config.hidden_size, self.fingerprint, groups, codebook)
            self.stamps[source] = stamp
        return self[source]

    def check(self, clone: ClonedVoice | None) -> None:
        """VoiceError where `clone` was encoded by another model's speaker encoder."""
        if clone is not None and clone.encoder_fingerprint != self.fingerprint:
            raise VoiceError(
                f"the voice {clone.source or ''} was encoded by another model's speaker encoder "
                f"(fingerprint {clone.encoder_fingerprint}; this model's is {self.fingerprint}):"
                " encode the reference again with this model"
            )

    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors the voices hold (speaker embeddings, reference codes)."""
        for voice in self.values():
            yield from (voice.embedding, voice.codes)


def file_stamp(path: str | os.PathLike) -> tuple[int, ...] | None:
    """A file's identity (device, inode, modification time, size): another file put in its place has another;
    None where there is none (its reading says why)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size


class PrimedVoices(dict):
    """The streaming decoder's state after each ICL voice's reference codes (voice -> state), so that every
    text chunk in that voice continues its reference (as qwen-tts's offline decode does) without decoding
    the reference again; the PRIMED_VOICES most recent voices are kept."""

    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors the kept states hold (carried inputs, the decoder transformer's keys and values)."""
        for state, cache, _ in self.values():
            yield from state.values()
            for layer in getattr(cache, "layers", []):
                kept = (getattr(layer, name, None) for name in ("keys", "values"))
                yield from (tensor for tensor in kept if isinstance(tensor, torch.Tensor))

    def start(self, decoder: object, clone: ClonedVoice | None) -> None:
        """Reset the streaming decoder (rvqtts.engine.model.speech_decoder) for a text chunk; for a voice cloned in ICL
        mode, restore it to just after the voice's reference (decoded here the first time)."""
        decoder.reset()
        if clone is None or not clone.icl:
            return
        if clone not in self:
            if len(self) >= PRIMED_VOICES:  # a batch of many voices: drop the oldest
                del self[next(iter(self))]
            decoder.decode(clone.codes)
            self[clone] = decoder.snapshot()
        decoder.restore(self[clone])
