"""The inner loop: codes c1..c_{G-1} of one frame from (h_t, c0), plain or speculative.

Plain: a 2-token prefill, then one call per code, as qwen-tts does. Speculative: the prefill gives c1
and h_1; each round is then ONE predictor call over [root, tree nodes], where the root is the code
sampled last and the nodes are the drafts LMH_{n+j}(h_n + b_j) arranged as the sparse tree. The same
call verifies the tree and provides the hidden state that drafts the next round. Verification walks
the tree with the target's own draws: draw y at a node; if a child holds y, accept it and go on;
otherwise y is the round's last code. Every code is drawn with the noise of its own position, so the
output is the plain loop's, code for code, and follows the target distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from rvqtts.engine.attention import MAX_TREE_NODES
from rvqtts.engine.graphs import StaticCalls
from rvqtts.engine.offsets import Offsets
from rvqtts.engine.predictor import PredictorRunner
from rvqtts.engine.sampling import NonFiniteError, SamplingConfig, draw_checked
from rvqtts.engine.tree import Tree

EAGER = StaticCalls("eager")
DEFAULT_DEPTH = 3  # K, the paper's draft depth


@dataclass
class DecodeStats:
    """Counts over frames: predictor calls, residual codes, and verify rounds that accepted depth d."""

    frames: int = 0
    calls: int = 0
    codes: int = 0
    rounds: int = 0
    accepted_per_depth: list[int] = field(default_factory=lambda: [0] * DEFAULT_DEPTH)  # K entries, or more

    @property
    def codes_per_call(self) -> float:
        return self.codes / self.calls if self.calls else 0.0

    def count_frame(self, calls: int, codes: int) -> None:
        self.frames += 1
        self.calls += calls
        self.codes += codes

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
        """The slots of `attention_groups` for row attention (rvqtts.engine.attention): [q, width] cache slots per
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


@dataclass
class Speculation:
    """A tree and the offsets that draft it; round plans are cached per depth cap."""

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

    def plan(self, cap: int, device: torch.device) -> RoundPlan:
        if cap not in self._plans:
            self._plans[cap] = RoundPlan.build(self.tree.truncated(cap), device)
        return self._plans[cap]


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
    runner: PredictorRunner, sampling: SamplingConfig, prefix: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A frame's first call: h_1 from [h_t, embedding of c0], c1 drawn from it ([1]), and whether its
    logits were finite. Every call returns that flag; the frame reads it back with its codes."""
    hidden = runner.prefill(prefix)
    code, finite = draw_checked(runner.logits(hidden, 1), noise[0], sampling)
    return hidden, code.view(1), finite


def step_call(
    runner: PredictorRunner, index: int, sampling: SamplingConfig, code: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain call: feed c_index ([1]) and draw c_{index+1} ([1]), with the finite flag."""
    hidden = runner.step(code, index)
    code, finite = draw_checked(runner.logits(hidden, index + 1), noise[index], sampling)
    return code.view(1), finite


@torch.inference_mode()
def decode_frame_plain(
    runner: PredictorRunner,
    prefix: torch.Tensor,
    noise: torch.Tensor,
    sampling: SamplingConfig,
    stats: DecodeStats,
    calls: StaticCalls = EAGER,
) -> list[int]:
    """c1..c_{G-1} with one call per code. `noise` [G-1, V]: row m-1 draws c_m. Codes stay on the
    device until the frame is done (one read back per frame)."""
    last = runner.code_groups - 1
    _, code, finite = calls(("prefill", sampling), partial(prefill_call, runner, sampling), prefix, noise)
    codes, flags = [code.clone()], [finite.clone()]  # outputs of a static call are overwritten when it runs again
    for index in range(1, last):
        code, finite = calls(("step", index, sampling), partial(step_call, runner, index, sampling), code, noise)
        codes.append(code.clone())
        flags.append(finite.clone())
    frame = torch.cat(codes).tolist()
    if not bool(torch.stack(flags).all()):
        raise NonFiniteError("code predictor", runner.dtype)
    stats.count_frame(last, last)
    return frame


OBSERVED_RANKS = 8  # every round drafts at least this many ranks per depth: what online acceptance counts


def draft(
    runner: PredictorRunner, hidden: torch.Tensor, offsets: torch.Tensor, index: int, ranks: list[int]
) -> torch.Tensor:
    """Ranked drafts [depth, width] for c_{index+1..}: top ranks of LMH_{index+j}(h_index + b_j), as many
    as the tree uses and at least OBSERVED_RANKS (the ranks of committed codes measure acceptance)."""
    width = min(max(*ranks, OBSERVED_RANKS), runner.vocab_size)
    rows = []
    for j in range(1, len(ranks) + 1):
        scores = runner.logits(hidden + offsets[j - 1], index + j)
        rows.append(torch.topk(scores.float(), width).indices)
    return torch.stack(rows)


def scored_slices(plan: RoundPlan, index: int, last: int) -> list[tuple[int, slice]]:
    """The depths (with their query slots) whose code is not the frame's last: each scores the next code."""
    return [(d, s) for d, s in enumerate(plan.depth_slices) if index + d < last]


def tree_call(
    runner: PredictorRunner,
    plan: RoundPlan,
    hidden: torch.Tensor,
    offsets: torch.Tensor,
    root: torch.Tensor,
    index: int,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One speculative call's model work: draft the tree's nodes from `hidden` (h_index), run the root
    (c_index) and the nodes in one forward pass under the tree mask over `length` committed slots, and
    score the next code at every slot. Returns node codes [q] (root first), hidden states [q, H], the
    logits of the scored slots, depth by depth, and the ranked drafts [depth, width]."""
    ranked = draft(runner, hidden, offsets, index, plan.draft_ranks)
    node_codes = torch.cat([root, ranked[plan.slot_depth[1:] - 1, plan.node_rank]])
    embeds = runner.embed_codes(node_codes, index, plan.depth_slices)
    out = runner.forward(embeds, index + 1 + plan.slot_depth, length, **runner.round_attention(plan, length))
    last = runner.code_groups - 1
    logits = torch.cat([runner.logits(out[s], index + d + 1) for d, s in scored_slices(plan, index, last)])
    return node_codes, out, logits, ranked


def round_call(
    runner: PredictorRunner,
    plan: RoundPlan,
    offsets: torch.Tensor,
    index: int,
    sampling: SamplingConfig,
    hidden: torch.Tensor,
    root: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """One verify round rooted at c_index over index + 1 committed slots: node codes [q], hidden states
    [q, H], at every scored slot the target's draw of the next code, with that code's noise row, whether
    the logits were finite, and the ranked drafts [depth, width]."""
    last = runner.code_groups - 1
    node_codes, out, logits, ranked = tree_call(runner, plan, hidden, offsets, root, index, index + 1)
    rows = torch.cat([noise[index + d].expand(s.stop - s.start, -1) for d, s in scored_slices(plan, index, last)])
    return node_codes, out, *draw_checked(logits, rows, sampling), ranked


@torch.inference_mode()
def decode_frame_speculative(
    runner: PredictorRunner,
    prefix: torch.Tensor,
    noise: torch.Tensor,
    sampling: SamplingConfig,
    speculation: Speculation,
    offsets: torch.Tensor,
    stats: DecodeStats,
    calls: StaticCalls = EAGER,
    drafted: list[tuple[int, list[list[int]]]] | None = None,
) -> list[int]:
    """c1..c_{G-1} by tree rounds. `offsets` is the speculation's [K, hidden] on the runner's device/dtype.
    `drafted`, where given, receives each round's root index and ranked drafts (what acceptance is
    measured from online, rvqtts.engine.online).

    A round rooted at c_index always starts after index + 1 committed KV slots ([h_t, c0, c1..c_{index-1}]),
    so its shapes depend on the tree and index alone and `calls` may replay it from a graph keyed by them."""
    last = runner.code_groups - 1
    hidden, root, finite = calls(("prefill", sampling), partial(prefill_call, runner, sampling), prefix, noise)
    codes: list[int] = []
    made, index = 1, 1  # calls made, index of the root code
    while True:
        if index == last:
            codes.extend(root.tolist())
            if not bool(finite):
                raise NonFiniteError("code predictor", runner.dtype)
            break
        plan = speculation.plan(min(speculation.tree.depth, last - index), runner.device)
        node_codes, out, draws, round_finite, ranked = calls(
            ("round", index, sampling, plan.tree.paths),
            partial(round_call, runner, plan, offsets, index, sampling),
            hidden,
            root,
            noise,
        )
        made += 1
        finite = finite & round_finite  # the prefill's flag too, read back with the first round's codes
        host_codes, host_draws = node_codes.tolist(), draws.tolist()
        if drafted is not None:
            drafted.append((index, ranked.tolist()))
        if not bool(finite):
            raise NonFiniteError("code predictor", runner.dtype)
        slot_index = [index + d for d, s in enumerate(plan.depth_slices) for _ in range(s.start, s.stop)]
        accepted, final = walk_tree(plan.tree.buffers.children, host_codes, host_draws, slot_index, last)
        stats.count_accepted(len(accepted))
        codes.append(host_codes[0])
        codes.extend(host_codes[u] for u in accepted)
        committed = index + 1
        runner.keep([committed + u for u in accepted], committed + 1)
        end = accepted[-1] if accepted else 0
        hidden = out[end]  # read by the next round (another index, so another static call) before any rerun
        if final is None:
            break
        index = slot_index[end] + 1
        root = torch.tensor([final], device=runner.device)
    stats.count_frame(made, last)
    return codes
