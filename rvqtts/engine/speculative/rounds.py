"""The inner loop: codes c1..c_{G-1} of n frames at once (one frame: n = 1), frame r in the runner's batch row r, every
call carrying all the frames still decoding: plain steps, or tree rounds in which one call verifies every frame's
tree (each at its own root index, with its own heads and noise) and gives the hidden states that draft its next
round. Every code is drawn with its own position's noise and every row computes what it computes alone, so the codes
are the plain loop's. A call's shapes are fixed by its key, so `calls` may replay it from a CUDA graph; a round's
host-side layout is built once per key (`RoundsLayout`).
docs/engine.md, "One frame" and "Several utterances at once"."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cache, partial

import torch

from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import NonFiniteError, RowSampling, SamplingConfig, draw_checked
from rvqtts.engine.speculative.speculation import EAGER, OBSERVED_RANKS, RoundPlan, Speculation
from rvqtts.engine.speculative.tree import Tree

LAYOUTS_KEPT = 512  # round layouts kept per runner (the least recently used go)


def walk_tree(
    children: list[list[tuple[int, int]]],
    node_rank_codes: list[int],
    draws: list[int],
    slot_index: list[int],
    last_index: int,
) -> tuple[list[int], int | None]:
    """Verify one round on the host. Returns the accepted node slots and the round's last code.

    At slot u the target drew `draws[u]`; if a child of u holds that code it is accepted and the walk
    continues there, else the draw is emitted and the round ends. A node that holds the frame's last
    code (`slot_index[u] == last_index`) ends the frame, with no further draw (None).
    """
    accepted: list[int] = []
    u = 0
    while slot_index[u] < last_index:
        y = draws[u]
        child = next((c for _, c in children[u] if node_rank_codes[c] == y), None)
        if child is None:
            return accepted, y
        accepted.append(child)
        u = child
    return accepted, None


def prefill_call(
    runner: PredictorRunner,
    sampling: SamplingConfig | RowSampling,
    prefixes: torch.Tensor,  # [n, 2, E]: each frame's [h_t, embedding of c0]
    noise: torch.Tensor,  # [n, G-1, V]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # h_1 [n, H], c1 [n], finite [n]
    """The frames' first call: h_1 from the prefixes, c1 drawn from it, and whether each frame's logits were finite.
    Every call returns such flags; the frames read them back with their codes."""
    hidden = runner.prefill_rows(prefixes)
    return hidden, *draw_checked(runner.logits(hidden, 1), noise[:, 0], sampling)


def steps_call(
    runner: PredictorRunner,
    index: int,
    sampling: SamplingConfig | RowSampling,
    codes: torch.Tensor,  # [n]: c_index of each frame
    noise: torch.Tensor,  # [n, G-1, V]
) -> tuple[torch.Tensor, torch.Tensor]:  # c_{index+1} [n], finite [n]
    """One plain step of n frames: feed c_index of frame r in batch row r and draw each one's c_{index+1} with its
    noise."""
    return draw_checked(runner.logits(runner.step_rows(codes, index), index + 1), noise[:, index], sampling)


@torch.inference_mode()
def plain_frames(
    runner: PredictorRunner,
    prefixes: torch.Tensor,  # [n, 2, E]: each frame's [h_t, embedding of c0]
    noise: torch.Tensor,  # [n, G-1, V]: row m-1 draws c_m
    sampling: SamplingConfig | RowSampling,
    calls: StaticCalls = EAGER,
) -> list[list[int]]:  # [n][G-1]
    """c1..c_{G-1} of n frames, one predictor call per code for all of them, the whole frame in one static call (on
    a GPU one graph replay, not 15). Codes stay on the device until the frames are done (one read back)."""
    codes, finite = calls(
        ("plain", prefixes.shape[0], sampling), partial(plain_call, runner, sampling), prefixes, noise
    )
    if not bool(finite.all()):
        raise NonFiniteError("code predictor", runner.dtype, (~finite).nonzero().flatten().tolist())
    return codes.tolist()


def plain_call(
    runner: PredictorRunner,
    sampling: SamplingConfig | RowSampling,
    prefixes: torch.Tensor,  # [n, 2, E]
    noise: torch.Tensor,  # [n, G-1, V]
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [n, G-1], finite [n]
    """The plain loop's calls of n frames, each code fed to the next call on the device, and whether every call's
    logits were finite, per frame."""
    _, code, finite = prefill_call(runner, sampling, prefixes, noise)
    codes, flags = [code], [finite]
    for index in range(1, runner.code_groups - 1):
        code, finite = steps_call(runner, index, sampling, code, noise)
        codes.append(code)
        flags.append(finite)
    return torch.stack(codes, dim=1), torch.stack(flags).all(0)


@dataclass
class FrameRounds:
    """One frame's rounds (by its speculation's tree; None: plain steps): its codes, calls (the prefill
    included), the depth each tree round accepted, and each one's root index and ranked drafts (what online
    acceptance counts)."""

    row: int
    index: int  # the root code's index
    root: int | None  # None once the frame is done
    hidden: torch.Tensor | None  # h_index, which drafts the next round (None: plain steps' frames)
    speculation: Speculation | None = None
    codes: list[int] = field(default_factory=list)
    calls: int = 1
    accepted: list[int] = field(default_factory=list)
    drafted: list[tuple[int, list[list[int]]]] = field(default_factory=list)
    budget: int | None = None  # the tree size the online choice ran it at (rvqtts.engine.loop.inner_loop.inner_frames)
    parts: dict[str, float] = field(default_factory=dict, compare=False)  # its share of the calls' seconds by part


class Laps:
    """The host clock between the parts of the inner loop's calls, seconds by part: where calls run eagerly (on a
    CPU) the parts run in this order, so the time since the last lap is the part's. Replayed static calls run their
    parts on the device, out of the host's sight: there it is not `running`."""

    def __init__(self, running: bool = True) -> None:
        self.running = running
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, part: str) -> None:
        if not self.running:
            return
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now

    def shared(self, frames: int) -> dict[str, float]:
        """Each of `frames` frames' share (they ran in the same calls)."""
        return {part: spent / frames for part, spent in self.seconds.items()}


NO_LAPS = Laps(running=False)


@cache
def plain_plan(device: torch.device) -> RoundPlan:
    """A round of the root alone: a plain step inside a round call."""
    return RoundPlan.build(Tree((), source="the root alone: a plain step"), device)


def frame_plan(frame: FrameRounds, last: int, device: torch.device) -> RoundPlan:
    """The frame's next round: its tree cut to the codes the frame has left, or the root alone."""
    if frame.speculation is None:
        return plain_plan(device)
    return frame.speculation.plan(min(frame.speculation.tree.depth, last - frame.index), device)


@dataclass(frozen=True)
class RoundsLayout:
    """What one round call over some frames does, fixed by each frame's row, root index and plan, built once per key
    (every tensor on the runner's device). Rows that one LM head scores or drafts from go through it together, in head
    order, so each head's weights are read once: the drafts' inputs (`draft_*`, ranked in that order), the query's codes
    gathered from [roots, ranked drafts] (`node_source`) and embedded by their positions' tables (`embedding`), where
    its keys go and what each query attends to, and the scored rows with their noise (`scored_rows`, `score_heads`,
    `noise_*`), drawn in one draw. Per frame, on the host: where its query starts, its slots' draws, its drafts' rows
    and its cache region."""

    plans: list[RoundPlan]
    width: int
    draft_frames: torch.Tensor
    draft_offsets: torch.Tensor
    draft_heads: list[tuple[int, slice]]
    node_source: torch.Tensor
    embedding: list[tuple[int, slice]]
    positions: torch.Tensor
    write: torch.Tensor
    attention: dict
    scored_rows: torch.Tensor
    score_heads: list[tuple[int, slice]]
    noise_frames: torch.Tensor
    noise_rows: torch.Tensor
    query_starts: list[int]
    draws_of: list[list[int]]
    drafts_of: list[list[int]]
    regions: list[int]

    @classmethod
    def build(cls, runner: PredictorRunner, rows: list[int], indices: list[int], plans: list[RoundPlan]):
        last, device = runner.code_groups - 1, runner.device
        bases = runner.row_bases(max(rows) + 1).tolist()
        regions = [bases[row] for row in rows]
        width = min(max([OBSERVED_RANKS, *(rank for p in plans for rank in p.draft_ranks)]), runner.vocab_size)
        drafts: dict[int, list[tuple[int, int]]] = {}  # head position: (frame, offset)
        scores: dict[int, list[tuple[int, int, int, int, int]]] = {}  # head: (query row, noise row, code, frame, slot)
        embedding, query_starts, query = [], [], 0
        for f, (row, index, plan) in enumerate(zip(rows, indices, plans)):
            query_starts.append(query)
            for j in range(1, len(plan.draft_ranks) + 1):
                drafts.setdefault(index + j, []).append((f, j - 1))
            for d, s in enumerate(plan.depth_slices):
                embedding.append((index + d - 1, slice(query + s.start, query + s.stop)))
                if index + d < last:  # a slot whose code is not the frame's last scores the next one
                    for u in range(s.start, s.stop):
                        scores.setdefault(index + d + 1, []).append((query + u, row, index + d, f, u))
            query += plan.tree.nodes + 1
        draft_order = [entry for _, entries in sorted(drafts.items()) for entry in entries]
        drafts_of = [[draft_order.index((f, j)) for j in range(len(p.draft_ranks))] for f, p in enumerate(plans)]
        node_source = []
        for f, plan in enumerate(plans):
            node_source.append(f)
            for depth, rank in zip(plan.slot_depth[1:].tolist(), plan.node_rank.tolist()):
                node_source.append(len(plans) + drafts_of[f][depth - 1] * width + rank)
        score_order = [entry for _, entries in sorted(scores.items()) for entry in entries]
        draws_of = [[0] * (p.tree.nodes + 1) for p in plans]
        for i, (*_, f, u) in enumerate(score_order):
            draws_of[f][u] = i

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, device=device, dtype=torch.long)

        return cls(
            plans=plans,
            width=width,
            draft_frames=tensor([f for f, _ in draft_order]),
            draft_offsets=tensor([j for _, j in draft_order]),
            draft_heads=head_slices(drafts),
            node_source=tensor(node_source),
            embedding=embedding,
            positions=torch.cat([index + 1 + plan.slot_depth for index, plan in zip(indices, plans)]),
            write=torch.cat(
                [
                    region + index + 1 + torch.arange(plan.tree.nodes + 1, device=device)
                    for index, plan, region in zip(indices, plans, regions)
                ]
            ),
            attention=round_attention(runner, indices, plans, regions, query_starts),
            scored_rows=tensor([entry[0] for entry in score_order]),
            score_heads=head_slices(scores),
            noise_frames=tensor([entry[1] for entry in score_order]),
            noise_rows=tensor([entry[1] * last + entry[2] for entry in score_order]),
            query_starts=query_starts,
            draws_of=draws_of,
            drafts_of=drafts_of,
            regions=regions,
        )


def round_attention(
    runner: PredictorRunner, indices: list[int], plans: list[RoundPlan], regions: list[int], query_starts: list[int]
) -> dict:
    """What a round call's queries attend to, as `run_layers` takes it: with row attention each query's slots over
    the runner's width in its frame's cache region ("rows"), else per depth its gathered slots ("groups")."""
    if runner.row_attention:
        slots = [plan.row_slots(index + 1, runner.width) for index, plan in zip(indices, plans)]
        keys = torch.cat([region + index for (index, _), region in zip(slots, regions)])
        return {"rows": (keys, torch.cat([visible for _, visible in slots]))}
    return {
        "groups": [
            (slice(start + s.start, start + s.stop), region + keys)
            for index, plan, region, start in zip(indices, plans, regions, query_starts)
            for s, keys in plan.attention_groups(index + 1)
        ]
    }


def head_slices(by_head: dict[int, list]) -> list[tuple[int, slice]]:
    """Each head's position and its rows' slice, the rows laid out head by head in position order."""
    slices, start = [], 0
    for position, entries in sorted(by_head.items()):
        slices.append((position, slice(start, start + len(entries))))
        start += len(entries)
    return slices


def rounds_layout(runner: PredictorRunner, frames: list[FrameRounds]) -> tuple[tuple, RoundsLayout]:
    """The layout of a round call over `frames` and its key, from the runner's recent layouts where it is there."""
    last, device = runner.code_groups - 1, runner.device
    plans = [frame_plan(f, last, device) for f in frames]
    key = (runner.max_len, runner.row_attention, tuple((f.row, f.index, p.tree.paths) for f, p in zip(frames, plans)))
    kept = runner.round_layouts
    if key in kept:
        kept.move_to_end(key)
    else:
        kept[key] = RoundsLayout.build(runner, [f.row for f in frames], [f.index for f in frames], plans)
        if len(kept) > LAYOUTS_KEPT:
            kept.popitem(last=False)
    return key, kept[key]


def rounds_call(
    runner: PredictorRunner,
    layout: RoundsLayout,
    offsets: torch.Tensor,  # [K, H]: one per lookahead distance
    sampling: SamplingConfig | RowSampling,
    hidden: torch.Tensor,  # [frames, H]: each frame's h_index, which drafts its round
    roots: torch.Tensor,  # [frames]: each frame's root code
    noise: torch.Tensor,  # [frames, G-1, V]
    laps: Laps = NO_LAPS,  # the clock between the round's parts
) -> tuple[torch.Tensor, ...]:  # node codes [sum q], hidden [sum q, H], draws, finite, ranked drafts [drafts, width]
    """Every frame's round in one call, by `layout`: ranked drafts of each frame from its hidden row, its root and
    nodes embedded at its own positions, the forward pass over all their rows (each frame's KV written to and read
    from its region), and the target's draws at every slot whose code is not its frame's last. Draws and their
    finite flags come in the layout's order."""
    ranked = torch.empty(0, layout.width, dtype=torch.long, device=roots.device)  # plain steps draft nothing
    if layout.draft_heads:
        drafts = hidden[layout.draft_frames] + offsets[layout.draft_offsets]
        scores = torch.cat([runner.logits(drafts[rows], position) for position, rows in layout.draft_heads])
        ranked = torch.topk(scores.float(), layout.width).indices
    node_codes = torch.cat([roots, ranked.flatten()])[layout.node_source]
    embeds = torch.cat([runner.embeddings[table](node_codes[rows]) for table, rows in layout.embedding])
    laps.lap("drafts")
    out = runner.forward_rows(embeds, layout.positions, layout.write, layout.attention)
    laps.lap("forward")
    scored = out[layout.scored_rows]
    logits = torch.cat([runner.logits(scored[rows], position) for position, rows in layout.score_heads])
    laps.lap("heads")
    draws, finite = draw_checked(
        logits, noise.flatten(0, 1), sampling.take(layout.noise_frames), noise_rows=layout.noise_rows
    )
    laps.lap("draws")
    return node_codes, out, draws, finite, ranked


def commit_rounds(
    runner: PredictorRunner, frames: list[FrameRounds], layout: RoundsLayout, results: tuple[torch.Tensor, ...]
) -> None:
    """Walk every frame's tree with its draws (`walk_tree`), keep its accepted nodes' KV and move it to its next
    root, or to its end."""
    last = runner.code_groups - 1
    node_codes, out, draws, _, ranked = results
    host_codes, host_draws = node_codes.tolist(), draws.tolist()
    host_ranked = ranked.tolist() if any(f.speculation is not None for f in frames) else []
    for f, (frame, plan) in enumerate(zip(frames, layout.plans)):
        start, q = layout.query_starts[f], plan.tree.nodes + 1
        codes = host_codes[start : start + q]
        slot_index = [frame.index + d for d, s in enumerate(plan.depth_slices) for _ in range(s.start, s.stop)]
        frame_draws = [host_draws[i] for i in layout.draws_of[f]]
        accepted, final = walk_tree(plan.tree.buffers.children, codes, frame_draws, slot_index, last)
        if plan.tree.nodes:
            frame.drafted.append((frame.index, [host_ranked[i] for i in layout.drafts_of[f]]))
            frame.accepted.append(len(accepted))
        frame.calls += 1
        frame.codes.append(codes[0])
        frame.codes.extend(codes[u] for u in accepted)
        committed = layout.regions[f] + frame.index + 1
        runner.keep([committed + u for u in accepted], committed + 1)
        end = accepted[-1] if accepted else 0
        frame.hidden = out[start + end]  # read by the next round (another key, so another static call) before any rerun
        frame.index, frame.root = (slot_index[end] + 1, final) if final is not None else (last, None)


@torch.inference_mode()
def speculative_frames(
    runner: PredictorRunner,
    prefixes: torch.Tensor,  # [n, 2, E]: each frame's [h_t, embedding of c0]
    noise: torch.Tensor,  # [n, G-1, V]
    sampling: SamplingConfig | RowSampling,
    speculations: list[Speculation | None],  # [n]: each frame's tree (None: plain steps)
    offsets: torch.Tensor,  # [K, H]: the speculations', on the runner's device and dtype
    calls: StaticCalls = EAGER,
) -> list[FrameRounds]:
    """c1..c_{G-1} of n frames, each by its tree's rounds, every frame's round in one call (see the module's
    docstring). Returns each frame's rounds; its codes are `plain_frames`'s."""
    last, n = runner.code_groups - 1, prefixes.shape[0]
    nodes = max(s.tree.nodes if s else 0 for s in speculations)
    if runner.max_len < runner.code_groups + nodes + 1:
        raise ValueError(
            f"the runner's rows hold {runner.max_len} slots, too few for rounds of {nodes} nodes: "
            f"build it for this speculation (LoopParts.build)"
        )
    laps = Laps(running=calls.mode == "eager")
    hidden, first, finite = calls(("prefill", n, sampling), partial(prefill_call, runner, sampling), prefixes, noise)
    laps.lap("prefill")
    frames = [
        FrameRounds(r, 1, code, hidden[r].clone(), speculation)
        for r, (code, speculation) in enumerate(zip(first.tolist(), speculations))
    ]
    flags = [(finite.clone(), None)]  # each call's finite flags, and the frame of each (None: in frame order)
    while True:
        for frame in frames:
            if frame.index == last and frame.root is not None:  # the root is the frame's last code
                frame.codes.append(frame.root)
                frame.root = None
        active = [f for f in frames if f.root is not None]
        if not active:
            break
        key, layout = rounds_layout(runner, active)
        laps.lap("layout")
        results = calls(
            ("rounds", key, sampling),
            partial(rounds_call, runner, layout, offsets, sampling, laps=laps),
            torch.stack([f.hidden for f in active]),
            torch.tensor([f.root for f in active], device=runner.device),
            noise,
        )
        flags.append((results[3].clone(), layout.noise_frames))
        if not bool(flags[-1][0].all()):
            break
        commit_rounds(runner, active, layout, results)
        laps.lap("walk")
    if not all(bool(finite.all()) for finite, _ in flags):
        raise NonFiniteError("code predictor", runner.dtype, not_finite_frames(flags))
    for frame in frames if laps.running else ():
        frame.parts = laps.shared(n)
    return frames


def not_finite_frames(flags: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[int]:
    """The frames any of whose calls' logits were not finite, from each call's flags and the frame of each flag."""
    frames = set()
    for finite, owners in flags:
        failed = (~finite).nonzero().flatten()
        frames.update((failed if owners is None else owners[failed]).tolist())
    return sorted(frames)
