"""Speaking lines: each line's text in chunks, each chunk's prompt, the frame loop over B rows
(rvqtts.engine.loop.frame_loop) and the codec's audio; a line's samples ready as its frames (streamed) or chunks
(offline) end, then its Synthesis with the statistics users see. `Synthesizer.stream`, `synthesize` and
`synthesize_many` all speak through `speak`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Iterator

import numpy as np
import torch

from rvqtts.engine.loop.frame_loop import ChunkDone, Event, FrameDone, FrameEnd, FrameLoop, Work, WorkFailed
from rvqtts.engine.model.speech_decoder import StreamingDecoder, push_together
from rvqtts.engine.model.talker import Prompt
from rvqtts.engine.speculative.policy import tree_nodes
from rvqtts.engine.speculative.speculation import DEFAULT_DEPTH
from rvqtts.qwen.cloning import ClonedVoice
from rvqtts.qwen.codec import StreamPacing
from rvqtts.support.audio import StreamJoiner
from rvqtts.support.stretch import TimeStretch, time_stretched
from rvqtts.synthesis.batch_size import fitting_rows, row_bytes, rows_invariant
from rvqtts.synthesis.settings import Line, LineTimings, Synthesis
from rvqtts.synthesis.speech_model import SpeechModel
from rvqtts.synthesis.text import FRAMES_PER_SECOND, chunk_text, frame_limit

PROMPT_TOKENS = 64  # a prompt's tokens besides its text's (roles, codec tags, speaker), generously


def speak(
    synth: SpeechModel,
    lines: Iterable[Line | None],
    chunk_chars: float | None,
    rows: int = 1,
    on_chunk: Callable[[int, int], None] | None = None,
    on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
    stopped: Callable[[int], bool] | None = None,
    joins_per_frame: int | None = None,
    between_frames: Callable[[int], None] | None = None,
) -> Iterator[tuple[int, np.ndarray | Synthesis | Exception]]:
    """Speak `lines` (each whole: its seed, utterance and settings set, as `Line.under` fills them), `rows` at a time
    (rvqtts.engine.loop.frame_loop), text chunk after text chunk, each line as soon as a row is free.
    `lines` may be a live source (a server's requests): None from it means none is waiting now. Yields (index
    among the lines, item) as it goes: a line's samples ready to play (paced by its `stream`, and
    decoded incrementally by the streaming decoder, the pieces due at a frame in one pass; or, not streamed, each text
    chunk at once, `decode`), then its
    Synthesis; or, for a line whose voice, text or decoding fails, or that `stopped(index)` stops (asked every
    frame; rvqtts.engine.loop.frame_loop.Stopped), or whose logits went NaN or inf (NonFiniteError), the exception, and
    no more of it. `joins_per_frame`: at most this many lines start before each frame (FrameLoop.run).
    `between_frames(rows)` runs once after each frame, its rows' pieces handed on, with how many rows made one."""
    loop = synth.runners.frame_loop(rows)
    depth = loop.speculation.offsets.depth if loop.speculation else DEFAULT_DEPTH

    def spoken(index: int, line: Line) -> _Spoken:  # made as its row takes it: its clock starts there
        sampling, pacing = synth.sampling(line.settings), line.stream
        state = _Spoken(line.seed, line.utterance, iter(()), sampling, on_frame=on_frame, index=index, pacing=pacing)
        state.stats.accepted_per_depth = [0] * depth
        state.joiner = StreamJoiner(synth.sample_rate)
        state.decoder = synth.codec.streaming_decoder() if state.pacing else None
        state.speed = line.settings.speed or 1.0
        state.stretch = TimeStretch(state.speed, synth.sample_rate) if state.pacing and state.speed != 1 else None
        state.chunks = line_prompts(synth, line, state, chunk_chars)
        state.stopped = lambda: state.failed or (stopped is not None and stopped(index))
        return state

    def states() -> Iterator[_Spoken | None]:
        index = 0
        for line in lines:
            if line is None:
                yield None
            else:
                yield spoken(index, line)
                index += 1

    due: list[_Spoken] = []  # streamed lines whose piece is decoded at the frame's end, with the other rows'
    for event in hooked(loop.run(states(), joins_per_frame), between_frames):
        if due and not isinstance(event, FrameDone):
            for state, samples in due_pieces(synth, due):
                yield from guarded(state, piece_played(state, samples))
            due = []
        if isinstance(event, FrameEnd) or event.work.failed:  # a failed line's other chunks are not heard
            continue
        state = event.work
        yield from guarded(state, heard(synth, state, event, loop, on_chunk))
        if isinstance(event, FrameDone) and state.pacing:
            if len(state.pending) == state.pacing.due(state.seconds.first_audio is not None):
                due.append(state)


def hooked(events: Iterator[Event], between_frames: Callable[[int], None] | None) -> Iterator[Event]:
    """The frame loop's events, `between_frames(rows)` run once each frame's end has been handled (its pieces
    handed on), with how many rows made that frame."""
    rows = 0
    for event in events:
        yield event
        if isinstance(event, FrameEnd) and between_frames is not None:
            between_frames(rows)
        rows = 0 if isinstance(event, FrameEnd) else rows + isinstance(event, FrameDone)


def guarded(state: _Spoken, items: Iterator) -> Iterator[tuple[int, np.ndarray | Synthesis | Exception]]:
    """A line's items with its index; an exception raised while they are made ends them: the line fails alone."""
    try:
        for item in items:
            yield state.index, item
    except Exception as error:
        state.failed = True
        yield state.index, error


def piece_played(state: _Spoken, samples: np.ndarray | Exception) -> Iterator[np.ndarray]:
    """A line's piece decoded at a frame's end (`due_pieces`) as it is played, or its decoding's failure raised."""
    if isinstance(samples, Exception):
        raise samples
    yield played(state, ready_audio(state, samples))


def due_pieces(synth: SpeechModel, due: list[_Spoken]) -> Iterator[tuple[_Spoken, np.ndarray | Exception]]:
    """The pieces due at a frame's end, each line's decoded samples or its decoding's failure: the lines with as many
    pending frames in one pass (rvqtts.engine.model.speech_decoder.push_together), the first pieces (one frame) first as
    the rows report newest first. A pass that fails left its lines as they were: each is decoded again alone, so that
    only a line whose own decoding fails, fails."""
    groups: dict[int, list[_Spoken]] = {}
    for state in due:
        groups.setdefault(len(state.pending), []).append(state)
    for group in groups.values():
        try:
            outcomes: list = decoded(synth, group)
        except Exception as error:
            outcomes = [error]
        if len(outcomes) < len(group):  # outside the handler: the lines' own errors do not chain this pass's
            for state in group:
                yield from due_pieces(synth, [state])
        else:
            yield from zip(group, outcomes)


def heard(
    synth: SpeechModel, state: _Spoken, event: Event, loop: FrameLoop, on_chunk: Callable[[int, int], None] | None
) -> Iterator[np.ndarray | Synthesis]:
    """What a frame loop event gives its line: a frame's codes kept (a streamed line's piece, once due, is decoded at
    the frame's end: `due_pieces`), a chunk's end (its pending samples; a cut one said in its warnings), or, at its
    end, its last samples and its Synthesis; its failure raised."""
    if isinstance(event, WorkFailed):
        raise event.error
    if isinstance(event, FrameDone):
        state.pending.append(event.codes)
    elif isinstance(event, ChunkDone):
        if state.pending:
            yield played(state, ready_audio(state, decoded(synth, [state])[0]))
        state.frames.extend(event.frames)
        state.chunk_start, state.chunks_done = True, state.chunks_done + 1
        if event.cut:
            piece, limit = state.pieces[state.chunks_done - 1], event.frame_limit
            state.warnings.append(
                f"chunk {state.chunks_done} of {len(state.pieces)} was cut at {limit} frames "
                f"({limit / FRAMES_PER_SECOND:.1f} s) for {len(piece)} characters: the model did not end "
                f"its speech (text: {piece[:40]!r})"
            )
        if on_chunk:
            on_chunk(state.chunks_done, len(state.pieces))
    else:
        yield played(state, state.joiner.finish(), last=True)
        yield finished(synth, state, loop)


def line_prompts(synth, line: Line, state: _Spoken, chunk_chars: float | None) -> Iterator[tuple[Prompt, int]]:
    """The line's prompts, one per text chunk, with their frame limits (its voice checked when it starts),
    the streaming decoder primed for each."""
    if not line.text.strip():
        raise ValueError("the text is empty: give something to say")
    line = synth.voiced(line)
    state.clone, state.pieces = line.clone, text_pieces(line.text, chunk_chars)
    for piece in state.pieces:
        begun = time.perf_counter()
        if state.decoder:
            synth.codec.start(state.decoder, line.clone)
            state.seconds.decoder += time.perf_counter() - begun  # a new voice's reference: decoded once
        begun = time.perf_counter()
        prompt = synth.prompt(piece, line.speaker, line.language, line.instruct, line.clone)
        state.seconds.prompts += time.perf_counter() - begun
        if state.seconds.prompt is None:  # the first chunk's, before any audio
            state.seconds.prompt = state.seconds.prompts
        yield prompt, frame_limit(piece, line.settings.max_frames, synth.default_max_frames)


def played(state: _Spoken, samples: np.ndarray, last: bool = False) -> np.ndarray:
    """A line's samples as they are played: at its speed, what the stretch has made of them so far (after the `last`,
    its rest too; kept, the line's audio); at speed 1 the samples themselves. Its first audio is timed here."""
    if state.stretch is not None:
        samples = state.stretch.push(samples)
        samples = np.concatenate([samples, state.stretch.finish()]) if last else samples
        state.played.append(samples)
    if samples.size and state.seconds.first_audio is None:  # its parts in wall time: the frames' take in the rest
        seconds = state.seconds
        seconds.first_audio = time.perf_counter() - state.started
        prefill = seconds.prompt + seconds.prefill
        seconds.first_audio_split = {
            "prefill": round(prefill, 3),
            "frames": round(seconds.first_audio - prefill - seconds.decoder, 3),
            "decoder": round(seconds.decoder, 3),
        }
    return samples


def decoded(synth: SpeechModel, states: list[_Spoken]) -> list[np.ndarray]:
    """The lines' pending frames decoded (streamed lines: their incremental decoders in one pass, so as many frames
    each; else a line's chunk at once), each line charged its share of the time; their pending frames taken only once
    all are decoded."""
    begun = time.perf_counter()
    if states[0].decoder:
        codes = np.stack([np.stack(state.pending) for state in states])
        samples = push_together([state.decoder for state in states], codes)
    else:
        samples = [synth.codec.decode(np.stack(state.pending), state.clone) for state in states]
    share = (time.perf_counter() - begun) / len(states)
    for state in states:
        state.pending = []
        state.seconds.decoder += share
    return samples


def ready_audio(state: _Spoken, samples: np.ndarray) -> np.ndarray:
    """A line's decoded samples joined to what came before it: the samples ready to play (at speed 1)."""
    ready = state.joiner.add(samples, new_part=state.chunk_start)
    state.chunk_start = False
    return ready


def finished(synth: SpeechModel, state: _Spoken, loop: FrameLoop) -> Synthesis:
    """The Synthesis of a line `speak` finished. Its loops' seconds are its shares of the calls it was in;
    building its prompts counts as talker work, and the first one in the prefill."""
    seconds = state.seconds
    seconds.wall = time.perf_counter() - state.started
    seconds.talker += seconds.prompts
    seconds.prefill += seconds.prompt
    speculation = loop.speculation
    if state.stretch:  # streamed at a speed: the pieces as played (the whole's stretch, sample for sample)
        audio = np.concatenate(state.played)
    else:
        audio = time_stretched(state.joiner.audio(), state.speed, synth.sample_rate)
    return Synthesis(
        audio=audio,
        sample_rate=synth.sample_rate,
        codes=np.stack(state.frames),
        stats=state.stats,
        seconds=seconds,
        talker_calls=state.talker_calls,
        chunks=len(state.pieces),
        spec=speculation is not None,
        tree_nodes=tree_nodes(speculation),
        seed=state.seed,
        sampling=state.sampling.record(),
        warnings=state.warnings,
        stream=state.pacing,
        weights=synth.weights,
        engine=synth.engine_record(),
        batch_rows=loop.rows,
        batch_row_bytes=row_bytes(synth, synth.runners.talker().max_len) if loop.rows > 1 else None,
        online=speculation.record(state.frames_by_budget) if speculation else None,
    )


def one_line(
    synth: SpeechModel,
    line: Line,
    chunk_chars: float | None,
    on_chunk: Callable[[int, int], None] | None,
    on_frame: Callable[[torch.Tensor, list[int]], None] | None,
) -> Generator[np.ndarray, None, Synthesis]:
    """One line's samples as `speak` makes them ready, then its Synthesis (its failure raised)."""
    for _, item in speak(synth, [line], chunk_chars, 1, on_chunk, on_frame):
        if isinstance(item, Exception):
            raise item
        if isinstance(item, Synthesis):
            return item
        yield item


def row_slots(synth: SpeechModel, line: Line, chunk_chars: float | None) -> int:
    """A generous count of the talker positions a line's longest chunk takes: its frame limit, two
    prompt tokens per character and the prompt's own, and an ICL voice's reference codes."""
    pieces = text_pieces(line.text, chunk_chars) or [line.text]
    reference = len(line.clone.codes) if isinstance(line.clone, ClonedVoice) and line.clone.icl else 0
    limits = [frame_limit(piece, line.settings.max_frames, synth.default_max_frames) for piece in pieces]
    return max(limit + 2 * len(piece) for limit, piece in zip(limits, pieces)) + PROMPT_TOKENS + reference


def batch_rows(
    synth: SpeechModel,
    lines: list[Line],
    chunk_chars: float | None,
    batch_size: int,
    on_notice: Callable[[str], None] | None,
) -> int:
    """The rows `lines` are spoken in: at most `batch_size`, cut to the rows whose caches fit in memory
    (rvqtts.synthesis.batch_size.fitting_rows), said through `on_notice`, as is a batch whose kernels are not known to
    keep rows invariant."""
    if synth.runners.inner_parts().runner is None:  # a Core ML package's calls carry one frame
        return 1
    rows = min(batch_size, max(len(lines), 1))
    if rows > 1:
        slots = max(row_slots(synth, line, chunk_chars) for line in lines)
        fitting = fitting_rows(synth, rows, slots)
        if fitting < rows and on_notice:
            on_notice(
                f"a batch of {rows} rows would hold {rows * row_bytes(synth, slots) / 2**30:.1f} GiB of "
                f"caches, more than half the memory free: speaking {fitting} at a time"
            )
        rows = fitting
        if rows > 1 and on_notice and not rows_invariant(synth):
            on_notice(
                "the kernels here are not known to keep rows invariant: a batched line's audio can "
                "differ from its one-line run's in the last bits (--batch-size 1 keeps them)"
            )
    return rows


def text_pieces(text: str, chunk_chars: float | None) -> list[str]:
    """The pieces a text is spoken in: sentence chunks of at most `chunk_chars`, or (None) the whole text."""
    return chunk_text(text, chunk_chars) if chunk_chars else [" ".join(text.split())]


@dataclass
class _Spoken(Work):
    """A line as `speak` speaks it: the frame loop's utterance (rvqtts.engine.loop.frame_loop.Work) and what the
    pipeline gathers for it while its chunks are spoken."""

    index: int = 0  # among `speak`'s lines
    pacing: StreamPacing | None = None  # streamed: how its pieces come
    started: float = field(default_factory=time.perf_counter)
    joiner: StreamJoiner | None = None
    speed: float = 1.0  # its audio played this many times faster, its pitch kept
    stretch: TimeStretch | None = None  # streamed at a speed other than 1: the pieces' stretch
    played: list[np.ndarray] = field(default_factory=list)  # the stretched pieces, in order
    decoder: StreamingDecoder | None = None  # streamed: the incremental decoder
    clone: ClonedVoice | None = None  # its voice, encoded
    pieces: list[str] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)  # spoken, chunk by chunk
    pending: list[np.ndarray] = field(default_factory=list)  # frames not decoded yet
    chunk_start: bool = True  # the next samples start a text chunk
    warnings: list[str] = field(default_factory=list)
    chunks_done: int = 0
    failed: bool = False  # the rest of its events are not heard
    seconds: LineTimings = field(default_factory=LineTimings)
