"""What the inner loop (rvqtts.engine.speculative.rounds) runs by: a tree and its offsets (`Speculation`), each tree cut
to the codes a frame has left as a round's plan (`RoundPlan`: query slots by depth, the drafts it needs, attention
over the committed slots and the round's own), and the counts users see (`LoopStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from rvqtts.engine.model.attention import MAX_TREE_NODES
from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.tree import Tree

EAGER = StaticCalls("eager")
DEFAULT_DEPTH = 3  # K, the paper's draft depth


@dataclass
class LoopStats:
    """Counts over frames: predictor calls, residual codes, and verify rounds that accepted depth d."""

    frames: int = 0
    calls: int = 0
    codes: int = 0
    rounds: int = 0
    accepted_per_depth: list[int] = field(default_factory=lambda: [0] * DEFAULT_DEPTH)  # K entries, or more
    # the inner loop's time by part (rounds.Laps): a clock's reading, not a count, so not compared
    seconds_by_part: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def codes_per_call(self) -> float:
        return self.codes / self.calls if self.calls else 0.0

    def count_frame(self, calls: int, codes: int) -> None:
        self.frames += 1
        self.calls += calls
        self.codes += codes

    def count_parts(self, seconds: dict[str, float]) -> None:
        for part, spent in seconds.items():
            self.seconds_by_part[part] = self.seconds_by_part.get(part, 0.0) + spent

    def count_accepted(self, accepted: int) -> None:
        self.rounds += 1
        if len(self.accepted_per_depth) < accepted:
            self.accepted_per_depth.extend([0] * (accepted - len(self.accepted_per_depth)))
        for d in range(accepted):
            self.accepted_per_depth[d] += 1


@dataclass(frozen=True)
class RoundPlan:
    """A tree cut to the depth the frame still allows, with its buffers on the runner's device."""

    tree: Tree
    depth_slices: list[slice]  # query slots of each depth (0 = the root), contiguous (breadth-first)
    draft_ranks: list[int]  # ranked drafts needed at depths 1..depth
    slot_depth: torch.Tensor  # [1 + N] depth of each query slot (its position after the root's), on device
    node_rank: torch.Tensor  # [N] rank of each node, on device
    ancestor_mask: torch.Tensor  # [q, q] on device
    _attention: dict = field(default_factory=dict, repr=False, compare=False)

    def attention_groups(self, length: int) -> list[tuple[slice, torch.Tensor]]:
        """Per depth, its query slots and the cache slots each of them attends to, in position order:
        [n_d, length + d + 1] = the `length` committed slots, then its ancestors' and its own tree slots.
        A plain step at the same position attends to exactly these keys, in this order, so attention
        run row by row over them gives what the step would, bit for bit (one masked call over every
        slot does not: its kernel blocks and sums differently, which reduced precision makes visible)."""
        key = ("groups", length)
        if key not in self._attention:
            device = self.ancestor_mask.device
            committed = torch.arange(length, device=device)
            groups = []
            for s in self.depth_slices:
                ancestors = [length + torch.nonzero(row).flatten() for row in self.ancestor_mask[s]]
                groups.append((s, torch.stack([torch.cat([committed, a]) for a in ancestors])))
            self._attention[key] = groups
        return self._attention[key]

    def row_slots(self, length: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of `attention_groups` for row attention (rvqtts.engine.model.attention): [q, width] cache slots per
        query in position order, then slot 0 as masked padding, and [q, width] which of them it sees."""
        key = ("rows", length, width)
        if key not in self._attention:
            queries, device = self.ancestor_mask.shape[0], self.ancestor_mask.device
            index = torch.zeros(queries, width, dtype=torch.long, device=device)
            visible = torch.zeros(queries, width, dtype=torch.bool, device=device)
            for rows, slots in self.attention_groups(length):
                index[rows, : slots.shape[1]] = slots
                visible[rows, : slots.shape[1]] = True
            self._attention[key] = (index, visible)
        return self._attention[key]

    @classmethod
    def build(cls, tree: Tree, device: torch.device) -> "RoundPlan":
        buffers = tree.buffers
        depth = buffers.depth.tolist()
        slices = [slice(depth.index(d), len(depth) - depth[::-1].index(d)) for d in range(tree.depth + 1)]
        return cls(
            tree=tree,
            depth_slices=slices,
            draft_ranks=tree.max_rank_by_depth(),
            slot_depth=buffers.depth.to(device),
            node_rank=torch.tensor(buffers.rank[1:], device=device),
            ancestor_mask=buffers.ancestor_mask.to(device),
        )


class TreePolicy(Protocol):
    """What the inner loop asks a tree policy (a fixed tree, `Speculation`, or the size chosen online,
    rvqtts.engine.speculative.online.OnlineSpeculation; None where the run is plain) each frame, and tells it what it
    saw."""

    offsets: Offsets  # the drafter's (runners put them on their device)
    budget: int  # the tree size running now (0: plain frames; -1: not started)

    @property
    def max_nodes(self) -> int:
        """The largest tree a frame may run: the room a runner's cache keeps beside a frame's codes."""

    def start(self, runner: object, sampling: object) -> None:
        """Ready for a run on this runner and sampling (what must be measured, measured now)."""

    def frame_speculation(self) -> tuple["Speculation | None", bool]:
        """What the next frame (or a batch's next frame step) runs (None: plain), and whether it is a probe."""

    def first_trees(self) -> list["Speculation"]:
        """The trees the first frames after `start` may run (what a warm-up captures), asking nothing of the next."""

    def observe(self, codes: list[int], drafted: list, probe: bool, milliseconds: float) -> None:
        """A finished frame: its codes, its rounds' drafts, and its share of the inner loop's time."""

    def for_rows(self, rows: int) -> "TreePolicy":
        """The policy of batches of `rows` lines."""

    def record(self, frames_by_budget: dict[int, int] | None = None) -> dict | None:
        """What users see of the choice (`--stats-json`'s "online"; None for a fixed tree)."""


@dataclass
class Speculation:
    """A tree and the offsets that draft it; round plans are cached per depth cap. As a tree policy, the same
    tree every frame."""

    tree: Tree
    offsets: Offsets
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.tree.nodes > MAX_TREE_NODES:
            raise ValueError(
                f"the tree has {self.tree.nodes} nodes; rounds carry at most {MAX_TREE_NODES} "
                f"(larger trees cost more than they accept): use a tree of <= {MAX_TREE_NODES} nodes"
            )
        if self.tree.depth > self.offsets.depth:
            raise ValueError(
                f"the tree is {self.tree.depth} deep but the offsets draft only "
                f"K = {self.offsets.depth} codes ahead: use a tree of depth <= {self.offsets.depth}"
            )

    @property
    def budget(self) -> int:
        return self.tree.nodes

    @property
    def max_nodes(self) -> int:
        return self.tree.nodes

    def start(self, runner: object, sampling: object) -> None:
        """Nothing to measure: the tree is fixed."""

    def frame_speculation(self) -> tuple["Speculation", bool]:
        return self, False

    def first_trees(self) -> list["Speculation"]:
        return [self]

    def observe(self, codes: list[int], drafted: list, probe: bool, milliseconds: float) -> None:
        """Nothing to learn: the tree is fixed."""

    def for_rows(self, rows: int) -> "Speculation":
        return self

    def record(self, frames_by_budget: dict[int, int] | None = None) -> None:
        return None

    def plan(self, cap: int, device: torch.device) -> RoundPlan:
        if cap not in self._plans:
            self._plans[cap] = RoundPlan.build(self.tree.truncated(cap), device)
        return self._plans[cap]


OBSERVED_RANKS = 8  # every round drafts at least this many ranks per depth: what online acceptance counts
