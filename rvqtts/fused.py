"""The fused speculative round: one static-shape call verifies a tree and drafts the next round.

This is the form the paper runs on the Neural Engine, and the module rvqtts hands to Core ML: every
shape is fixed by the tree, every input is a tensor, and the outputs are integers the host walks with.
Inputs: the query's codes, the index of its root code, the committed KV cache, an additive mask, and
one Gumbel noise row per slot. Outputs: at every slot, the target's draw of the next code and the
top-m draft ranks for the K codes after it (LMH_{m+1+j}(h + b_j)), so the next round's tree comes
from this call and no separate draft step runs; and the slots' new keys and values, which the host
writes into its cache for the root and the accepted nodes only.

Unlike the eager round (rvqtts.decode), the tree is never cut near the frame's end: slots past c15
compute clamped nonsense that nothing attends to and the walk never reaches, so one graph serves a
whole frame. Attention reads [cache; new slots] through the mask, so the graph has no dynamic writes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rvqtts.decode import walk_tree
from rvqtts.predictor import PredictorRunner
from rvqtts.sampling import SamplingConfig, warp_logits
from rvqtts.tree import Tree

MASKED = -3e4  # additive mask value for hidden slots; representable in float16


class FusedCall(torch.nn.Module):
    """One predictor call over slots of fixed depths (-1: a slot that scores nothing, as h_t in the
    prefill). Slot u at depth d holds code c_{index+d}; it scores c_{index+d+1} and drafts the K after."""

    def __init__(self, runner: PredictorRunner, slot_depth: list[int], offsets: torch.Tensor, draft_width: int,
                 sampling: SamplingConfig):
        super().__init__()
        self.runner, self.sampling, self.draft_width = runner, sampling, draft_width
        self.offsets = offsets.to(runner.device, runner.dtype)
        self.depth = len(offsets)
        self.heads = torch.stack([head.weight for head in runner.heads]).detach()  # [G-1, V, H]: c_m by [m-1]
        self.slot_depth = torch.tensor(slot_depth, device=runner.device)
        depths = sorted(set(slot_depth) - {-1})
        self.groups = [(d, slot_depth.index(d), len(slot_depth) - slot_depth[::-1].index(d)) for d in depths]

    def head(self, code_index: torch.Tensor) -> torch.Tensor:
        """LMH for code c_{code_index} ([V, H]), clamped to the last head past the frame's end."""
        return self.heads[(code_index - 1).clamp(0, len(self.heads) - 1)].reshape(self.heads.shape[1:])

    def forward(self, embeds: torch.Tensor, index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mask: torch.Tensor, noise: torch.Tensor):
        """embeds [q, E], index [1] (code index of depth 0; Core ML takes no rank-0 inputs), caches [L, kv_heads, C, head_dim], mask
        [q, C + q] additive, noise [q, V]. Returns draws [q], draft ranks [q, K, m], new keys and values
        [L, kv_heads, q, head_dim]."""
        runner = self.runner
        positions = (index + 1 + self.slot_depth).clamp(min=0)
        x = runner.project(embeds.to(runner.dtype))
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
        hidden = runner.norm(x)
        q_len = hidden.shape[0]
        draws = torch.zeros(q_len, dtype=torch.long, device=hidden.device)
        ranks = torch.zeros(q_len, self.depth, self.draft_width, dtype=torch.long, device=hidden.device)
        for d, start, stop in self.groups:
            rows = hidden[start:stop]
            scores = warp_logits(rows @ self.head(index + d + 1).T, self.sampling)
            if self.sampling.do_sample:
                scores = scores + noise[start:stop]
            draws[start:stop] = scores.argmax(-1)
            for j in range(1, self.depth + 1):
                drafted = (rows + self.offsets[j - 1]) @ self.head(index + d + 1 + j).T
                ranks[start:stop, j - 1] = torch.topk(drafted.float(), self.draft_width, dim=-1).indices
        return draws, ranks, torch.stack(new_k), torch.stack(new_v)


class FusedRound(FusedCall):
    """A round of slots at fixed depths (a tree's, or [0] for a plain step), with its codes embedded in
    the graph: slot u's code c_{index+d_u} by its own table."""

    def __init__(self, runner: PredictorRunner, slot_depth: list[int], offsets: torch.Tensor, draft_width: int,
                 sampling: SamplingConfig):
        super().__init__(runner, slot_depth, offsets, draft_width, sampling)
        self.tables = torch.stack([table.weight for table in runner.embeddings]).detach()  # [G-1, V, E]

    def forward(self, codes: torch.Tensor, index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mask: torch.Tensor, noise: torch.Tensor):
        """codes [q]: the root c_index, then the tree's nodes (anything past c15 is ignored)."""
        table = (index + self.slot_depth - 1).clamp(0, len(self.tables) - 1)
        return super().forward(self.tables[table, codes], index, k_cache, v_cache, mask, noise)


class FusedDecoder:
    """Frames decoded by fused calls with the host walking integers: the reference for Core ML's calls
    (same noise, same codes as rvqtts.decode's loops). Speculative frames use the prefill and round
    calls; plain frames (`decode_plain`) a draft-free prefill and a q = 1 step."""

    def __init__(self, runner: PredictorRunner, tree: Tree, offsets: torch.Tensor, sampling: SamplingConfig):
        self.runner, self.tree = runner, tree
        width = max(tree.max_rank_by_depth())
        buffers = tree.buffers
        self.slot_depth = buffers.depth.tolist()
        self.node_rank = buffers.rank
        self.children = buffers.children
        self.prefill = FusedCall(runner, [-1, 0], offsets, width, sampling)
        self.round = FusedRound(runner, self.slot_depth, offsets, width, sampling)
        no_drafts = offsets[:0]
        self.plain_prefill = FusedCall(runner, [-1, 0], no_drafts, 1, sampling)
        self.step = FusedRound(runner, [0], no_drafts, 1, sampling)
        self.capacity = runner.code_groups + 1  # committed slots: h_t, c0 .. c15
        shape = (len(runner.layers), runner.n_kv_heads, self.capacity, runner.head_dim)
        self.k_cache = torch.zeros(shape, device=runner.device, dtype=runner.dtype)
        self.v_cache = torch.zeros(shape, device=runner.device, dtype=runner.dtype)
        block = buffers.ancestor_mask.to(runner.device)
        self.ancestors = torch.where(block, 0.0, MASKED)
        self.causal = torch.where(torch.ones(2, 2, dtype=torch.bool, device=runner.device).tril(), 0.0, MASKED)

    def mask(self, length: int, block: torch.Tensor) -> torch.Tensor:
        """[q, C + q]: the first `length` cache slots and the query's own visibility `block`."""
        q = block.shape[0]
        cache = torch.full((q, self.capacity), MASKED, device=self.runner.device)
        cache[:, :length] = 0.0
        return torch.cat([cache, block], dim=1)

    def keep(self, new_k: torch.Tensor, new_v: torch.Tensor, slots: list[int], length: int) -> None:
        """Write the new keys and values of these query slots into the cache from slot `length` on."""
        chosen = torch.tensor(slots, device=self.runner.device)
        self.k_cache[:, :, length:length + len(slots)] = new_k[:, :, chosen]
        self.v_cache[:, :, length:length + len(slots)] = new_v[:, :, chosen]

    @torch.inference_mode()
    def decode(self, prefix: torch.Tensor, noise: torch.Tensor) -> tuple[list[int], int]:
        """c1..c_{G-1} of one frame from [h_t, embedding of c0] and the frame's noise [G-1, V]; returns
        the codes and the number of calls."""
        runner, last = self.runner, self.runner.code_groups - 1
        draws, ranks, new_k, new_v = self.prefill(prefix, torch.tensor([0], device=runner.device), self.k_cache, self.v_cache,
                                                  self.mask(0, self.causal), noise[[0, 0]])
        self.keep(new_k, new_v, [0, 1], 0)
        root, drafts, index, calls = int(draws[1]), ranks[1].tolist(), 1, 1
        codes: list[int] = []
        while index < last:
            node_codes = [root] + [drafts[d - 1][r] if index + d <= last else 0
                                   for d, r in zip(self.slot_depth[1:], self.node_rank[1:])]
            slot_index = [index + d for d in self.slot_depth]
            rows = noise[[min(m, last - 1) for m in slot_index]]
            draws, ranks, new_k, new_v = self.round(torch.tensor(node_codes, device=runner.device),
                                                    torch.tensor([index], device=runner.device), self.k_cache,
                                                    self.v_cache, self.mask(index + 1, self.ancestors), rows)
            calls += 1
            accepted, final = walk_tree(self.children, node_codes, draws.tolist(), slot_index, last)
            codes.append(root)
            codes.extend(node_codes[u] for u in accepted)
            self.keep(new_k, new_v, [0, *accepted], index + 1)
            if final is None:
                return codes, calls
            end = accepted[-1] if accepted else 0
            root, drafts, index = final, ranks[end].tolist(), slot_index[end] + 1
        codes.append(root)
        return codes, calls

    @torch.inference_mode()
    def decode_plain(self, prefix: torch.Tensor, noise: torch.Tensor) -> list[int]:
        """c1..c_{G-1} of one frame with one call per code (`--no-spec`)."""
        runner, last = self.runner, self.runner.code_groups - 1
        draws, _, new_k, new_v = self.plain_prefill(prefix, torch.tensor([0], device=runner.device), self.k_cache,
                                                    self.v_cache, self.mask(0, self.causal), noise[[0, 0]])
        self.keep(new_k, new_v, [0, 1], 0)
        codes = [int(draws[1])]
        itself = torch.zeros(1, 1, device=runner.device)
        for index in range(1, last):
            draws, _, new_k, new_v = self.step(torch.tensor(codes[-1:], device=runner.device),
                                               torch.tensor([index], device=runner.device), self.k_cache,
                                               self.v_cache, self.mask(index + 1, itself), noise[[index]])
            self.keep(new_k, new_v, [0], index + 1)
            codes.append(int(draws[0]))
        return codes
