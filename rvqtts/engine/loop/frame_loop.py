"""The frame loop: per 80 ms frame, one talker call that scores c0, then the inner loop's c1..c15, for B utterances at
once (one: B = 1), a row per utterance in every call; a row whose utterance ends takes the next one (continuous
batching). Every code is drawn with keyed noise and every row computes what it computes alone, so an utterance's
codes do not depend on the lines before it or beside it. It reports each frame, each chunk and each utterance as
they end; the caller decodes audio. docs/engine.md, "Where it sits in qwen-tts" and "Several utterances at once"."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Iterator

import numpy as np
import torch

from rvqtts.engine.loop.inner_loop import LoopParts, count_frame, inner_frames
from rvqtts.engine.model.devices import synchronize
from rvqtts.engine.model.sampling import (
    C0Rules,
    FrameSampling,
    NonFiniteError,
    RowSampling,
    SamplingConfig,
    draw_checked,
    gumbel_noise,
    residual_noise,
)
from rvqtts.engine.model.talker import Prompt, TalkerRunner
from rvqtts.engine.speculative.rounds import FrameRounds
from rvqtts.engine.speculative.speculation import LoopStats


class Stopped(Exception):
    """The utterance was stopped by its caller (a client gone): its row is free from the next frame."""


def _never_stopped() -> bool:
    return False


@dataclass
class WorkSeconds:
    """Where an utterance's time went in the frame loop: its shares of the talker's and the inner loop's calls, and
    its first chunk's prefill (within the talker's)."""

    talker: float = 0.0
    predictor: float = 0.0
    prefill: float = 0.0


@dataclass
class Work:
    """One utterance: its seed and number (its noise keys: rows of different seeds share calls), its chunks as
    (prompt, frame limit) pairs made when its row reaches them (an exception there fails the utterance alone), its
    sampling (rows sampled differently share calls), and what the loop counted. `forced` [frames, G]: teacher forcing
    (c0 read instead of drawn, c1.. too, one chunk); `on_frame` is shown each frame's predictor prefix [h_t,
    embedding of c0] and codes c1.. ; `stopped` is asked before each frame (true: the row is let go, WorkFailed with
    Stopped)."""

    seed: int
    utterance: int
    chunks: Iterator[tuple[Prompt, int]]
    sampling: FrameSampling
    forced: np.ndarray | None = None
    on_frame: Callable[[torch.Tensor, list[int]], None] | None = None
    stopped: Callable[[], bool] = _never_stopped
    frame: int = 0  # frames spoken so far, across chunks
    talker_calls: int = 0
    stats: LoopStats = field(default_factory=LoopStats)
    frames_by_budget: dict[int, int] = field(default_factory=dict)  # its frames by the online tree size
    seconds: WorkSeconds = field(default_factory=WorkSeconds)

    def spent(self, talker: float = 0.0, predictor: float = 0.0, talker_calls: int = 0) -> None:
        """Its share of a frame's calls: the loop's one place for time and calls (frames share calls)."""
        self.seconds.talker += talker
        self.seconds.predictor += predictor
        self.talker_calls += talker_calls

    def inner_frame(self, frame: FrameRounds) -> None:
        """A frame's inner loop counted: calls, codes and accepted drafts, and the tree size it ran by."""
        count_frame(self.stats, frame)
        if frame.budget is not None:
            self.frames_by_budget[frame.budget] = self.frames_by_budget.get(frame.budget, 0) + 1


@dataclass
class FrameDone:
    work: Work
    codes: np.ndarray  # [G], c0 first


@dataclass
class FrameEnd:
    """Every row's frame of this call has been reported (FrameDone), before the talker's next step: where a caller
    decodes the rows' pieces together."""


@dataclass
class ChunkDone:
    work: Work
    frames: list[np.ndarray]
    cut: bool  # stopped at its frame limit (the model did not end its speech)
    frame_limit: int


@dataclass
class WorkDone:
    work: Work


@dataclass
class WorkFailed:
    work: Work
    error: Exception


Event = FrameDone | FrameEnd | ChunkDone | WorkDone | WorkFailed  # what the frame loop reports


@dataclass
class _Row:
    """A talker row at work: the chunk being spoken and the state between its frames."""

    work: Work
    prompt: Prompt
    frame_limit: int
    seen: torch.Tensor  # c0 ids drawn in this chunk (the repetition penalty's history)
    hidden: torch.Tensor
    logits: torch.Tensor
    noise: torch.Tensor  # the next frame's residual noise (`FrameLoop.next_noise`)
    frames: list[np.ndarray] = field(default_factory=list)


class FrameLoop:
    """Speaks utterances `rows` at a time over one talker runner and the inner loop's parts: a code predictor
    runner, the speculation and offsets and the calls it makes through (static calls replay the shapes of one row;
    a batch's run eagerly), or a Core ML package's fused calls for one row."""

    def __init__(self, talker: TalkerRunner, parts: LoopParts, eos_id: int, rows: int = 1):
        if rows < 1:
            raise ValueError(f"a batch needs at least one row, got {rows}")
        if parts.fused is not None and rows > 1:
            raise ValueError("a Core ML package's fused calls carry one frame: speak its lines one at a time")
        self.talker, self.parts, self.eos_id = talker, parts, eos_id
        self.rows, self.speculation = rows, parts.speculation
        self._rules: dict[float, C0Rules] = {}  # by repetition penalty

    def run(self, works: Iterable[Work | None], joins_per_frame: int | None = None) -> Iterator[Event]:
        """Speak every utterance, each as soon as a row is free; report each frame, and each chunk and each
        utterance as it ends, or its failure (its text, its voice, or NaN or inf in its logits: NonFiniteError), which
        frees its row and leaves the others' codes as they are; after each frame's rows, FrameEnd. `works` may be a
        live source: None from it means none is waiting now (the rows speak on; with none at work, it is asked again,
        so it should wait for work then). `joins_per_frame`: at most this many utterances start before each frame
        (None: as many as there are free rows), so that a burst's first ones are heard after their own prefills and
        a frame, not after every other's prefill (a server's first audio)."""
        if joins_per_frame is not None and joins_per_frame < 1:
            raise ValueError(f"at least one utterance must start before a frame, got joins_per_frame {joins_per_frame}")
        waiting = iter(works)
        rows: list[_Row | None] = [None] * self.rows
        ended = False
        while True:
            joins = self.rows if joins_per_frame is None else joins_per_frame
            for slot in range(self.rows):
                while rows[slot] is None and not ended and joins > 0:
                    work = next(waiting, _END)
                    ended = work is _END
                    if work is None or ended:
                        break
                    joins -= 1
                    yield from self._next_chunk(rows, slot, work)
            if any(rows):
                yield from self._frame(rows)
            elif ended:
                return

    def rules(self, sampling: FrameSampling) -> C0Rules:
        """The processors of c0's draw under `sampling` (made once per repetition penalty)."""
        penalty = sampling.repetition_penalty
        if penalty not in self._rules:
            self._rules[penalty] = C0Rules(self.talker.vocab_size, self.eos_id, penalty, self.talker.device)
        return self._rules[penalty]

    def _frame(self, rows: list[_Row | None]) -> Iterator[Event]:
        """One frame of every row: c0 drawn per row, c1.. of all rows in one inner loop, then one talker
        step for the rows that go on."""
        started = time.perf_counter()
        ready = yield from self._draw_c0s(rows)
        if not ready:
            return
        codes0 = torch.tensor([c0 for _, c0 in ready], device=self.talker.device)
        embeddings = [self.talker.code_embedding(codes0[i : i + 1]) for i in range(len(ready))]
        prefixes = torch.stack([torch.cat([rows[slot].hidden[None], e]) for (slot, _), e in zip(ready, embeddings)])
        between = time.perf_counter()
        ready, prefixes, rests = yield from self._inner_codes(rows, ready, prefixes)
        if not ready:
            return
        synchronize(self.talker.device)
        shares = ((between - started) / len(ready), (time.perf_counter() - between) / len(ready))
        going_on = yield from self._commit(rows, list(zip(ready, rests, prefixes)), shares)
        if going_on:
            self._step_talker(rows, going_on)

    def _draw_c0s(self, rows: list[_Row | None]) -> Generator[Event, None, list[tuple[int, int]]]:
        """c0 of every row's frame; returns (slot, c0) of the rows that go on. A row stopped by its caller or whose
        logits are not finite is let go; a row that drew the end of speech ends its chunk."""
        ready = []
        for slot, row in enumerate(rows):
            if row is None:
                continue
            if row.work.stopped():
                rows[slot] = None
                yield WorkFailed(row.work, Stopped("stopped by its caller"))
                continue
            try:
                c0 = self._c0(row)
            except NonFiniteError as error:  # this row's logits: it fails alone
                rows[slot] = None
                yield WorkFailed(row.work, error)
                continue
            if c0 == self.eos_id:
                yield from self._end_chunk(rows, slot, cut=False)
            else:
                ready.append((slot, c0))
        return ready

    def _c0(self, row: _Row) -> int:
        """The row's c0: read under teacher forcing, else drawn from its logits."""
        work = row.work
        if work.forced is not None:
            return int(work.forced[len(row.frames), 0])
        keys = (work.seed, work.utterance, work.frame)
        return draw_c0(self.rules(work.sampling), work.sampling.talker, row.logits, row.seen, len(row.frames), *keys)

    def _inner_codes(
        self, rows: list[_Row | None], ready: list[tuple[int, int]], prefixes: torch.Tensor
    ) -> Generator[Event, None, tuple[list[tuple[int, int]], torch.Tensor, list[list[int]]]]:
        """c1.. of the ready rows' frames (`prefixes` [n, 2, hidden]), with the rows and prefixes they belong to:
        rows whose inner loop met NaN or inf fail alone, and the others' frame runs again, the codes it gave them."""
        try:
            return ready, prefixes, self._inner_loop(prefixes, [rows[slot] for slot, _ in ready])
        except NonFiniteError as error:
            fault = error
        failed = set(range(len(ready)) if fault.rows is None else fault.rows)
        for i in sorted(failed):
            slot = ready[i][0]
            yield WorkFailed(rows[slot].work, fault)
            rows[slot] = None
        kept = [i for i in range(len(ready)) if i not in failed]
        if not kept:
            return [], prefixes, []
        ready, prefixes = [ready[i] for i in kept], prefixes[kept]
        return ready, prefixes, self._inner_loop(prefixes, [rows[slot] for slot, _ in ready])

    def _commit(
        self, rows: list[_Row | None], done: list[tuple[tuple[int, int], list[int], torch.Tensor]], shares: tuple
    ) -> Generator[Event, None, dict[int, torch.Tensor]]:
        """Each ready row's frame kept and reported, then FrameEnd, then the chunks cut at their frame limits ended (the
        next chunk's prefill after every row's frame is heard); `shares`: each row's
        (talker, predictor) seconds of the frame. Returns the talker's next input of each row that goes on, by slot."""
        going_on, cut = {}, []
        newest_first = sorted(done, key=lambda one: rows[one[0][0]].work.frame)
        for (slot, c0), rest, prefix in newest_first:  # a first piece of audio is not kept waiting behind later ones
            row = rows[slot]
            row.work.spent(*shares)
            if row.work.on_frame:
                row.work.on_frame(prefix, rest)
            codes = np.array([c0, *rest], dtype=np.int64)
            row.frames.append(codes)
            row.seen[c0] = True
            row.work.frame += 1
            yield FrameDone(row.work, codes)
            if len(row.frames) >= row.frame_limit:
                cut.append(slot)
            else:
                text = row.prompt.text_after(len(row.frames) - 1)
                going_on[slot] = self.talker.frame_input(torch.from_numpy(codes).to(self.talker.device), text)
        yield FrameEnd()
        for slot in cut:
            yield from self._end_chunk(rows, slot, cut=True)
        return going_on

    def _step_talker(self, rows: list[_Row | None], going_on: dict[int, torch.Tensor]) -> None:
        """One talker step of the rows that go on (`going_on`: each one's input [1, hidden] by slot), their next
        frame's noise made while it runs."""
        stepping = sorted(going_on)
        begun = time.perf_counter()
        positions = [rows[s].prompt.length + len(rows[s].frames) - 1 for s in stepping]
        hidden, logits = self.talker.step_rows(torch.cat([going_on[s] for s in stepping]), positions, stepping)
        for slot in stepping:
            rows[slot].noise = self.next_noise(rows[slot].work)
        synchronize(self.talker.device)
        spent = (time.perf_counter() - begun) / len(stepping)
        for i, slot in enumerate(stepping):
            row = rows[slot]
            row.hidden, row.logits = hidden[i], logits[i]
            row.work.spent(talker=spent, talker_calls=1)

    def _inner_loop(self, prefixes: torch.Tensor, ready: list[_Row]) -> list[list[int]]:
        """c1.. of every ready row's frame: recorded ones under teacher forcing, a Core ML package's fused calls,
        or the inner loop's shared calls (rvqtts.engine.loop.inner_loop.inner_frames); counted per utterance."""
        works = [row.work for row in ready]
        if works[0].forced is not None:  # teacher forcing runs alone
            return [[int(c) for c in row.work.forced[len(row.frames), 1:]] for row in ready]
        runner, fused = self.parts.runner, self.parts.fused
        noise = torch.stack([row.noise for row in ready])
        if fused is not None:
            if works[0].sampling.predictor != fused.sampling:
                raise ValueError(
                    f"the Core ML package samples with {fused.sampling}, but this frame asks for "
                    f"{works[0].sampling.predictor}: export a package for these settings"
                )
            run = fused.frame if self.speculation else fused.plain_frame
            frames = [run(prefixes[0], noise[0].to(fused.device))]
        else:
            frames = inner_frames(
                runner,
                prefixes.to(runner.device),
                noise.to(runner.device),
                RowSampling.of([work.sampling.predictor for work in works], runner.device),
                self.speculation,
                self.parts.offsets,
                self.parts.calls,
            )
        for work, frame in zip(works, frames):
            work.inner_frame(frame)
        return [frame.codes for frame in frames]

    def _end_chunk(self, rows: list[_Row | None], slot: int, cut: bool) -> Iterator[Event]:
        row = rows[slot]
        rows[slot] = None
        yield ChunkDone(row.work, row.frames, cut, row.frame_limit)
        yield from self._next_chunk(rows, slot, row.work)

    def _next_chunk(self, rows: list[_Row | None], slot: int, work: Work) -> Iterator[WorkDone | WorkFailed]:
        """Start the utterance's next chunk in row `slot` (its prefill), or report the utterance ended."""
        try:
            chunk = next(work.chunks, None)
        except Exception as error:  # this utterance's text or voice: it fails alone
            yield WorkFailed(work, error)
            return
        if chunk is None:
            yield WorkDone(work)
            return
        prompt, frame_limit = chunk
        begun = time.perf_counter()
        self.talker.reserve(prompt.length + frame_limit, self.rows)  # room for every step at once
        hidden, logits = self.talker.prefill(prompt.embeds, row=slot)
        noise = self.next_noise(work)
        synchronize(self.talker.device)
        spent = time.perf_counter() - begun
        work.spent(talker=spent, talker_calls=1)
        if work.frame == 0:
            work.seconds.prefill = spent
        seen = torch.zeros(self.talker.vocab_size, dtype=torch.bool, device=self.talker.device)
        rows[slot] = _Row(work, prompt, frame_limit, seen, hidden, logits, noise)

    def next_noise(self, work: Work) -> torch.Tensor:
        """The noise of the utterance's next frame's residual codes [G-1, V] (on the CPU): made while the device
        runs the talker call that comes before that frame, not after the c0 draw that waits for it."""
        tables = self.talker.predictor_embeddings  # c1..c_{G-1}'s: the noise's shape
        return residual_noise(work.seed, work.utterance, work.frame, len(tables) + 1, tables[0].num_embeddings)


_END = object()  # the source of works is spent


def draw_c0(
    rules: C0Rules,
    sampling: SamplingConfig,
    logits: torch.Tensor,
    seen: torch.Tensor,
    draws: int,
    seed: int,
    utterance: int,
    frame: int,
) -> int:
    """c0 of an utterance's frame: qwen-tts's processors and warpers over the talker's logits [vocab], then
    the Gumbel-max draw with the noise of (seed, utterance, frame, position 0)."""
    noise = gumbel_noise(seed, utterance, frame, [0], logits.shape[-1])[0]
    code, finite = draw_checked(rules.scores(logits, seen, draws), torch.from_numpy(noise).to(logits.device), sampling)
    if not bool(finite):
        raise NonFiniteError("talker", logits.dtype)
    return int(code)
