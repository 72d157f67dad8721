"""The chunk store of an output folder (`.chunks`): each chunk's audio, the 16-bit samples `rvqtts synth` would write
for it, in FLAC, with its record, named by a digest of its text, its seed and everything else that decides its
audio; a file there is whole (written atomically), so a run stopped at any moment leaves only whole chunks, which
the next run reuses. A chapter's samples are read back from it joined and paused."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict
from itertools import groupby
from pathlib import Path
from typing import Iterator

import numpy as np

from rvqtts.documents.plan import ChapterPlan, PlannedChunk
from rvqtts.support.audio import StreamJoiner
from rvqtts.support.files import read_records, write_atomically, write_json
from rvqtts.synthesis.batch_files import Rendered
from rvqtts.synthesis.settings import GenerationSettings, Line

CHUNK_STORE = ".chunks"  # in the output folder
CHUNK_FORMAT = ".flac"  # a chunk's samples as `rvqtts synth` writes them in its 16-bit WAV, losslessly


def speech_identity(model: dict, voice: Line, chunk_chars: float) -> dict:
    """Everything besides a chunk's text and seed that decides its audio: the model's identity (Synthesizer.identity:
    its weights' digests, dtypes, weight format, rvqtts's version), the voice (a cloned one's files by content), the
    sampling and the chunking."""
    clone = voice.clone
    cloned = None
    if clone is not None:
        sources = [path for path in (clone.ref_audio, clone.voice) if path is not None]
        files = {"ref_audio", "voice"}  # known by their content, so a folder moved or mounted elsewhere keeps its keys
        cloned = {key: value for key, value in clone.record().items() if key not in files}
        cloned["digest"] = [hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in sources]
    return {
        **model,
        "voice": {"speaker": voice.speaker, "language": voice.language, "instruct": voice.instruct, "clone": cloned},
        "settings": asdict(voice.settings or GenerationSettings()),
        "chunk_chars": chunk_chars,
    }


def chunk_key(identity: dict, chunk: PlannedChunk) -> str:
    """A chunk's name in the store: a digest of its text, its seed and the speech identity."""
    keyed = json.dumps({**identity, "text": chunk.text, "seed": chunk.seed}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(keyed.encode()).hexdigest()[:32]


class ChunkStore:
    """An output folder's chunks by key."""

    def __init__(self, out_dir: Path):
        self.folder = Path(out_dir) / CHUNK_STORE

    def has(self, key: str) -> bool:
        return (self.folder / f"{key}{CHUNK_FORMAT}").is_file()

    def keep(self, key: str, rendered: Rendered) -> None:
        """A chunk's record, then its audio (whose presence means done): the 16-bit samples of its WAV
        (`rendered.audio`, the bytes `rvqtts synth -o chunk.wav` writes) in FLAC, half the size."""
        import soundfile

        write_json(self.folder / f"{key}.json", {"warnings": rendered.record["warnings"], "record": rendered.record})
        samples, rate = soundfile.read(io.BytesIO(rendered.audio), dtype="int16")
        flac = io.BytesIO()
        soundfile.write(flac, samples, rate, format="FLAC", subtype="PCM_16")
        write_atomically(self.folder / f"{key}{CHUNK_FORMAT}", flac.getvalue())

    def warnings(self, key: str) -> list[str]:
        """What was said of a chunk when it was made (cut at its frame limit)."""
        return read_records(self.folder / f"{key}.json").get("warnings", [])

    def samples(self, key: str) -> np.ndarray:
        import soundfile

        return soundfile.read(str(self.folder / f"{key}{CHUNK_FORMAT}"), dtype="float32")[0]


def chapter_blocks(
    store: ChunkStore, plan: ChapterPlan, keys: list[str], sample_rate: int, paragraph_pause: float, placements: list
) -> Iterator[np.ndarray]:
    """A chapter's samples from its stored chunks, block by block: the chunks of a paragraph joined by a crossfade
    (rvqtts.support.audio.StreamJoiner, as a long line's chunks are), a pause of silence between paragraphs. Each
    chunk's (chunk, start, end) in seconds is appended to `placements`."""
    silence = np.zeros(int(round(paragraph_pause * sample_rate)), dtype=np.float32)
    position = 0
    paired = list(zip(plan.chunks, keys))
    for index, (_, group) in enumerate(groupby(paired, key=lambda pair: pair[0].paragraph)):
        if index:
            yield silence
            position += silence.size
        joiner, joined = StreamJoiner(sample_rate), 0
        for chunk, key in group:
            samples = store.samples(key)
            overlap = min(joiner.overlap, joined, samples.size)
            start = position + joined - overlap
            placements.append((chunk, start / sample_rate, (start + samples.size) / sample_rate))
            joined += samples.size - overlap
            yield joiner.add(samples, new_part=True)
        yield joiner.finish()
        position += joined
