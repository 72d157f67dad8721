"""Frames to learn and measure drafting on: per frame, the talker's hidden state h_t, the frame's codes
c0..c_{G-1} and its language.

They come from two places. `record_contexts` runs ordinary synthesis over texts and records what the
talker hands the inner loop (self-distillation: the codes are the model's own free-running samples).
`rvqtts standin build` writes them for held-out corpus frames (the codes are the corpus's: teacher
forcing). A contexts file is an `.npz` with `h_t` [n, E] float32, `codes` [n, G] int64 and `language`
[n] strings, either as plain keys or once per split (`calibration_h_t`, `evaluation_codes`, ...).
"""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rvqtts.engine.loop.frame_loop import Work, WorkFailed
from rvqtts.support.audio import UnreadableAudio, read_mono, resample
from rvqtts.support.files import write_atomically
from rvqtts.synthesis.settings import GenerationSettings, Line

FIELDS = ("h_t", "codes", "language")


class ContextsFileError(ValueError):
    """A contexts file that cannot be used; the message names the file and the fault."""


@dataclass(frozen=True)
class Contexts:
    h_t: np.ndarray  # [n, E] the talker's hidden state per frame
    codes: np.ndarray  # [n, G] c0..c_{G-1}
    language: np.ndarray  # [n] language name per frame
    source: str = ""  # where the frames came from, for provenance

    def __len__(self) -> int:
        return len(self.codes)

    def take(self, index: np.ndarray) -> "Contexts":
        return Contexts(self.h_t[index], self.codes[index], self.language[index], self.source)

    def split(self, held_out: float, seed: int) -> tuple["Contexts", "Contexts"]:
        """A seeded (train, held-out) split of the frames; the held-out part gets at least one frame."""
        order = np.random.default_rng(seed).permutation(len(self))
        cut = max(1, int(round(len(self) * held_out)))
        return self.take(np.sort(order[cut:])), self.take(np.sort(order[:cut]))

    def prefixes(self, talker_embedding: torch.nn.Module) -> torch.Tensor:
        """The predictor's inputs [n, 2, E]: h_t and the talker's embedding of c0, per frame."""
        weight = talker_embedding.weight
        with torch.no_grad():
            embedded = talker_embedding(torch.from_numpy(self.codes[:, 0]).long().to(weight.device))
        return torch.stack([torch.from_numpy(self.h_t).to(weight), embedded], 1)


def save_contexts(contexts: Contexts, path: str | os.PathLike) -> None:
    """Write a contexts file (atomically: a temporary file, then a rename)."""
    buffer = io.BytesIO()
    np.savez(
        buffer,
        h_t=contexts.h_t.astype(np.float32),
        codes=contexts.codes.astype(np.int64),
        language=contexts.language.astype(str),
        source=np.array(contexts.source),
    )
    write_atomically(path, buffer.getvalue())


def load_contexts(
    path: str | os.PathLike, split: str | None = None, hidden_size: int | None = None, code_groups: int | None = None
) -> Contexts:
    """Read and check a contexts file. A file with splits needs `split`; a file without ignores it.

    With `hidden_size` and `code_groups`, frames recorded for another model are refused."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise ContextsFileError(f"cannot read contexts file {path}: {error}") from error
    splits = sorted({name[: -len("_h_t")] for name in arrays if name.endswith("_h_t")})
    if all(name in arrays for name in FIELDS):
        prefix, where = "", ""
    elif splits:
        if split not in splits:
            raise ContextsFileError(
                f"contexts file {path} holds the splits {', '.join(splits)}: choose one with --split"
            )
        prefix, where = f"{split}_", f" (split {split})"
    else:
        raise ContextsFileError(f"{path} is not a contexts file: it needs the arrays {', '.join(FIELDS)}")
    missing = [f"{prefix}{name}" for name in FIELDS if f"{prefix}{name}" not in arrays]
    if missing:
        raise ContextsFileError(f"contexts file {path}{where} lacks {', '.join(missing)}")
    h_t, codes, language = (arrays[f"{prefix}{name}"] for name in FIELDS)
    n = len(codes)
    if h_t.ndim != 2 or codes.ndim != 2 or language.shape != (n,) or len(h_t) != n or n == 0:
        raise ContextsFileError(
            f"contexts file {path}{where}: expected h_t [n, E], codes [n, G] and language "
            f"[n] with n > 0, got {list(h_t.shape)}, {list(codes.shape)}, {list(language.shape)}"
        )
    if hidden_size is not None and h_t.shape[1] != hidden_size:
        raise ContextsFileError(
            f"contexts file {path}: h_t has width {h_t.shape[1]} but the model's talker has "
            f"{hidden_size}: these frames were recorded for another model"
        )
    if code_groups is not None and codes.shape[1] != code_groups:
        raise ContextsFileError(
            f"contexts file {path}: frames have {codes.shape[1]} codes but the model makes "
            f"{code_groups}: these frames were recorded for another model"
        )
    if not np.isfinite(h_t).all():
        raise ContextsFileError(f"contexts file {path}{where}: h_t holds NaN or infinite values")
    source = str(arrays["source"]) if "source" in arrays else f"{path.name}{where}"
    return Contexts(h_t.astype(np.float32), codes.astype(np.int64), language.astype(str), source)


def record_contexts(
    synthesizer, lines: list[Line], defaults: Line, on_line: Callable[[int, int], None] | None = None
) -> Contexts:
    """Synthesize `lines` (rvqtts.synthesis.batch_files.read_batch's; their voice fields, else the run's) with the plain
    inner loop and record every frame.

    c0 is not handed to the inner loop, only its embedding; it is recovered as the embedding table's
    matching row (an exact lookup, so the nearest row is the row)."""
    table = synthesizer.talker.get_input_embeddings().weight.detach()
    h_t: list[np.ndarray] = []
    codes: list[list[int]] = []
    languages: list[str] = []

    for number, line in enumerate(lines):
        line = synthesizer.voiced(line.under(defaults))

        def on_frame(prefix: torch.Tensor, residual: list[int]) -> None:
            c0 = int(torch.cdist(prefix[1:2].to(table), table).argmin())
            h_t.append(prefix[0].float().cpu().numpy())
            codes.append([c0, *residual])
            languages.append(line.language)

        voice = dict(speaker=line.speaker, language=line.language, instruct=line.instruct, clone=line.clone)
        synthesizer.synthesize(
            line.text,
            seed=line.seed,
            utterance=line.utterance,
            settings=line.settings or GenerationSettings(),
            on_frame=on_frame,
            **voice,
        )
        if on_line:
            on_line(number + 1, len(lines))
    if not codes:
        raise ValueError("the synthesis produced no frames to record")
    return Contexts(
        np.stack(h_t),
        np.array(codes, dtype=np.int64),
        np.array(languages),
        source=f"self-distilled: {len(lines)} texts, seed {defaults.seed}",
    )


@dataclass(frozen=True)
class AudioPair:
    """A recording and its line (its transcript, voice fields and line number)."""

    audio: Path
    line: Line


def speech_codes(tokenizer, path: Path) -> np.ndarray:
    """A recording's frames of codes [frames, 16] by the model's speech tokenizer: read and resampled here as
    qwen-tts would (rvqtts.support.audio: the same samples, without compiling librosa's numba functions), or read
    by qwen-tts where soundfile cannot read the file."""
    rate = int(tokenizer.feature_extractor.sampling_rate)
    try:
        samples, file_rate = read_mono(path)
    except UnreadableAudio:  # a format only librosa's fallbacks read
        return tokenizer.encode(str(path)).audio_codes[0].cpu().numpy()
    return tokenizer.encode(resample(samples, file_rate, rate), sr=rate).audio_codes[0].cpu().numpy()


def read_audio_pairs(path: str | os.PathLike) -> list[AudioPair]:
    """A .jsonl file of {"audio": file, "text": transcript, optional "speaker", "language"}; audio paths
    are relative to the file's folder. Every line is checked before anything runs."""
    import json

    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise ContextsFileError(f'{path}: audio pairs come in a .jsonl file (one {{"audio", "text"}} per line)')
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ContextsFileError(f"cannot read {path}: {error}") from error
    pairs = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ContextsFileError(f"{path}:{number}: not valid JSON ({error.msg})") from error
        if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) and record[k].strip() for k in ("audio", "text")
        ):
            raise ContextsFileError(f'{path}:{number}: needs "audio" (a file) and "text" (its transcript)')
        unknown = sorted(set(record) - {"audio", "text", "speaker", "language"})
        if unknown:
            raise ContextsFileError(f"{path}:{number}: unknown field(s) {unknown}")
        audio = (path.parent / record["audio"]).expanduser()
        if not audio.is_file():
            raise ContextsFileError(f"{path}:{number}: no audio file {audio}")
        line = Line(
            text=record["text"].strip(),
            speaker=record.get("speaker"),
            language=record.get("language"),
            utterance=number,
        )
        pairs.append(AudioPair(audio, line))
    if not pairs:
        raise ContextsFileError(f"{path}: no audio pairs (the file has no non-empty line)")
    return pairs


def teacher_force(synth, line: Line, codes: np.ndarray, on_frame: Callable[[torch.Tensor, list[int]], None]) -> None:
    """Teacher forcing: run `synth`'s talker over the line's text, in its voice, while it emits exactly these frame
    codes [frames, G] (c0 read instead of drawn, c1.. returned by the inner loop), and show `on_frame` each frame's
    predictor prefix [h_t, embedding of c0] with the frame's codes c1.. ."""
    line = synth.voiced(line)
    prompt = synth.prompt(" ".join(line.text.split()), line.speaker, line.language, line.instruct, line.clone)
    work = Work(0, 0, iter([(prompt, len(codes))]), synth.sampling(GenerationSettings()), codes, on_frame)
    for event in synth.runners.frame_loop().run([work]):
        if isinstance(event, WorkFailed):
            raise event.error
    if work.frame != len(codes):
        raise RuntimeError(f"teacher forcing stopped after {work.frame} of {len(codes)} frames")


def force_contexts(
    synthesizer, pairs: list[AudioPair], defaults: Line, on_pair: Callable[[int, int], None] | None = None
) -> Contexts:
    """Teacher forcing: encode each recording with the model's own speech tokenizer and run the talker
    over its transcript (in the pair's voice, else the run's) emitting exactly those codes;
    record every frame's h_t with the true codes."""
    h_t: list[np.ndarray] = []
    codes: list[np.ndarray] = []
    languages: list[str] = []
    for number, pair in enumerate(pairs):
        frames = speech_codes(synthesizer.codec.encoding_tokenizer(), pair.audio)
        line = synthesizer.voiced(pair.line.under(defaults))

        def on_frame(prefix: torch.Tensor, residual: list[int]) -> None:
            h_t.append(prefix[0].float().cpu().numpy())
            languages.append(line.language)

        teacher_force(synthesizer, line, frames, on_frame)
        codes.append(frames)
        if on_pair:
            on_pair(number + 1, len(pairs))
    return Contexts(
        np.stack(h_t),
        np.concatenate(codes).astype(np.int64),
        np.array(languages),
        source=f"teacher-forced: {len(pairs)} recordings",
    )
