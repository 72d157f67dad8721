"""The stand-in's speech corpus: espeak-ng speaking the shared test sentences in six languages, with
several voices, speeds and pitches, at 24 kHz mono; split by sentence so that no sentence leaks
between training, calibration and evaluation."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 24000
ESPEAK_RATE = 22050
# language code -> (espeak-ng voice, the Qwen3-TTS language name)
LANGUAGES = {
    "en": ("en-us", "english"),
    "de": ("de", "german"),
    "es": ("es", "spanish"),
    "ru": ("ru", "russian"),
    "ja": ("ja", "japanese"),
    "cmn": ("cmn-latn-pinyin", "chinese"),
}
# (voice variant, words per minute, pitch 0-99)
VARIANTS = [("m1", 150, 50), ("f2", 170, 62), ("m3", 135, 40), ("f4", 185, 70), ("m7", 160, 45), ("f1", 145, 56)]


class CorpusError(RuntimeError):
    """The corpus cannot be made (espeak-ng missing, sentences missing)."""


@dataclass(frozen=True)
class Recording:
    language: str
    sentence: int
    variant: str
    split: str
    audio: np.ndarray


def split_of(sentence: int) -> str:
    """Sentence-level split: 1 in 7 sentences for evaluation, 1 in 7 for calibration, the rest to train."""
    return {0: "evaluation", 1: "calibration"}.get(sentence % 7, "train")


def default_sentences_dir() -> Path:
    """The 86 multilingual test sentences shipped with rvqtts (a copy of the project's shared
    `data/sentences/`: en, de, es, ru, ja in kana, cmn in tone-numbered pinyin)."""
    return Path(__file__).resolve().parent / "sentences"


def speak(text: str, voice: str, variant: str, speed: int, pitch: int) -> np.ndarray:
    """espeak-ng's rendering of `text`, resampled to 24 kHz float32 (deterministic)."""
    import io

    import soundfile
    from scipy.signal import resample_poly

    result = subprocess.run(
        ["espeak-ng", "-v", f"{voice}+{variant}", "-s", str(speed), "-p", str(pitch), "--stdout", text],
        capture_output=True,
        check=True,
    )
    audio, rate = soundfile.read(io.BytesIO(result.stdout), dtype="float32")
    if rate != ESPEAK_RATE:
        raise CorpusError(f"espeak-ng wrote {rate} Hz audio, expected {ESPEAK_RATE}")
    return resample_poly(audio, 160, 147).astype(np.float32)  # 22050 * 160 / 147 = 24000


def build_corpus(
    sentences_dir: Path,
    variants: int = len(VARIANTS),
    sentences_per_language: int | None = None,
    languages: list[str] | None = None,
) -> list[Recording]:
    """Speak every sentence with the first `variants` voice variants. Needs espeak-ng on PATH."""
    if shutil.which("espeak-ng") is None:
        raise CorpusError("espeak-ng is not installed: apt-get install espeak-ng (Debian/Ubuntu)")
    jobs = []
    for language in languages or list(LANGUAGES):
        path = sentences_dir / f"{language}.txt"
        if not path.is_file():
            raise CorpusError(f"no sentences for {language}: {path} is missing")
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for index, text in enumerate(lines[:sentences_per_language]):
            for variant, speed, pitch in VARIANTS[:variants]:
                jobs.append((language, index, variant, text, speed, pitch))
    voice = {code: v for code, (v, _) in LANGUAGES.items()}
    with ThreadPoolExecutor(max_workers=4) as pool:
        audio = list(pool.map(lambda j: speak(j[3], voice[j[0]], j[2], j[4], j[5]), jobs))
    return [
        Recording(language, index, variant, split_of(index), wave)
        for (language, index, variant, _, _, _), wave in zip(jobs, audio)
    ]
