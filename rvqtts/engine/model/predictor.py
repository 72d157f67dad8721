"""The code predictor (the paper's MultiCodeDecoder) run by hand on the loaded qwen-tts module's weights: a static KV
cache, explicit positions and attention masks, no Hugging Face `generate()` or cache objects, so that one call can
carry a whole draft tree, or a row per frame of a batch. Its numerics follow qwen-tts's; the frame's sequence layout
and the attention paths: docs/engine.md, "The predictor call"."""

from __future__ import annotations

from collections import OrderedDict

import torch

from rvqtts.engine.model.attention import attention_width, row_attention_exact
from rvqtts.engine.model.kernels import LinearMap, kernels_used, make_map, module_map
from rvqtts.engine.model.transformer import CachedDecoder
from rvqtts.support.memory import drop_file_pages


class PredictorRunner(CachedDecoder):
    """Forward passes of one utterance's code predictor over a preallocated KV cache of `max_len` slots."""

    def __init__(self, code_predictor: torch.nn.Module, max_len: int, weights: str = "native"):
        config = code_predictor.config
        weight = code_predictor.lm_head[0].weight
        # Where this machine keeps a query's bits whatever else is in the call (rvqtts.engine.model.attention), every
        # query attends over `width` slots through small batched products; elsewhere rounds gather per depth.
        self.row_attention = row_attention_exact(config, weight.device, weight.dtype)
        self.width = attention_width(config.num_code_groups)
        if self.row_attention:
            max_len = max(max_len, self.width)
        super().__init__(
            code_predictor.model.layers,
            code_predictor.model.norm,
            config,
            max_len,
            weight.device,
            weight.dtype,
            weights,
        )
        self.heads = [module_map(head, weights) for head in code_predictor.lm_head]
        self.embeddings = code_predictor.model.codec_embedding
        # The talker's states to the predictor's width where the talker is wider (1.7B), its bias added
        # apart from the kernel, so that a one-row call rounds as a many-row one does.
        projection = code_predictor.small_to_mtp_projection
        linear = isinstance(projection, torch.nn.Linear)
        self.project = make_map(projection.weight, None, weights) if linear else projection
        self.project_bias = projection.bias if linear else None
        maps = self.heads + ([self.project] if linear else [])
        drop_file_pages([tensor for linear_map in maps for tensor in linear_map.unread()])
        self.code_groups = config.num_code_groups
        self.vocab_size = config.vocab_size
        # Positions never exceed the frame length plus the deepest draft: a small table serves them all.
        positions = torch.arange(max_len + self.code_groups, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = code_predictor.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]
        self.causal = torch.ones(max_len, max_len, device=self.device, dtype=torch.bool).tril()

    def allocate(self, max_len: int, rows: int | None = None) -> None:
        """Fresh caches (CachedDecoder.allocate), and no layout kept: a layout's slots were computed for the caches
        it was built on (a batch's rows), and the caches may now hold fewer."""
        super().allocate(max_len, rows)
        # recent round calls' layouts (rvqtts.engine.speculative.rounds)
        self.round_layouts: OrderedDict = OrderedDict()
        self.step_layouts: dict = {}  # plain steps' (`step_layout`)

    def project_input(self, embeds: torch.Tensor) -> torch.Tensor:
        """Embeddings [q, E] to the layers' width (the module's projection, bias added after the map)."""
        x = self.project(embeds.to(self.dtype))
        return x if self.project_bias is None else x + self.project_bias

    def prefill(self, prefix: torch.Tensor) -> torch.Tensor:
        """One frame's first call: [h_t, embedding of c0] at positions 0 and 1 of batch row 0. Returns h_1."""
        return self.prefill_rows(prefix[None])[0]

    def step(self, code: torch.Tensor, index: int) -> torch.Tensor:
        """One frame's plain step in batch row 0: code c_index (a 1-element tensor) at position index + 1.
        Returns h_{index+1}."""
        return self.step_rows(code.view(1), index)[0]

    def prefill_rows(self, prefixes: torch.Tensor) -> torch.Tensor:
        """The first call of n frames at once, frame r in batch row r: prefixes [n, 2, E] ([h_t, embedding
        of c0] each). Each row's queries attend to their own slots only, as `prefill` does for one frame
        (the same bits: rows are invariant). Returns each frame's h_1 [n, hidden]."""
        n = prefixes.shape[0]
        base = self.row_bases(n)
        positions = torch.arange(2, device=self.device)
        if not self.row_attention:  # row by row, each call shaped as a one-frame prefill's
            x = self.project_input(prefixes)
            cos, sin = self.cos[positions][None], self.sin[positions][None]
            regions = [slice(r * self.max_len, r * self.max_len + 2) for r in range(n)]  # no read back: graphs
            return torch.stack(
                [
                    self.run_layers(x[r], cos, sin, region, region, self.causal[:2, :2])[-1]
                    for r, region in enumerate(regions)
                ]
            )
        write = (base[:, None] + positions).flatten()
        slots = (base[:, None] + torch.arange(self.width, device=self.device)).repeat_interleave(2, 0)
        attention = {"rows": (slots, self.causal[:2, : self.width].repeat(n, 1))}
        out = self.forward_rows(prefixes.flatten(0, 1), positions.repeat(n), write, attention)
        return out.view(n, 2, -1)[:, -1]

    def step_rows(self, codes: torch.Tensor, index: int) -> torch.Tensor:
        """One plain step of n frames at once: code c_index of frame r ([n]) in batch row r. Returns each
        frame's h_{index+1} [n, hidden], the bits a step of the frame alone gives (rows are invariant)."""
        positions, write, attention = self.step_layout(codes.shape[0], index)
        return self.forward_rows(self.embeddings[index - 1](codes), positions, write, attention)

    def step_layout(self, n: int, index: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A step's positions, cache writes and attention for n frames at code `index` (built once per shape)."""
        key = (n, index, self.max_len, self.row_attention)
        if key not in self.step_layouts:
            slot, base = index + 1, self.row_bases(n)
            positions = torch.full((n,), slot, device=self.device, dtype=torch.long)
            if self.row_attention:
                slots = base[:, None] + torch.arange(self.width, device=self.device)
                attention = {"rows": (slots, self.causal[slot : slot + 1, : self.width].expand(n, -1))}
            else:
                reads = [(base[r] + torch.arange(slot + 1, device=self.device))[None] for r in range(n)]
                attention = {"groups": [(slice(r, r + 1), keys) for r, keys in enumerate(reads)]}
            self.step_layouts[key] = (positions, base + slot, attention)
        return self.step_layouts[key]

    def row_bases(self, rows: int) -> torch.Tensor:
        """The first cache slot of each of `rows` batch rows, the cache grown to hold them."""
        if rows > self.rows:
            self.allocate(self.max_len, rows)
        return torch.arange(rows, device=self.device) * self.max_len

    def forward_rows(
        self, embeds: torch.Tensor, positions: torch.Tensor, write: torch.Tensor, attention: dict
    ) -> torch.Tensor:
        """`forward` for queries of several batch rows: KV written to the slots `write` [q], attention by
        `rows` (each query's slots over the width) or `groups` (`run_layers`)."""
        x = self.project_input(embeds)
        return self.run_layers(x, self.cos[positions][None], self.sin[positions][None], write, self.width, **attention)

    @property
    def rounds_exact(self) -> bool:
        """Whether a tree round's queries get the bits plain steps give them: every map measured row-invariant, and
        attention by rows (measured exact on this device) or, on a CPU, gathered per depth (a CPU's attention computes
        a call's queries alike, whatever their number)."""
        maps_invariant = kernels_used(self.linear_maps())["row_invariant"] is True
        return maps_invariant and (self.row_attention or self.device.type == "cpu")

    def linear_maps(self) -> list[LinearMap]:
        """Every linear map a call may apply: the layers', the LM heads and the input projection's."""
        return self.layer_maps() + self.heads + ([self.project] if isinstance(self.project, LinearMap) else [])

    def logits(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """Scores of code c_index from hidden states [..., hidden] (the head LMH_index)."""
        return self.heads[index - 1](hidden)

    def keep(self, sources: list[int], destination: int) -> None:
        """Move the KV entries of `sources` (accepted tree slots) to the slots from `destination` on (nothing to move
        where they are there already: a path of first-ranked drafts)."""
        if sources == list(range(destination, destination + len(sources))):
            return
        src = torch.tensor(sources, device=self.device)
        dst = torch.arange(destination, destination + len(sources), device=self.device)
        for cache in (self.k_cache, self.v_cache):
            cache[:, :, dst] = cache[:, :, src]
