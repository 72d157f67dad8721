"""Finding and loading Qwen3-TTS checkpoints the ordinary qwen-tts / Hugging Face way, with errors a
user can act on: a missing folder, or a hub id that is neither cached nor reachable, fails at once with
one line instead of minutes of retries."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from rvqtts.qwen.compat import qwen_tts

# torch is imported where a model loads: the config-only answers (rvqtts voices, a voice refused) do without it
DTYPES = ("float32", "bfloat16", "float16")
OFFLINE_HINT = (
    "pass --model PATH with a downloaded checkpoint folder, or try rvqtts offline with a tiny "
    'random-weight one: rvqtts make-tiny-model tiny-model && rvqtts synth "Hello." --model '
    "tiny-model -o hello.wav"
)


class ModelLoadError(RuntimeError):
    """A model that cannot be found or loaded; the message says what to do."""


def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_model(model: str | os.PathLike) -> str:
    """A local folder, a cached hub snapshot, or a hub id that can be downloaded; else ModelLoadError."""
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but holds no config.json: it is not a model checkpoint")
        return str(path)
    if path.exists() or text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelLoadError(f"no model folder {text}, and it is not a hub id (owner/name): {OFFLINE_HINT}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        return snapshot_download(text, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except ValueError as error:  # not a valid repo id
        raise ModelLoadError(
            f"no model folder {text}, and it is not a valid hub id ({error}); {OFFLINE_HINT}"
        ) from error
    if not _hub_reachable():
        raise ModelLoadError(
            f"cannot load {text}: the Hugging Face hub cannot be reached and the model is not "
            f"in the local cache; {OFFLINE_HINT}"
        )
    return text


# The 12 Hz model kinds (config.tts_model_type), by their released names, and what each takes from a user.
KINDS = {
    "custom_voice": ("CustomVoice", "built-in speakers (--speaker), a style instruction (--instruct) on the 1.7B"),
    "base": (
        "Base",
        "a voice cloned from reference audio (--ref-audio with --ref-text or --x-vector-only, or --voice)",
    ),
    "voice_design": ("VoiceDesign", "a voice described in words (--instruct)"),
}
DEFAULT_SPEAKER = "vivian"  # a CustomVoice model's speaker when none is named


def _check_kind(model: str | os.PathLike, model_type: str, tokenizer_type: str) -> None:
    """ModelLoadError unless the checkpoint is a 12 Hz model of a known kind."""
    if tokenizer_type != "qwen3_tts_tokenizer_12hz" or model_type not in KINDS:
        raise ModelLoadError(
            f"{model} is a {model_type} model with the {tokenizer_type}; rvqtts runs the 12 Hz "
            f"models (such as Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice)"
        )


def _from_pretrained(class_name: str, source: str, device: str, dtype: str, failure: str):
    """qwen-tts's `class_name` loaded from `source`; ModelLoadError (`failure`: what could not be loaded) otherwise."""
    import torch

    try:
        return getattr(qwen_tts(), class_name).from_pretrained(source, device_map=device, dtype=getattr(torch, dtype))
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ModelLoadError(f"{failure}: {error}") from error


def load_tts(model: str | os.PathLike, device: str = "cpu", dtype: str = "float32"):
    """A 12 Hz `qwen_tts.Qwen3TTSModel` of any kind, loaded with qwen-tts's own from_pretrained."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    failure = f"cannot load {model} as a Qwen3-TTS checkpoint"
    tts = _from_pretrained("Qwen3TTSModel", resolve_model(model), device, dtype, failure)
    _check_kind(model, tts.model.tts_model_type, tts.model.tokenizer_type)
    unpin_checkpoint(tts.model.speech_tokenizer.model)
    return tts


SMALL_TENSOR = 4096  # elements: a tensor this small is copied off a memory-mapped checkpoint (`unpin_checkpoint`)


def unpin_checkpoint(module) -> None:
    """Copy `module`'s small tensors (flags and scalars) into memory of their own, so that they alone do not keep a
    memory-mapped checkpoint resident (docs/benchmarks.md). Weights left as views stay views."""
    import torch

    for submodule in module.modules():
        for tensors in (submodule._parameters, submodule._buffers):
            for name, tensor in list(tensors.items()):
                if tensor is not None and tensor.numel() <= SMALL_TENSOR:
                    copy = tensor.detach().clone()  # a new tensor: `.data =` left the file mapped
                    parameter = isinstance(tensor, torch.nn.Parameter)
                    tensors[name] = torch.nn.Parameter(copy, tensor.requires_grad) if parameter else copy


def load_speech_tokenizer(model: str | os.PathLike, device: str = "cpu", dtype: str = "float32"):
    """The checkpoint's speech tokenizer (its `speech_tokenizer` folder) alone, in `dtype`, loaded as qwen-tts loads it
    with the model: for a decoder in a dtype of its own, from the stored weights (rvqtts.qwen.decoder_dtype)."""
    folder = Path(resolve_model(model)) / "speech_tokenizer"
    failure = f"cannot load the speech tokenizer of {model} from {folder}"
    tokenizer = _from_pretrained("Qwen3TTSTokenizer", str(folder), device, dtype, failure)
    unpin_checkpoint(tokenizer.model)
    return tokenizer


@dataclass(frozen=True)
class ModelVoices:
    """What a checkpoint's config says about its voices: its kind, built-in speakers and languages."""

    kind: str
    speakers: list[str]
    languages: list[str]

    def check(
        self, speaker: str | None, language: str, instruct: str | None = None, cloned: bool = False
    ) -> str | None:
        """The speaker to use (None: the default speaker, where the model has speakers); ValueError, saying
        what to give, when the voice asked for is not one this kind of model speaks (docs/model-kinds.md)."""
        if cloned and self.kind != "base":
            raise ValueError(
                f"reference audio and voice files clone a voice on Base models; this is a "
                f"{KINDS[self.kind][0]} model (it takes {KINDS[self.kind][1]})"
            )
        if self.kind == "base" and not cloned:
            raise ValueError(
                "a Base model speaks a cloned voice: give a voice file (--voice FILE; rvqtts synth also "
                'takes --ref-audio FILE with --ref-text "..." or --x-vector-only)'
            )
        if self.kind == "voice_design" and not (instruct or "").strip():
            raise ValueError(
                'a VoiceDesign model speaks the voice its instruction describes: give an instruction (--instruct "...")'
            )
        if not self.speakers:
            if speaker is not None:
                raise ValueError(
                    f"this {KINDS[self.kind][0]} model has no built-in speakers (got {speaker!r}): it "
                    f"takes {KINDS[self.kind][1]}"
                )
        elif speaker is None:
            speaker = DEFAULT_SPEAKER if DEFAULT_SPEAKER in self.speakers else self.speakers[0]
        elif speaker.lower() not in self.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; this model has: {', '.join(self.speakers)}")
        if language.lower() not in self.languages:
            raise ValueError(f"unknown language {language!r}; this model has: {', '.join(self.languages)}")
        return speaker


def model_voices(model: str | os.PathLike) -> ModelVoices:
    """A checkpoint's kind, speakers (only CustomVoice models have any) and languages, as qwen-tts lists
    them, read from its config.json alone (no weights, no qwen-tts: an answer in well under a second).
    ModelLoadError for a model that is not a 12 Hz Qwen3-TTS checkpoint."""
    config = read_config(model)
    talker = config.get("talker_config") or {}
    languages = ["auto"] + [k for k in talker.get("codec_language_id") or {} if "dialect" not in k]
    speakers = talker.get("spk_id") if config["tts_model_type"] == "custom_voice" else None
    return ModelVoices(
        config["tts_model_type"], sorted(k.lower() for k in speakers or {}), sorted(k.lower() for k in languages)
    )


def read_config(model: str | os.PathLike) -> dict:
    """A 12 Hz checkpoint's config.json as it is written (a hub model's fetched alone where it is not cached);
    ModelLoadError otherwise."""
    source = resolve_model(model)
    path = Path(source) / "config.json"
    try:
        if not path.is_file():  # a hub id, reachable but not cached
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(source, "config.json"))
        config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("it is not a JSON object")
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {model}'s config as a Qwen3-TTS checkpoint's: {error}") from error
    _check_kind(model, config.get("tts_model_type"), config.get("tokenizer_type"))
    return config


def model_config(model: str | os.PathLike):
    """A 12 Hz checkpoint's `Qwen3TTSConfig`, made by qwen-tts from `read_config`'s fields (no weights load);
    ModelLoadError otherwise."""
    fields = read_config(model)
    try:
        return qwen_tts().core.models.Qwen3TTSConfig.from_dict(fields)
    except (ValueError, TypeError, KeyError) as error:
        raise ModelLoadError(f"cannot read {model}'s config as a Qwen3-TTS checkpoint's: {error}") from error
