"""One designed voice for a whole document. A VoiceDesign model draws the voice its instruction describes anew for
every chunk; to keep one, it speaks a sample once (the document's opening, seeded), a Base model clones the voice
from that sample and its text, and the voice file is kept in the output folder: every chunk, and every resumed run,
speaks in it. A new instruction, seed, language or model designs it again."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rvqtts.documents.document import Document
from rvqtts.qwen.cloning import VoiceSource, save_voice
from rvqtts.support.audio import write_audio
from rvqtts.support.files import read_records, write_json
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.text import chunk_text

VOICE_FILE = "designed-voice.safetensors"
SAMPLE_FILE = "designed-voice.wav"
REQUEST_FILE = "designed-voice.json"
SAMPLE_CHARS = 200  # about 14 s of English: enough voice to clone
SAMPLE_FRAMES = 25  # a frame limit below this would leave a reference too short to clone (2 s)


def sample_text(document: Document) -> str:
    """What the designed voice first says: the document's opening, a chunk of at most SAMPLE_CHARS."""
    opening = " ".join(paragraph for chapter in document.chapters[:1] for paragraph in chapter.paragraphs[:8])
    return chunk_text(opening, SAMPLE_CHARS)[0]


def designed_voice(
    designer,
    cloner,
    document: Document,
    out_dir: str | Path,
    instruct: str,
    language: str = "auto",
    seed: int = 0,
    settings: GenerationSettings = GenerationSettings(),
) -> VoiceSource:
    """The voice file of `document`'s designed voice in `out_dir`: made where missing or asked for differently (the
    VoiceDesign model `designer` speaks the sample in `instruct`'s voice with `seed` and `settings`, the Base model
    `cloner` clones it in ICL mode), else the one there."""
    out_dir = Path(out_dir).resolve()  # Ray workers read the voice file from their own folders
    text = sample_text(document)
    request = {"instruct": instruct, "language": language, "seed": seed, "text": text, "settings": repr(settings)}
    request["models"] = [designer.identity(), cloner.identity()]
    voice = VoiceSource(voice=out_dir / VOICE_FILE)
    if voice.voice.is_file() and read_records(out_dir / REQUEST_FILE) == json.loads(json.dumps(request)):
        return voice
    limit = settings.max_frames and max(settings.max_frames, SAMPLE_FRAMES)
    sample = designer.synthesize(
        text, language=language, instruct=instruct, seed=seed, settings=replace(settings, max_frames=limit)
    )
    write_audio(out_dir / SAMPLE_FILE, sample.audio, sample.sample_rate)
    save_voice(cloner.clone_voice(out_dir / SAMPLE_FILE, ref_text=text), voice.voice)
    write_json(out_dir / REQUEST_FILE, request)
    return voice
