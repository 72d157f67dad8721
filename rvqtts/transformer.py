"""A Qwen3 decoder stack run by hand over a static KV cache: what the talker and the code predictor share.

Both of qwen-tts's transformers are the same Qwen3 layer (RMSNorm, q/k norms, RoPE, grouped-query SDPA
attention, a SiLU-gated MLP); they differ in what goes in (embeddings, projections), in their position
tables and in their heads. This class owns the layers' forward pass over the loaded modules' own
weights; `rvqtts.predictor` and `rvqtts.talker` add the rest. Numerics follow qwen-tts: RMSNorm in
float32 (the modules' own), RoPE tables computed by the model's rotary module and cast to its dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rvqtts.quantize import Int8Map, check_weights


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


PACKED_ROWS = 32  # rows per call of a packed map: up to here each row gets torch.mv's bits (docs/engine.md)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether maps on `device` in `dtype` may take oneDNN-packed weights: bfloat16 on CPUs with oneDNN's
    bfloat16 kernels (float32's packed kernel gives rows other bits than a step's, so it is not used).
    Each map's shape is then probed (`packed_rows_match_mv`)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def packed_rows_match_mv(out_features: int, in_features: int) -> bool:
    """Whether this machine's packed kernel gives every row of a call of 1 to PACKED_ROWS rows torch.mv's
    bits for a bfloat16 map of this shape (kernels are chosen per CPU and shape): probed once per shape
    on random weights, about 50 ms for a 1024 x 1024 map."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    rows = torch.randn(PACKED_ROWS, in_features, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        steps = torch.stack([torch.mv(weight, row) for row in rows])
        return all(torch.equal(torch.ops.mkldnn._linear_pointwise(rows[:n], packed, None, "none", [], ""), steps[:n])
                   for n in range(1, PACKED_ROWS + 1))


class LinearMap:
    """A linear map (weight [out, in], optional bias) as the hot loops apply it.

    One row without bias goes through torch.mv on CPUs: one-row bfloat16 F.linear ran at about 60 % of
    its speed (2-vCPU Xeon with AMX) and gives the same bits. With `pack`, the map also holds its weights
    reordered once for oneDNN's bfloat16 kernel: a 16-row call then costs about what one row does, where
    F.linear costs 1.5x (docs/benchmarks.md), and each row's result equals torch.mv's bit for bit for up
    to PACKED_ROWS rows per call (`packed_rows_match_mv` checks the shape; a map whose shape fails is
    not packed), so more rows go in chunks of that many: a tree round's rows are what plain steps compute.
    Packing costs a second copy of the weights. Not while tracing (Core ML export), whose graphs keep
    F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False):
        self.weight, self.bias = weight, bias
        self.packed = None
        if pack and packed_rows_match_mv(*weight.shape):
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def reads(self) -> list[torch.Tensor]:
        """The tensors a call reads (a packed copy holds the weight's bytes in another order)."""
        return [self.weight] + ([] if self.bias is None else [self.bias])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or torch.jit.is_tracing():
            return F.linear(x, self.weight, self.bias)
        if self.bias is None and x.dim() == 1:
            return torch.mv(self.weight, x)
        if self.bias is None and x.dim() == 2 and x.shape[0] == 1:
            return torch.mv(self.weight, x[0])[None]
        if self.packed is not None and x.dim() == 2:
            parts = [torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
                     for rows in x.split(PACKED_ROWS)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return F.linear(x, self.weight, self.bias)


Map = LinearMap | Int8Map


def make_map(weight: torch.Tensor, bias: torch.Tensor | None, weights: str = "native", pack: bool = False) -> Map:
    """The map of `weight` as `weights` asks: the dtype's own (packed where `pack`), or 8-bit."""
    return Int8Map(weight, bias) if weights == "int8" else LinearMap(weight, bias, pack)


def module_map(linear: torch.nn.Linear, weights: str = "native", pack: bool = False) -> Map:
    return make_map(linear.weight, linear.bias, weights, pack)


def _stacked(*maps: torch.nn.Linear, weights: str = "native", pack: bool = False) -> Map:
    """One linear map computing `maps` side by side. The maps' own parameters become views of the stacked
    tensors (same values), so the model's weights are held once, not twice."""
    stacked = []
    for name in ("weight", "bias"):
        if getattr(maps[0], name) is None:
            stacked.append(None)
            continue
        joined = torch.cat([getattr(m, name).detach() for m in maps])
        start = 0
        for m in maps:
            part = getattr(m, name)
            part.data = joined[start:start + part.shape[0]]
            start += part.shape[0]
        stacked.append(joined)
    return make_map(stacked[0], stacked[1], weights, pack)


class CachedDecoder:
    """The layers of a loaded Qwen3 decoder with a preallocated KV cache of `max_len` slots."""

    def __init__(self, layers: torch.nn.ModuleList, norm: torch.nn.Module, config: object, max_len: int,
                 device: torch.device, dtype: torch.dtype, weights: str = "native", pack: bool = False):
        check_weights(weights, device)
        self.layers, self.norm = layers, norm
        self.weights, self.pack = weights, pack and weights == "native"
        self.device, self.dtype = device, dtype
        self.hidden_size = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One matrix product for q, k and v, and one for the MLP's gate and up maps: fewer, larger kernels
        # (on a 2-core CPU in bf16 this cut the linear maps' time by about a tenth; docs/benchmarks.md).
        kind = dict(weights=weights, pack=self.pack)
        self.qkv = [_stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, **kind)
                    for layer in layers]
        self.gate_up = [_stacked(layer.mlp.gate_proj, layer.mlp.up_proj, **kind) for layer in layers]
        self.out = [module_map(layer.self_attn.o_proj, **kind) for layer in layers]
        self.down = [module_map(layer.mlp.down_proj, **kind) for layer in layers]
        self.q_width = self.n_heads * self.head_dim
        self.kv_width = self.n_kv_heads * self.head_dim
        self.allocate(max_len)

    def layer_maps(self) -> list[Map]:
        """Every layer's linear maps (what each call applies)."""
        return [*self.qkv, *self.out, *self.gate_up, *self.down]

    def allocate(self, max_len: int) -> None:
        """Fresh, zeroed K and V caches of `max_len` slots per layer."""
        self.max_len = max_len
        shape = (len(self.layers), self.n_kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write: slice | torch.Tensor,
                   span: int, mask: torch.Tensor | None = None,
                   groups: list[tuple[slice, torch.Tensor]] | None = None) -> torch.Tensor:
        """The layers over states x [q, hidden] with RoPE tables `cos`, `sin` [1, q, d]; their keys and values
        go to the cache slots `write` (a slice, or a tensor of slot indices, which keeps shapes static), and
        attention reads slots 0..span-1. `mask` [q, span] says which slots each query attends to; `groups`
        instead gives, for slices of the queries, the slots [n, L] each one attends to in order; with
        neither, every query sees every slot read. Returns the final-normed hidden states [q, hidden]."""
        attn_mask = None if mask is None else mask[None, None]
        for i in range(len(self.layers)):
            q, k, v = self.attention_inputs(i, x, cos, sin)
            if isinstance(write, slice):
                self.k_cache[i, :, write] = k
                self.v_cache[i, :, write] = v
            else:
                self.k_cache[i].index_copy_(1, write, k)
                self.v_cache[i].index_copy_(1, write, v)
            if groups is None:
                # 4-D inputs take torch's fused CPU attention kernel (3-D ones fall back to the unfused math).
                out = self.attend(q[None], self.k_cache[None, i, :, :span], self.v_cache[None, i, :, :span],
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
        q, k, v = self.qkv[i](layer.input_layernorm(x)).split(
            [self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = layer.self_attn.q_norm(q.view(-1, self.n_heads, self.head_dim)).transpose(0, 1)
        k = layer.self_attn.k_norm(k.view(-1, self.n_kv_heads, self.head_dim)).transpose(0, 1)
        v = v.view(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def layer_rest(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer i after attention: output map and residual, then the MLP (gate and up fused) and residual.
        `attended` is the attention output [heads, q, d]."""
        layer = self.layers[i]
        x = x + self.out[i](attended.transpose(0, 1).flatten(1))
        gate, up = self.gate_up[i](layer.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down[i](layer.mlp.act_fn(gate) * up)
