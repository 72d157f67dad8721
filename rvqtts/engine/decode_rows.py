"""The inner loop of several frames at once (a batch's, rvqtts.engine.batch_frames): frame r in the runner's batch
row r (its own KV region), every call carrying all the frames still decoding. Plain: one call per code for
all of them. Speculative: each frame runs its own tree rounds (rvqtts.engine.decode) and one call carries every
frame's round: B x (N + 1) rows, each frame at its own root index (acceptance differs, so the frames fall
out of step), its drafts scored by the heads of its own positions, its draws with its own noise. A frame
without a tree takes plain steps in the same calls (one row each: how a batch probes acceptance on one
frame while the others run plain). Each frame gets the codes it gets alone: its rows go through the
same row-invariant kernels and attend to its own slots only, and the codes are the target's draws
whatever the drafts were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch

from rvqtts.engine.decode import OBSERVED_RANKS, RoundPlan, Speculation, walk_tree
from rvqtts.engine.predictor import PredictorRunner
from rvqtts.engine.sampling import NonFiniteError, SamplingConfig, draw_checked
from rvqtts.engine.tree import Tree


def steps_call(
    runner: PredictorRunner, codes: torch.Tensor, index: int, noise: torch.Tensor, sampling: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain step of n frames: feed c_index of frame r (`codes` [n]) in batch row r and draw each one's
    c_{index+1} with its noise row (`noise` [n, V]); with the finite flag."""
    return draw_checked(runner.logits(runner.step_rows(codes, index), index + 1), noise, sampling)


@torch.inference_mode()
def decode_frames_plain(
    runner: PredictorRunner, prefixes: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig
) -> list[list[int]]:
    """c1..c_{G-1} of n frames at once (frame r in the runner's batch row r), one call per code for all of
    them: `prefixes` [n, 2, E], `noise` [n, G-1, V]. Each frame gets the codes `decode_frame_plain` gives
    it alone (its rows through the same kernels, its attention over its own slots)."""
    last = runner.code_groups - 1
    code, finite = draw_checked(runner.logits(runner.prefill_rows(prefixes), 1), noise[:, 0], sampling)
    codes, flags = [code], [finite]
    for index in range(1, last):
        code, finite = steps_call(runner, code, index, noise[:, index], sampling)
        codes.append(code)
        flags.append(finite)
    if not bool(torch.stack(flags).all()):
        raise NonFiniteError("code predictor", runner.dtype)
    return torch.stack(codes, dim=1).tolist()


@dataclass
class FrameRounds:
    """One frame's rounds in a batch (by its speculation's tree; None: plain steps): its codes, calls (the
    shared prefill included), the depth each tree round accepted, and each one's root index and ranked
    drafts (what online acceptance counts)."""

    row: int
    index: int  # the root code's index
    root: int | None  # None once the frame is done
    hidden: torch.Tensor  # h_index, which drafts the next round
    speculation: Speculation | None = None
    codes: list[int] = field(default_factory=list)
    calls: int = 1
    accepted: list[int] = field(default_factory=list)
    drafted: list[tuple[int, list[list[int]]]] = field(default_factory=list)


@cache
def plain_plan(device: torch.device) -> RoundPlan:
    """A round of the root alone: a plain step inside a batch's round call."""
    return RoundPlan.build(Tree((), source="the root alone: a plain step"), device)


def frame_plan(frame: FrameRounds, last: int, device: torch.device) -> RoundPlan:
    """The frame's next round: its tree cut to the codes the frame has left, or the root alone."""
    if frame.speculation is None:
        return plain_plan(device)
    return frame.speculation.plan(min(frame.speculation.tree.depth, last - frame.index), device)


def heads_by_position(
    runner: PredictorRunner, hidden: torch.Tensor, positions: list[int]
) -> list[tuple[list[int], torch.Tensor]]:
    """Scores of rows `hidden` [n, H], row i by the head of code `positions[i]`: one call per head over all
    the rows it scores (each head's weights read once). Returns (row indices, their logits [k, V]) by head."""
    scored = []
    for position in sorted(set(positions)):
        rows = [i for i, p in enumerate(positions) if p == position]
        scored.append((rows, runner.logits(hidden[torch.tensor(rows, device=hidden.device)], position)))
    return scored


def draft_rows(
    runner: PredictorRunner, frames: list[FrameRounds], offsets: torch.Tensor, depths: list[int], width: int
) -> list[torch.Tensor]:
    """Ranked drafts [depth_r, width] of every frame: the top ranks of LMH_{index+j}(h_index + b_j), each
    head called once over every frame it drafts for."""
    inputs, positions, owners = [], [], []
    for f, (frame, depth) in enumerate(zip(frames, depths)):
        for j in range(1, depth + 1):
            inputs.append(frame.hidden + offsets[j - 1])
            positions.append(frame.index + j)
            owners.append((f, j - 1))
    ranked = [torch.empty(depth, width, dtype=torch.long, device=runner.device) for depth in depths]
    if not inputs:
        return ranked
    for rows, scores in heads_by_position(runner, torch.stack(inputs), positions):
        top = torch.topk(scores.float(), width).indices
        for i, row in enumerate(rows):
            f, j = owners[row]
            ranked[f][j] = top[i]
    return ranked


@dataclass
class RowsRound:
    """One call's model work for the frames in it: per frame its round plan and ranked drafts, the node
    codes [sum q] (each frame's root first), hidden states [sum q, H], the target's draws at the scored
    slots (frame by frame, slot order) and whether their logits were finite."""

    plans: list[RoundPlan]
    ranked: list[torch.Tensor]
    node_codes: torch.Tensor
    out: torch.Tensor
    draws: torch.Tensor
    finite: list[torch.Tensor]


def round_rows(
    runner: PredictorRunner,
    frames: list[FrameRounds],
    bases: list[int],
    offsets: torch.Tensor,
    noise: torch.Tensor,
    sampling: SamplingConfig,
) -> RowsRound:
    """Every frame's round in one call: drafts, node embeddings at each frame's own positions, the
    forward pass over all their rows (each frame's KV written to and read from its region at `bases`),
    and the draws at every slot whose code is not its frame's last."""
    last, device = runner.code_groups - 1, runner.device
    plans = [frame_plan(f, last, device) for f in frames]
    width = min(max([OBSERVED_RANKS, *(rank for p in plans for rank in p.draft_ranks)]), runner.vocab_size)
    ranked = draft_rows(runner, frames, offsets, [len(p.draft_ranks) for p in plans], width)
    node_codes, embeds, positions, write, slots, visible, groups = [], [], [], [], [], [], []
    scored_rows, scored_positions, noise_rows = [], [], []
    start = 0
    for frame, plan, drafts in zip(frames, plans, ranked):
        codes = torch.tensor([frame.root], device=device)
        if plan.tree.nodes:
            codes = torch.cat([codes, drafts[plan.slot_depth[1:] - 1, plan.node_rank]])
        node_codes.append(codes)
        embeds.append(runner.embed_codes(codes, frame.index, plan.depth_slices))
        positions.append(frame.index + 1 + plan.slot_depth)
        length, region = frame.index + 1, bases[frame.row]
        write.append(region + length + torch.arange(len(codes), device=device))
        if runner.row_attention:
            index, seen = plan.row_slots(length, runner.width)
            slots.append(region + index)
            visible.append(seen)
        else:
            groups.extend(
                (slice(start + s.start, start + s.stop), region + keys) for s, keys in plan.attention_groups(length)
            )
        for d, s in enumerate(plan.depth_slices):
            if frame.index + d < last:  # a slot whose code is not the frame's last scores the next one
                scored_rows.extend(range(start + s.start, start + s.stop))
                scored_positions.extend([frame.index + d + 1] * (s.stop - s.start))
                noise_rows.extend([(frame.row, frame.index + d)] * (s.stop - s.start))
        start += len(codes)
    attention = {"rows": (torch.cat(slots), torch.cat(visible))} if runner.row_attention else {"groups": groups}
    out = runner.forward_rows(torch.cat(embeds), torch.cat(positions), torch.cat(write), attention)
    scored = out[torch.tensor(scored_rows, device=device)]
    draws = torch.empty(len(scored_rows), dtype=torch.long, device=device)
    finite = []
    for rows, logits in heads_by_position(runner, scored, scored_positions):
        which = [noise_rows[i] for i in rows]
        picked = noise[[r for r, _ in which], [m for _, m in which]]
        draws[torch.tensor(rows, device=device)], flag = draw_checked(logits, picked, sampling)
        finite.append(flag)
    return RowsRound(plans, ranked, torch.cat(node_codes), out, draws, finite)


def commit_rounds(runner: PredictorRunner, frames: list[FrameRounds], bases: list[int], done: RowsRound) -> None:
    """Walk every frame's tree with its draws (rvqtts.engine.decode.walk_tree), keep its accepted nodes' KV and
    move it to its next root, or to its end."""
    last = runner.code_groups - 1
    host_codes, host_draws = done.node_codes.tolist(), done.draws.tolist()
    start = drawn = 0
    for frame, plan, drafts in zip(frames, done.plans, done.ranked):
        q = plan.tree.nodes + 1
        codes = host_codes[start : start + q]
        slot_index = [frame.index + d for d, s in enumerate(plan.depth_slices) for _ in range(s.start, s.stop)]
        accepted, final = walk_tree(plan.tree.buffers.children, codes, host_draws[drawn:], slot_index, last)
        if plan.tree.nodes:
            frame.drafted.append((frame.index, drafts.tolist()))
            frame.accepted.append(len(accepted))
        frame.calls += 1
        frame.codes.append(codes[0])
        frame.codes.extend(codes[u] for u in accepted)
        committed = bases[frame.row] + frame.index + 1
        runner.keep([committed + u for u in accepted], committed + 1)
        end = accepted[-1] if accepted else 0
        frame.hidden = done.out[start + end]
        frame.index, frame.root = (slot_index[end] + 1, final) if final is not None else (last, None)
        drawn += sum(s.stop - s.start for s in plan.depth_slices if slot_index[s.start] < last)
        start += q


@torch.inference_mode()
def decode_frames_speculative(
    runner: PredictorRunner,
    prefixes: torch.Tensor,
    noise: torch.Tensor,
    sampling: SamplingConfig,
    speculations: list[Speculation | None],
    offsets: torch.Tensor,
) -> list[FrameRounds]:
    """c1..c_{G-1} of n frames, frame r by the tree rounds of `speculations[r]` (None: plain steps), every
    frame's round in one call (see the module's docstring). `prefixes` [n, 2, E], `noise` [n, G-1, V],
    `offsets` the speculations' [K, hidden] on the runner's device and dtype. Returns each frame's
    rounds; its codes are `decode_frame_plain`'s."""
    last = runner.code_groups - 1
    nodes = max(s.tree.nodes if s else 0 for s in speculations)
    if runner.max_len < runner.code_groups + nodes + 1:
        raise ValueError(
            f"the runner's rows hold {runner.max_len} slots, too few for rounds of {nodes} nodes: "
            f"build it for this speculation (LoopParts.build)"
        )
    hidden = runner.prefill_rows(prefixes)
    first, finite = draw_checked(runner.logits(hidden, 1), noise[:, 0], sampling)
    frames = [
        FrameRounds(r, 1, code, hidden[r], speculation)
        for r, (code, speculation) in enumerate(zip(first.tolist(), speculations))
    ]
    bases, flags = runner.row_bases(len(frames)).tolist(), [finite]
    while True:
        for frame in frames:
            if frame.index == last and frame.root is not None:  # the root is the frame's last code
                frame.codes.append(frame.root)
                frame.root = None
        active = [f for f in frames if f.root is not None]
        if not active:
            break
        done = round_rows(runner, active, bases, offsets, noise, sampling)
        flags.extend(done.finite)
        commit_rounds(runner, active, bases, done)
    if not bool(torch.stack(flags).all()):
        raise NonFiniteError("code predictor", runner.dtype)
    return frames
