"""The talker (the paper's CodeDecoder) run by hand on the loaded qwen-tts module's weights, in the code predictor's
style (rvqtts.engine.model.transformer): one prefill over the prompt, then one step per frame over a KV cache that grows
as utterances need, a region per batch row. One RoPE table serves MRoPE's three axes, whose position ids are all
equal for one unpadded utterance. docs/engine.md, "Where it sits in qwen-tts"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.kernels import module_map
from rvqtts.engine.model.transformer import CachedDecoder
from rvqtts.support.memory import drop_file_pages

CAPACITY_STEP = 256  # the cache grows in these many slots; CUDA graphs attend over spans rounded to it


@dataclass
class Prompt:
    """What the talker starts from: the prefill [L, hidden], the text embeddings that follow it one per
    frame [T, hidden], and the pad embedding [hidden] that follows those."""

    embeds: torch.Tensor
    trailing: torch.Tensor
    pad: torch.Tensor

    @property
    def length(self) -> int:
        return self.embeds.shape[0]

    def text_after(self, frame: int) -> torch.Tensor:
        """What is added to the step input that follows `frame` (qwen-tts's `trailing_text_hidden`
        entry for that generation step, else the pad embedding)."""
        return self.trailing[frame] if frame < self.trailing.shape[0] else self.pad


class TalkerRunner(CachedDecoder):
    """Prefill and per-frame steps of the talker over a KV cache that grows as utterances need.

    With `calls` in a static mode (CUDA graphs), a step's shapes depend only on its span, the slots it
    attends to rounded up to CAPACITY_STEP: the step is captured once per span and replayed, its position
    a tensor and the slots beyond it masked. Eagerly (CPUs), the same step attends to exactly its slots.
    """

    def __init__(self, talker: torch.nn.Module, calls: StaticCalls | None = None, weights: str = "native"):
        self.rotary = talker.model.rotary_emb
        self.head = module_map(talker.codec_head, weights)
        self.codec_embedding = talker.model.codec_embedding
        self.predictor_embeddings = talker.code_predictor.model.codec_embedding
        self.calls = calls or StaticCalls()
        weight = talker.codec_head.weight
        super().__init__(
            talker.model.layers, talker.model.norm, talker.config, CAPACITY_STEP, weight.device, weight.dtype, weights
        )
        self.vocab_size = talker.config.vocab_size
        drop_file_pages(self.head.unread())

    def allocate(self, max_len: int, rows: int | None = None) -> None:
        """Caches and RoPE tables for `max_len` positions per batch row, keeping what the old caches hold
        row by row (captured graphs read the old tensors: they start over)."""
        old = (self.k_cache, self.v_cache, self.max_len, self.rows) if hasattr(self, "k_cache") else None
        super().allocate(max_len, rows)
        if old is not None:
            old_k, old_v, old_len, old_rows = old
            kept, rows = min(old_len, max_len), min(old_rows, self.rows)
            for cache, before in ((self.k_cache, old_k), (self.v_cache, old_v)):  # [layers, heads, row x length, d]
                new, previous = cache.unflatten(2, (self.rows, max_len)), before.unflatten(2, (old_rows, old_len))
                new[:, :, :rows, :kept] = previous[:, :, :rows, :kept]
        positions = torch.arange(max_len, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.rotary(probe, positions)  # [3, 1, max_len, head_dim]: three equal axes
        self.cos, self.sin = cos[0, 0], sin[0, 0]
        self.calls = StaticCalls(self.calls.mode)

    def reserve(self, slots: int, rows: int = 1) -> None:
        """Make room for `slots` positions (a prompt and the frames it may take) in each of `rows` rows."""
        if slots > self.max_len or rows > self.rows:
            self.allocate(max(self.max_len, -(-slots // CAPACITY_STEP) * CAPACITY_STEP), max(rows, self.rows))

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt [L, hidden] at positions 0..L-1 of batch row `row`. Returns the last position's
        hidden state h [hidden] and its logits [vocab] (the scores of the first frame's c0)."""
        length = embeds.shape[0]
        self.reserve(length, row + 1)
        causal = torch.ones(length, length, device=self.device, dtype=torch.bool).tril()
        region = slice(row * self.max_len, row * self.max_len + length)
        hidden = self.run_layers(
            embeds.to(self.dtype), self.cos[None, :length], self.sin[None, :length], region, region, causal, prompt=True
        )[-1]
        return hidden, self.head(hidden)

    @torch.inference_mode()
    def step(self, embed: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame's input [1, hidden] at `position`. Returns (h [hidden], logits [vocab]), which a
        replayed graph overwrites on its next replay: read them first."""
        self.reserve(position + 1)
        index = torch.full((1,), position, device=self.device, dtype=torch.long)
        if self.calls.mode == "eager":
            return self._step(embed, index, position + 1)
        span = self.static_span(position)
        return self.calls(("talker", span), lambda e, i: self._step(e, i, span), embed, index)

    def static_span(self, position: int) -> int:
        """The slots a static step at `position` attends to: the position's, rounded up to CAPACITY_STEP."""
        return min(self.max_len, -(-(position + 1) // CAPACITY_STEP) * CAPACITY_STEP)

    def _step(self, embed: torch.Tensor, index: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step at position `index` (a 1-element tensor), attending to the first `span` slots, masked
        beyond the position where the span is longer."""
        mask = None if self.calls.mode == "eager" else (torch.arange(span, device=self.device) <= index)[None]
        cos, sin = self.cos[index][None], self.sin[index][None]
        hidden = self.run_layers(embed.to(self.dtype), cos, sin, index, span, mask)[0]
        return hidden, self.head(hidden)

    @torch.inference_mode()
    def step_rows(
        self, embeds: torch.Tensor, positions: list[int], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame's step for several utterances in one call: input [n, hidden] at `positions` of batch
        rows `rows`. Each row attends to its own slots only, as `step` does for one utterance (the same
        bits: rvqtts's kernels keep rows invariant), eagerly; with static calls (a GPU's), over its static span
        masked beyond its position, each row in an attention call of the shapes a captured step runs. One
        utterance in row 0 by `step` (its static calls). Returns (h [n, hidden], logits [n, vocab])."""
        if rows == [0]:
            hidden, logits = self.step(embeds, positions[0])
            return hidden[None], logits[None]
        self.reserve(max(positions) + 1, max(rows) + 1)
        position = torch.tensor(positions, device=self.device)
        base = torch.tensor(rows, device=self.device) * self.max_len
        width = max(positions) + 1
        slots = base[:, None] + torch.arange(width, device=self.device)
        if self.runs_natively():  # each query over its row's slots up to its own position
            attention = {"rows": (slots, torch.arange(width, device=self.device)[None] <= position[:, None])}
        elif self.calls.mode != "eager":  # each query as a captured step attends: its static span, masked
            spans = [(r * self.max_len, self.static_span(p), p) for r, p in zip(rows, positions)]
            attention = {
                "spans": [
                    (slice(b, b + span), (torch.arange(span, device=self.device) <= p)[None]) for b, span, p in spans
                ]
            }
        else:  # each query alone, as a step's attention: its row's slots 0..position
            attention = {"groups": [(slice(r, r + 1), slots[r : r + 1, : p + 1]) for r, p in enumerate(positions)]}
        hidden = self.run_layers(
            embeds.to(self.dtype),
            self.cos[position][None],
            self.sin[position][None],
            base + position,
            width,
            **attention,
        )
        return hidden, self.head(hidden)

    @torch.inference_mode()
    def code_embedding(self, c0: torch.Tensor) -> torch.Tensor:
        """The talker's embedding of c0 (a 1-element tensor) [1, hidden]: the inner loop's second input."""
        return self.codec_embedding(c0.view(1))

    @torch.inference_mode()
    def frame_input(self, codes: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The next step's input [1, hidden] after a frame's codes [G]: the sum of their embeddings (in the
        same order and shapes as qwen-tts sums them) plus `text` [hidden], the next text or pad embedding."""
        parts = [self.codec_embedding(codes[:1])] + [
            table(codes[i + 1 : i + 2]) for i, table in enumerate(self.predictor_embeddings)
        ]
        return torch.cat(parts)[None].sum(1) + text
