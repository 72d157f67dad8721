"""Where the drafting commands' frames come from: recorded contexts, recordings (teacher forcing), or
texts the model speaks; and the offsets they draft with."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rvqtts.cli.common import fail, progress_bar, refused, say

TEXTS_HELP = (
    "Texts to synthesize and record (.txt, or .jsonl with text and the voice fields of rvqtts synth -f: speaker, "
    "language, instruct, ref_audio, ref_text, x_vector_only, voice)."
)
SPEAKER_HELP = "speaker of lines that name none (CustomVoice models; default vivian)."
INSTRUCT_HELP = "instruction of lines that name none (VoiceDesign models need one; the 1.7B CustomVoice takes a style)."
VOICE_HELP = (
    "on a Base model, the cloned voice of lines that name none, a voice file (rvqtts synth --ref-audio FILE --ref-text "
    "TEXT --save-voice VOICE)."
)
CONTEXTS_HELP = "Recorded frames: a contexts .npz (h_t, codes, language), as rvqtts standin build writes."
SPLIT_HELP = "The split of a contexts file that has splits (calibration or evaluation)."


def check_source(
    texts: Optional[Path], contexts: Optional[Path], audio: Optional[Path] = None, audio_allowed: bool = False
) -> None:
    if sum(source is not None for source in (texts, contexts, audio)) != 1:
        fail(
            "give one data source: --texts FILE (synthesize and record), --contexts FILE (recorded frames)"
            + (" or --audio FILE.jsonl (recordings and transcripts)" if audio_allowed else "")
        )


def recorded_frames(
    synthesizer,
    texts: Optional[Path],
    contexts: Optional[Path],
    split: str,
    speaker: Optional[str],
    language: str,
    seed: int,
    quiet: bool,
    audio: Optional[Path] = None,
    instruct: Optional[str] = None,
    voice: Optional[Path] = None,
):
    """Frames from a contexts file, from recordings by teacher forcing, or recorded by synthesizing a text
    file with the plain inner loop (in each line's voice, else the one given: `speaker`, `instruct`, or
    a Base model's `voice` file)."""
    from rvqtts.qwen.cloning import VoiceSource
    from rvqtts.synthesis.batch_files import read_batch
    from rvqtts.synthesis.settings import GenerationSettings, Line
    from rvqtts.tuning.contexts import (
        ContextsFileError,
        force_contexts,
        load_contexts,
        read_audio_pairs,
        record_contexts,
    )

    config = synthesizer.code_predictor.config
    if contexts is not None:
        with refused(ContextsFileError):
            return load_contexts(contexts, split, synthesizer.talker.config.hidden_size, config.num_code_groups)
    clone = None if voice is None else VoiceSource(voice=voice)
    defaults = Line(
        speaker=speaker, language=language, instruct=instruct, seed=seed, settings=GenerationSettings(), clone=clone
    )
    source = audio if audio is not None else texts
    with refused(ValueError):  # ContextsFileError, BatchFileError
        pairs = read_audio_pairs(audio) if audio is not None else None
        lines = [pair.line for pair in pairs] if pairs else read_batch(texts)
    for line in lines:
        with refused(ValueError, prefix=f"{source}:{line.utterance}: "):
            synthesizer.voiced(line.under(defaults))
    with progress_bar(quiet) as progress:
        task = progress.add_task(f"{'teacher forcing' if pairs else 'synthesizing'} {source.name}", total=len(lines))
        done = lambda done, total: progress.update(task, completed=done)  # noqa: E731
        frames = (
            force_contexts(synthesizer, pairs, defaults, done)
            if pairs
            else record_contexts(synthesizer, lines, defaults, done)
        )
    say(f"recorded {len(frames)} frames from {len(lines)} {'recordings' if pairs else 'texts'}", quiet)
    return frames


def drafting_offsets(synthesizer, offsets: Optional[Path], depth: int):
    """Offsets [K, H] from a file, or zeros (reused heads)."""
    from rvqtts.engine.speculative.offsets import Offsets, OffsetsFileError, load_offsets, predictor_fingerprint

    if offsets is None:
        return Offsets.zeros(depth, synthesizer.hidden_size)
    with refused(OffsetsFileError):
        return load_offsets(
            offsets, hidden_size=synthesizer.hidden_size, fingerprint=predictor_fingerprint(synthesizer.code_predictor)
        )
