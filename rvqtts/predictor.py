"""The code predictor (the paper's MultiCodeDecoder) run by hand: static KV cache, explicit positions,
a boolean attention mask, no Hugging Face `generate()` and no cache objects.

The weights are the loaded qwen-tts module's own; this file only owns the forward pass, so one call
can carry a whole draft tree. Numerics follow qwen-tts: RMSNorm in float32, RoPE tables computed in
float32 by the model's own rotary module and cast to the model dtype, attention through SDPA.

Sequence layout within a frame: slot/position 0 holds the talker's hidden state h_t, 1 holds the
talker's embedding of c0, and position m + 1 holds code c_m (embedded with `codec_embedding[m - 1]`).
The normed output at position m is h_m, and `lm_head[m - 1](h_m)` scores c_m.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _stacked(*maps: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of one linear map computing `maps` side by side."""
    bias = None if maps[0].bias is None else torch.cat([m.bias for m in maps]).detach()
    return torch.cat([m.weight for m in maps]).detach(), bias


class PredictorRunner:
    """Forward passes of one utterance's code predictor over a preallocated KV cache of `max_len` slots."""

    def __init__(self, code_predictor: torch.nn.Module, max_len: int):
        config = code_predictor.config
        weight = code_predictor.lm_head[0].weight
        self.device, self.dtype = weight.device, weight.dtype
        self.layers = code_predictor.model.layers
        self.norm = code_predictor.model.norm
        self.heads = code_predictor.lm_head
        self.embeddings = code_predictor.model.codec_embedding
        self.project = code_predictor.small_to_mtp_projection
        self.code_groups = config.num_code_groups
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_len = max_len
        shape = (len(self.layers), self.n_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        # Positions never exceed the frame length plus the deepest draft: a small table serves them all.
        positions = torch.arange(max_len + self.code_groups, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = code_predictor.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]
        self.causal = torch.ones(max_len, max_len, device=self.device, dtype=torch.bool).tril()
        # One matrix product for q, k and v, and one for the MLP's gate and up maps: fewer, larger kernels
        # (on a 2-core CPU in bf16 this cut the linear maps' time by about a tenth; docs/benchmarks.md).
        self.qkv = [_stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
                    for layer in self.layers]
        self.gate_up = [_stacked(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]
        self.q_width = self.n_heads * self.head_dim
        self.kv_width = self.n_kv_heads * self.head_dim

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, start: int,
                mask: torch.Tensor | None = None,
                groups: list[tuple[slice, torch.Tensor]] | None = None) -> torch.Tensor:
        """Run `embeds` [q, E] at `positions` [q], writing their KV to slots start..start+q-1.

        `mask` [q, max_len] says which cache slots each query attends to (after this call's writes);
        `groups` instead gives, for slices of the queries, the slots [n, L] each query attends to in
        order (a tree round: rvqtts.decode.RoundPlan.attention_groups); with neither, every query sees
        every slot up to its own writes (a single query, as in plain steps).
        Returns the final-normed hidden states [q, hidden], the input of the LM heads.
        """
        q_len = embeds.shape[0]
        end = start + q_len  # attention reads only the slots written so far
        x = self.project(embeds.to(self.dtype))
        cos, sin = self.cos[positions][None], self.sin[positions][None]
        attn_mask = None if mask is None else mask[None, None, :, :end]
        for i in range(len(self.layers)):
            q, k, v = self.attention_inputs(i, x, cos, sin)
            self.k_cache[i, :, start:end] = k
            self.v_cache[i, :, start:end] = v
            if groups is None:
                # 4-D inputs take torch's fused CPU attention kernel (3-D ones fall back to the unfused math).
                out = self.attend(q[None], self.k_cache[None, i, :, :end], self.v_cache[None, i, :, :end],
                                  attn_mask)[0]
            else:
                out = torch.cat([self.attend_gathered(i, q[:, rows], slots) for rows, slots in groups], dim=1)
            x = self.layer_rest(i, x, out)
        return self.norm(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)

    def attend_gathered(self, i: int, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Layer i's attention of queries [heads, n, d], each over its own cache slots `slots` [n, L]:
        a batch of n single-query attentions, each computed as a plain step computes its one query."""
        keys = self.k_cache[i][:, slots].transpose(0, 1)  # [n, kv_heads, L, d]
        values = self.v_cache[i][:, slots].transpose(0, 1)
        return self.attend(q.transpose(0, 1)[:, :, None], keys, values)[:, :, 0].transpose(0, 1)

    def attention_inputs(self, i: int, x: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's queries [heads, q, d] and keys, values [kv_heads, q, d] for states x [q, hidden]:
        one fused map, the q/k norms, then RoPE with the slots' `cos`, `sin` [1, q, d]. Nothing reads
        x's shape, so traced graphs hold no size lookups (Core ML's converter mishandles them)."""
        layer = self.layers[i]
        q, k, v = F.linear(layer.input_layernorm(x), *self.qkv[i]).split(
            [self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = layer.self_attn.q_norm(q.view(-1, self.n_heads, self.head_dim)).transpose(0, 1)
        k = layer.self_attn.k_norm(k.view(-1, self.n_kv_heads, self.head_dim)).transpose(0, 1)
        v = v.view(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def layer_rest(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer i after attention: output map and residual, then the MLP (gate and up fused) and residual.
        `attended` is the attention output [heads, q, d]."""
        layer = self.layers[i]
        x = x + layer.self_attn.o_proj(attended.transpose(0, 1).flatten(1))
        gate, up = F.linear(layer.post_attention_layernorm(x), *self.gate_up[i]).chunk(2, dim=-1)
        return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def prefill(self, prefix: torch.Tensor) -> torch.Tensor:
        """The frame's first call: [h_t, embedding of c0] at positions 0 and 1. Returns h_1."""
        positions = torch.arange(2, device=self.device)
        return self.forward(prefix, positions, 0, self.causal[:2])[-1]

    def step(self, code: torch.Tensor, index: int) -> torch.Tensor:
        """One plain step: code c_index (a 1-element tensor) at position index + 1. Returns h_{index+1}."""
        slot = index + 1
        embed = self.embeddings[index - 1](code.view(1))
        positions = torch.full((1,), slot, device=self.device, dtype=torch.long)
        return self.forward(embed, positions, slot, None)[0]

    def embed_codes(self, codes: torch.Tensor, first_index: int, depth_slices: list[slice]) -> torch.Tensor:
        """Embed a round's query: the codes in `depth_slices[d]` are c_{first_index + d}."""
        parts = [self.embeddings[first_index + d - 1](codes[s]) for d, s in enumerate(depth_slices)]
        return torch.cat(parts)

    def logits(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """Scores of code c_index from hidden states [..., hidden] (the head LMH_index)."""
        return self.heads[index - 1](hidden)

    def keep(self, sources: list[int], destination: int) -> None:
        """Move the KV entries of `sources` (accepted tree slots) to the slots from `destination` on."""
        if not sources:
            return
        src = torch.tensor(sources, device=self.device)
        dst = torch.arange(destination, destination + len(sources), device=self.device)
        for cache in (self.k_cache, self.v_cache):
            cache[:, :, dst] = cache[:, :, src]
