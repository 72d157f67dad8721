"""The fused speculative round, the paper's form for the Neural Engine and the module rvqtts hands to Core ML: one
static-shape call verifies a tree and drafts the next round, its inputs all tensors and its outputs integers the
host walks with (`FusedLoop`). One graph serves a whole frame: the tree is never cut near the frame's end, and
attention reads [cache; new slots] through an additive mask, so the graph has no dynamic writes.
docs/engine.md, "The fused round"; docs/coreml.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import SamplingConfig, warp_logits
from rvqtts.engine.speculative.rounds import FrameRounds, walk_tree
from rvqtts.engine.speculative.tree import Tree

MASKED = -3e4  # additive mask value for hidden slots; representable in float16


class FusedCall(torch.nn.Module):
    """One predictor call over slots of fixed depths (-1: a slot that scores nothing, as h_t in the
    prefill). Slot u at depth d holds code c_{index+d}; it scores c_{index+d+1} and drafts the K after."""

    def __init__(
        self,
        runner: PredictorRunner,
        slot_depth: list[int],
        offsets: torch.Tensor,
        draft_width: int,
        sampling: SamplingConfig,
    ):
        super().__init__()
        self.runner, self.sampling, self.draft_width = runner, sampling, draft_width
        self.offsets = offsets.to(runner.device, runner.dtype)
        self.depth = len(offsets)
        self.heads = torch.stack([head.weight for head in runner.heads]).detach()  # [G-1, V, H]: c_m by [m-1]
        self.last_head = len(runner.heads) - 1  # Python ints: traced as constants, not shape lookups
        self.last_position = int(runner.cos.shape[0]) - 1
        self.slot_depth = torch.tensor(slot_depth, device=runner.device)
        self.slots = len(slot_depth)
        depths = sorted(set(slot_depth) - {-1})
        self.groups = [(d, slot_depth.index(d), len(slot_depth) - slot_depth[::-1].index(d)) for d in depths]
        # The heads a call reads: c_{index+d+1} to c_{index+d+1+K} over its depths d, one window of them.
        self.first_head = depths[0] + 1
        self.head_window = torch.arange(depths[-1] - depths[0] + 1 + self.depth, device=runner.device)

    def window_heads(self, index: torch.Tensor) -> torch.Tensor:
        """LMH for codes c_{index+first_head} onwards ([window, V, H]), clamped to the last head past the frame's
        end: one gather, so that a converted graph reads the stacked heads once per call (coremltools checks each
        reading op's constants)."""
        return self.heads[(index + self.first_head - 1 + self.head_window).clamp(0, self.last_head)]

    def forward(
        self,
        embeds: torch.Tensor,
        index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        mask: torch.Tensor,
        noise: torch.Tensor,
    ):
        """embeds [q, E], index [1] (code index of depth 0; Core ML takes no rank-0 inputs), caches [L, kv_heads, C,
        head_dim], mask [q, C + q] additive, noise [q, V]. Returns draws [q], draft ranks [q, K, m], new keys and
        values [L, kv_heads, q, head_dim]."""
        runner = self.runner
        positions = (index + 1 + self.slot_depth).clamp(0, self.last_position)
        x = runner.project_input(embeds)
        cos, sin = runner.cos[positions][None], runner.sin[positions][None]
        attn_mask = mask.to(runner.dtype)[None, None]
        new_k, new_v = [], []
        repeat = runner.n_heads // runner.n_kv_heads
        for i in range(len(runner.layers)):
            q, k, v = runner.attention_inputs(i, x, cos, sin)
            new_k.append(k)
            new_v.append(v)
            keys = torch.cat([k_cache[i], k], dim=1).repeat_interleave(repeat, dim=0)
            values = torch.cat([v_cache[i], v], dim=1).repeat_interleave(repeat, dim=0)
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=attn_mask)
            x = runner.layer_rest(i, x, out[0])
        hidden = runner.rms(runner.norm, x)
        q_len = self.slots
        draws = torch.zeros(q_len, dtype=torch.long, device=hidden.device)
        ranks = torch.zeros(q_len, self.depth, self.draft_width, dtype=torch.long, device=hidden.device)
        heads = self.window_heads(index)
        for d, start, stop in self.groups:
            rows = hidden[start:stop]
            scores = warp_logits(rows @ heads[d + 1 - self.first_head].T, self.sampling)
            if self.sampling.do_sample:
                scores = scores + noise[start:stop]
            draws[start:stop] = scores.argmax(-1)
            for j in range(1, self.depth + 1):
                drafted = (rows + self.offsets[j - 1]) @ heads[d + 1 + j - self.first_head].T
                ranks[start:stop, j - 1] = torch.topk(drafted.float(), self.draft_width, dim=-1).indices
        if not self.depth:  # no drafts (the plain step): no ranks output, rather than an empty one
            return draws, torch.stack(new_k), torch.stack(new_v)
        return draws, ranks, torch.stack(new_k), torch.stack(new_v)


class FusedRound(FusedCall):
    """A round of slots at fixed depths (a tree's, or [0] for a plain step), with its codes embedded in
    the graph: slot u's code c_{index+d_u} by its own table."""

    def __init__(
        self,
        runner: PredictorRunner,
        slot_depth: list[int],
        offsets: torch.Tensor,
        draft_width: int,
        sampling: SamplingConfig,
    ):
        super().__init__(runner, slot_depth, offsets, draft_width, sampling)
        self.tables = torch.stack([table.weight for table in runner.embeddings]).detach()  # [G-1, V, E]

    def forward(
        self,
        codes: torch.Tensor,
        index: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        mask: torch.Tensor,
        noise: torch.Tensor,
    ):
        """codes [q]: the root c_index, then the tree's nodes (anything past c15 is ignored)."""
        table = (index + self.slot_depth - 1).clamp(0, self.last_head)
        return super().forward(self.tables[table, codes], index, k_cache, v_cache, mask, noise)


FusedFunction = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FusedCalls:
    """The three calls of a fused inner loop and the KV cache they read: one contract for the PyTorch modules, their
    traced graphs and a Core ML package's functions (docs/coreml.md, "What is exported"). Each takes (first input, index
    [1], k_cache, v_cache, mask, noise) and returns (draws, ranks, new keys, new values); `step` returns no ranks."""

    prefill: FusedFunction
    round: FusedFunction
    step: FusedFunction
    cache_shape: tuple[int, int, int, int]  # [layers, kv_heads, G + 1 committed slots, head_dim]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def modules(
        cls, runner: PredictorRunner, tree: Tree, offsets: torch.Tensor, sampling: SamplingConfig
    ) -> "FusedCalls":
        """PyTorch modules for this tree (the ones Core ML converts)."""
        width = max(tree.max_rank_by_depth())
        slot_depth = tree.buffers.depth.tolist()
        shape = (len(runner.layers), runner.n_kv_heads, runner.code_groups + 1, runner.head_dim)
        return cls(
            prefill=FusedCall(runner, [-1, 0], offsets, width, sampling),
            round=FusedRound(runner, slot_depth, offsets, width, sampling),
            step=FusedRound(runner, [0], offsets[:0], 1, sampling),
            cache_shape=shape,
            dtype=runner.dtype,
            device=runner.device,
        )


class FusedLoop:
    """The inner loop over fused calls, the host walking integers (same noise, same codes and counts as
    rvqtts.engine.speculative.rounds's loops): the prefill and round calls for speculative frames, the prefill and the
    q = 1 step for plain ones (`plain_frame`). `sampling` is what the calls were built for."""

    def __init__(self, calls: FusedCalls, tree: Tree, sampling: SamplingConfig):
        self.calls, self.tree, self.sampling = calls, tree, sampling
        buffers = tree.buffers
        self.slot_depth = buffers.depth.tolist()
        self.node_rank = buffers.rank
        self.children = buffers.children
        self.capacity = calls.cache_shape[2]  # committed slots: h_t, c0 .. c_{G-1}
        self.code_groups = self.capacity - 1
        self.device = calls.device
        self.k_cache = torch.zeros(calls.cache_shape, device=self.device, dtype=calls.dtype)
        self.v_cache = torch.zeros(calls.cache_shape, device=self.device, dtype=calls.dtype)
        self.ancestors = torch.where(buffers.ancestor_mask.to(self.device), 0.0, MASKED)
        self.causal = torch.where(torch.ones(2, 2, dtype=torch.bool, device=self.device).tril(), 0.0, MASKED)
        self.itself = torch.zeros(1, 1, device=self.device)

    def mask(self, length: int, block: torch.Tensor) -> torch.Tensor:
        """[q, C + q]: the first `length` cache slots and the query's own visibility `block`."""
        q = block.shape[0]
        cache = torch.full((q, self.capacity), MASKED, device=self.device)
        cache[:, :length] = 0.0
        return torch.cat([cache, block], dim=1)

    def keep(self, new_k: torch.Tensor, new_v: torch.Tensor, slots: list[int], length: int) -> None:
        """Write the new keys and values of these query slots into the cache from slot `length` on."""
        chosen = torch.tensor(slots, device=self.device)
        self.k_cache[:, :, length : length + len(slots)] = new_k[:, :, chosen]
        self.v_cache[:, :, length : length + len(slots)] = new_v[:, :, chosen]

    def index(self, value: int) -> torch.Tensor:
        return torch.tensor([value], device=self.device)

    def start(self, prefix: torch.Tensor, noise: torch.Tensor) -> tuple[int, list[list[int]]]:
        """The frame's prefill: commits [h_t, c0] and returns c1 with the drafts made from h_1."""
        draws, ranks, new_k, new_v = self.calls.prefill(
            prefix, self.index(0), self.k_cache, self.v_cache, self.mask(0, self.causal), noise[[0, 0]]
        )
        self.keep(new_k, new_v, [0, 1], 0)
        return int(draws[1]), ranks[1].tolist()

    @torch.inference_mode()
    def frame(self, prefix: torch.Tensor, noise: torch.Tensor) -> FrameRounds:
        """c1..c_{G-1} of one frame from [h_t, embedding of c0] and the frame's noise [G-1, V], with its calls and
        accepted depths."""
        last = self.code_groups - 1
        root, drafts = self.start(prefix, noise)
        index, done = 1, FrameRounds(0, last, None, None)  # a done frame, its codes and counts filled in as they come
        while index < last:
            node_codes = [root] + [
                drafts[d - 1][r] if index + d <= last else 0 for d, r in zip(self.slot_depth[1:], self.node_rank[1:])
            ]
            slot_index = [index + d for d in self.slot_depth]
            rows = noise[[min(m, last - 1) for m in slot_index]]
            draws, ranks, new_k, new_v = self.calls.round(
                torch.tensor(node_codes, device=self.device),
                self.index(index),
                self.k_cache,
                self.v_cache,
                self.mask(index + 1, self.ancestors),
                rows,
            )
            done.calls += 1
            accepted, final = walk_tree(self.children, node_codes, draws.tolist(), slot_index, last)
            done.accepted.append(len(accepted))
            done.codes += [root, *(node_codes[u] for u in accepted)]
            self.keep(new_k, new_v, [0, *accepted], index + 1)
            if final is None:
                break
            end = accepted[-1] if accepted else 0
            root, drafts, index = final, ranks[end].tolist(), slot_index[end] + 1
        else:  # the rounds reached the frame's last code: it is the root
            done.codes.append(root)
        return done

    @torch.inference_mode()
    def plain_frame(self, prefix: torch.Tensor, noise: torch.Tensor) -> FrameRounds:
        """c1..c_{G-1} of one frame with one call per code (`--no-spec`)."""
        last = self.code_groups - 1
        codes = [self.start(prefix, noise)[0]]
        for index in range(1, last):
            draws, new_k, new_v = self.calls.step(
                torch.tensor(codes[-1:], device=self.device),
                self.index(index),
                self.k_cache,
                self.v_cache,
                self.mask(index + 1, self.itself),
                noise[[index]],
            )
            self.keep(new_k, new_v, [0], index + 1)
            codes.append(int(draws[0]))
        return FrameRounds(0, last, None, None, codes=codes, calls=last)
