"""Voices uploaded over the API (`POST /v1/audio/voices`): a reference recording, with its transcript or without,
encoded once by the Base model into a voice file in the server's `--voices` folder, the file `rvqtts synth --ref-audio
... --save-voice` writes from the same recording, so a request naming it speaks as `synth --ref-audio` does.
docs/server.md, "Voices"."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

from rvqtts.qwen.cloning import ClonedVoice, ClonedVoices, VoiceError, VoiceSource, encode_voice, save_voice

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a voice's name: its file's stem, never a path
MAX_UPLOAD_BYTES = 10 << 20  # a recording's file (vllm-omni's limit too)
MAX_REFERENCE_SECONDS = 60.0  # a longer reference adds encoding time and, in ICL mode, prompt tokens to every request
MAX_VOICES = 1000  # voice files a folder may hold through the API


def voice_files(folder: Path | None) -> dict[str, Path]:
    """The voice files a request may name: `NAME.safetensors` directly in `folder` (a link out of it is
    not one). A request's voice is only ever looked up here, never joined to a path."""
    if folder is None:
        return {}
    root = folder.resolve()
    return {p.stem: p for p in sorted(root.glob("*.safetensors")) if p.is_file() and p.resolve().parent == root}


class VoiceConflict(Exception):
    """A voice of that name is there already."""


class VoiceStore:
    """The voice files of a folder, which several servers may share (replicas behind a load balancer): `tts` (a Base
    model's qwen-tts wrapper) encodes recordings (the caller runs `add` on the model's own thread), and `cloned` (the
    Synthesizer's encoded voices) forgets a removed file's voice. The file system decides, for every server at once:
    a voice file appears whole under its name only where none is there (a hard link, which fails on an existing
    name, on local file systems and NFS alike), and a removal is one unlink."""

    def __init__(self, folder: Path, tts: object, cloned: ClonedVoices):
        self.folder, self.tts, self.cloned = folder.resolve(), tts, cloned  # resolved: as requests name the files

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def add(self, name: str, recording: bytes, filename: str, ref_text: str | None) -> tuple[ClonedVoice, float]:
        """Encode `recording` (a .wav, .flac or .ogg file's bytes) as voice `name`: in ICL mode with its transcript
        `ref_text`, else from the audio alone; returns the voice and the recording's seconds. VoiceError for a bad
        name or recording (what to send instead), VoiceConflict where the name is taken."""
        checked_name(name)
        self._check_free(name)
        with tempfile.TemporaryDirectory(prefix="rvqtts-voice-") as scratch:
            reference = Path(scratch) / "reference"
            reference.write_bytes(recording)
            text = (ref_text or "").strip() or None
            try:
                seconds = reference_seconds(reference)
                voice = encode_voice(self.tts, VoiceSource(reference, text, x_vector_only=text is None))
            except VoiceError as error:  # named as the client named it, not by the scratch file
                raise VoiceError(str(error).replace(str(reference), repr(filename))) from None
        voice = dataclasses.replace(voice, source=f"uploaded: {filename}")
        self._publish(voice, name)
        return voice, seconds

    def _publish(self, voice: ClonedVoice, name: str) -> None:
        """Write the voice beside its place, then link it there: whole or not at all (a request never reads half a
        file), and VoiceConflict where another upload, here or on another server, took the name meanwhile. VoiceError
        where the folder cannot take the file (a file system without hard links: FAT, some SMB shares)."""
        written = None
        try:
            handle, written = tempfile.mkstemp(prefix=f".{name}.", suffix=".partial", dir=self.folder)
            os.close(handle)
            save_voice(voice, written)
            try:
                os.link(written, self.path(name))
            except FileExistsError:
                if os.stat(written).st_nlink != 2:  # NFS: a link retried after it succeeded says the name exists
                    raise VoiceConflict(
                        f"a voice named {name!r} exists: delete it first, or choose another name"
                    ) from None
        except OSError as error:
            raise VoiceError(
                f"{self.folder} cannot take voice files ({error.strerror or error}): put --voices on a local file "
                "system or NFS"
            ) from None
        finally:
            if written is not None:
                Path(written).unlink(missing_ok=True)

    def _check_free(self, name: str) -> None:
        if self.path(name).exists():
            raise VoiceConflict(f"a voice named {name!r} exists: delete it first, or choose another name")
        if len(voice_files(self.folder)) >= MAX_VOICES:
            raise VoiceConflict(f"{self.folder} holds {MAX_VOICES} voices, the most: delete one first")

    def remove(self, name: str) -> bool:
        """Delete voice `name`'s file and its encoded copy; False where no request could name it."""
        checked_name(name)
        path = voice_files(self.folder).get(name)
        if path is None:
            return False
        try:
            path.unlink()
        except FileNotFoundError:  # another server removed it meanwhile
            return False
        self.cloned.pop(VoiceSource(voice=path), None)  # its memory freed; a later voice of its name is read anew
        return True


def checked_name(name: str) -> str:
    if not NAME.fullmatch(name or ""):
        raise VoiceError(
            f"voice name {name!r}: give 1 to 64 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return name


def reference_seconds(path: Path) -> float:
    """The recording's length; VoiceError for one that is not audio soundfile reads or is too long to clone from."""
    import soundfile

    try:
        seconds = soundfile.info(str(path)).duration
    except (RuntimeError, soundfile.LibsndfileError) as error:  # "Error opening 'PATH': WHY"
        reason = str(error).split(": ", 1)[-1]
        raise VoiceError(f"cannot read {path} as audio ({reason}): send a .wav, .flac or .ogg file") from None
    if seconds > MAX_REFERENCE_SECONDS:
        raise VoiceError(
            f"{path} is {seconds:.1f} s long: send at most {MAX_REFERENCE_SECONDS:g} s (3-20 s of the voice speaking "
            "clone it well)"
        )
    return seconds
