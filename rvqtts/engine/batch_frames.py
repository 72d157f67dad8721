"""The frame loop over several utterances at once: every talker step and every predictor call carries a
row per utterance, and a row whose utterance ends takes the next one (continuous batching).

On a CPU a call of either loop costs about what reading its weights costs, whatever its few rows, so
B utterances in one call cost little more than one (docs/benchmarks.md). Each utterance keeps its own
talker cache region (rvqtts.engine.talker), positions, text stream, c0 history and end; all rows' frames share
the inner loop's calls, plain or by tree rounds (rvqtts.engine.rounds). Every code is drawn
with the noise of its own (seed, utterance, frame, position), and every row's arithmetic is the one it
gets alone (row-invariant kernels, attention over its own slots), so an utterance's codes are the ones
a one-utterance run gives it (rvqtts.engine.frame_loop), wherever its rows are then.

An utterance is a sequence of text chunks, spoken one after another in its row (frames numbered across
them, as in one-utterance runs). The loop reports each chunk as it ends and each utterance as it ends or
fails; the caller decodes audio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch

from rvqtts.engine.devices import synchronize
from rvqtts.engine.frame_loop import draw_c0
from rvqtts.engine.inner_loop import count_frame, inner_frames
from rvqtts.engine.online import OnlineSpeculation
from rvqtts.engine.predictor import PredictorRunner
from rvqtts.engine.sampling import C0Rules, SamplingConfig, residual_noise
from rvqtts.engine.speculation import LoopStats, Speculation
from rvqtts.engine.talker import TalkerRunner
from rvqtts.prompt import Prompt


@dataclass
class Work:
    """One utterance of a batch: its seed and number (its noise keys: rows of different seeds share calls), its
    chunks as (prompt, frame budget) pairs made when its row reaches them (an exception there fails the
    utterance alone), and what the loop counted."""

    seed: int
    utterance: int
    chunks: Iterator[tuple[Prompt, int]]
    tag: object = None  # the caller's handle
    frame: int = 0  # frames spoken so far, across chunks
    talker_calls: int = 0
    stats: LoopStats = field(default_factory=LoopStats)
    frames_by_budget: dict[int, int] = field(default_factory=dict)  # its frames by the online tree size
    seconds: dict = field(default_factory=lambda: {"talker": 0.0, "predictor": 0.0, "prefill": 0.0})


@dataclass
class ChunkDone:
    work: Work
    frames: list[np.ndarray]
    cut: bool  # stopped at its frame budget (the model did not end its speech)
    budget: int


@dataclass
class WorkDone:
    work: Work


@dataclass
class WorkFailed:
    work: Work
    error: Exception


@dataclass
class _Row:
    """A talker row at work: the chunk being spoken and the state between its frames."""

    work: Work
    prompt: Prompt
    budget: int
    seen: torch.Tensor  # c0 ids drawn in this chunk (the repetition penalty's history)
    hidden: torch.Tensor
    logits: torch.Tensor
    frames: list[np.ndarray] = field(default_factory=list)


class BatchFrameLoop:
    """Speaks utterances `rows` at a time over one talker runner and one code predictor runner."""

    def __init__(
        self,
        talker: TalkerRunner,
        predictor: PredictorRunner,
        rules: C0Rules,
        talker_sampling: SamplingConfig,
        predictor_sampling: SamplingConfig,
        rows: int,
        speculation: Speculation | OnlineSpeculation | None = None,
    ):
        if rows < 1:
            raise ValueError(f"a batch needs at least one row, got {rows}")
        self.talker, self.predictor, self.rules = talker, predictor, rules
        self.talker_sampling, self.predictor_sampling = talker_sampling, predictor_sampling
        self.rows = rows
        self.speculation = speculation
        self.offsets = (
            speculation.offsets.vectors.to(predictor.device, predictor.dtype) if speculation is not None else None
        )

    def run(self, works: Iterable[Work]) -> Iterator[ChunkDone | WorkDone | WorkFailed]:
        """Speak every utterance; report each chunk and each utterance as it ends (NonFiniteError, which
        every utterance would meet, stops the loop)."""
        waiting = iter(works)
        rows: list[_Row | None] = [None] * self.rows
        while True:
            for slot in range(self.rows):
                while rows[slot] is None:
                    work = next(waiting, None)
                    if work is None:
                        break
                    yield from self._next_chunk(rows, slot, work)
            if not any(rows):
                return
            yield from self._frame(rows)

    def _frame(self, rows: list[_Row | None]) -> Iterator[ChunkDone | WorkDone | WorkFailed]:
        """One frame of every row: c0 drawn per row, c1.. of all rows in one inner loop, then one talker
        step for the rows that go on."""
        started = time.perf_counter()
        ready = []
        for slot, row in enumerate(rows):
            if row is None:
                continue
            c0 = draw_c0(
                self.rules,
                self.talker_sampling,
                row.logits,
                row.seen,
                len(row.frames),
                row.work.seed,
                row.work.utterance,
                row.work.frame,
            )
            if c0 == self.rules.eos_id:
                yield from self._end_chunk(rows, slot, cut=False)
            else:
                ready.append((slot, c0))
        if not ready:
            return
        device = self.talker.device
        codes0 = torch.tensor([c0 for _, c0 in ready], device=device)
        prefixes = torch.stack(
            [
                torch.cat([rows[slot].hidden[None], self.talker.code_embedding(codes0[i : i + 1])])
                for i, (slot, _) in enumerate(ready)
            ]
        )
        noise = torch.stack(
            [
                residual_noise(
                    rows[slot].work.seed,
                    rows[slot].work.utterance,
                    rows[slot].work.frame,
                    self.predictor.code_groups,
                    self.predictor.vocab_size,
                )
                for slot, _ in ready
            ]
        )
        between = time.perf_counter()
        rests = self._inner_loop(prefixes, noise.to(self.predictor.device), [rows[slot].work for slot, _ in ready])
        synchronize(device)
        after = time.perf_counter()
        talker_share, predictor_share = (between - started) / len(ready), (after - between) / len(ready)
        stepping, inputs = [], []
        for (slot, c0), rest in zip(ready, rests):
            row = rows[slot]
            row.work.seconds["talker"] += talker_share
            row.work.seconds["predictor"] += predictor_share
            codes = np.array([c0, *rest], dtype=np.int64)
            row.frames.append(codes)
            row.seen[c0] = True
            row.work.frame += 1
            if len(row.frames) >= row.budget:
                yield from self._end_chunk(rows, slot, cut=True)
            else:
                stepping.append(slot)
                inputs.append(
                    self.talker.frame_input(
                        torch.from_numpy(codes).to(device), row.prompt.text_after(len(row.frames) - 1)
                    )
                )
        if stepping:
            begun = time.perf_counter()
            hidden, logits = self.talker.step_rows(
                torch.cat(inputs), [rows[s].prompt.length + len(rows[s].frames) - 1 for s in stepping], stepping
            )
            synchronize(device)
            spent = (time.perf_counter() - begun) / len(stepping)
            for i, slot in enumerate(stepping):
                rows[slot].hidden, rows[slot].logits = hidden[i], logits[i]
                rows[slot].work.seconds["talker"] += spent
                rows[slot].work.talker_calls += 1

    def _inner_loop(self, prefixes: torch.Tensor, noise: torch.Tensor, works: list[Work]) -> list[list[int]]:
        """c1.. of every ready row's frame in shared calls (rvqtts.engine.inner_loop.inner_frames), counted per
        utterance."""
        online = self.speculation if isinstance(self.speculation, OnlineSpeculation) else None
        if online is not None:
            online.start(self.predictor, self.predictor_sampling)  # the budget this frame runs at, set
            for work in works:
                work.frames_by_budget[online.budget] = work.frames_by_budget.get(online.budget, 0) + 1
        frames = inner_frames(self.predictor, prefixes, noise, self.predictor_sampling, self.speculation, self.offsets)
        for work, frame in zip(works, frames):
            count_frame(work.stats, frame)
        return [frame.codes for frame in frames]

    def _end_chunk(self, rows: list[_Row | None], slot: int, cut: bool) -> Iterator[ChunkDone | WorkDone | WorkFailed]:
        row = rows[slot]
        rows[slot] = None
        yield ChunkDone(row.work, row.frames, cut, row.budget)
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
        prompt, budget = chunk
        begun = time.perf_counter()
        self.talker.reserve(prompt.length + budget, self.rows)  # room for every step at once
        hidden, logits = self.talker.prefill(prompt.embeds, row=slot)
        synchronize(self.talker.device)
        work.talker_calls += 1
        work.seconds["talker"] += time.perf_counter() - begun
        if work.frame == 0:
            work.seconds["prefill"] = time.perf_counter() - begun
        seen = torch.zeros(self.talker.vocab_size, dtype=torch.bool, device=self.talker.device)
        rows[slot] = _Row(work, prompt, budget, seen, hidden, logits)
