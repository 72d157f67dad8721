"""A Qwen3 decoder stack run by hand over a static KV cache: what the talker and the code predictor share.

Both of qwen-tts's transformers are the same Qwen3 layer (RMSNorm, q/k norms, RoPE, grouped-query SDPA
attention, a SiLU-gated MLP); they differ in what goes in (embeddings, projections), in their position
tables and in their heads. This class owns the layers' forward pass over the loaded modules' own
weights; `rvqtts.engine.model.predictor` and `rvqtts.engine.model.talker` add the rest. Numerics follow qwen-tts:
RMSNorm in float32 (the modules' own), RoPE tables computed by the model's rotary module and cast to its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rvqtts.engine.model import native
from rvqtts.engine.model.attention import attend_rows
from rvqtts.engine.model.kernels import LinearMap, in_row_chunks, make_map, module_map, one_row_count
from rvqtts.engine.model.quantize import check_weights
from rvqtts.support.memory import drop_file_pages


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _stacked(*maps: torch.nn.Linear, weights: str = "native") -> LinearMap:
    """One linear map computing `maps` side by side, the model's weights held once: where a call reads the stacked
    weight, the maps' own parameters become views of it (same values); where its kernel reads only a packed or
    8-bit copy, the stacked copy goes and the map keeps the parts (`LinearMap.keep_parts`: their checkpoint pages are
    the decoder's to drop, with every map's, `LinearMap.unread`)."""
    held = {name: [getattr(m, name) for m in maps] for name in ("weight", "bias")}
    parts = {name: None if tensors[0] is None else [t.detach() for t in tensors] for name, tensors in held.items()}
    joined = {name: None if tensors is None else torch.cat(tensors) for name, tensors in parts.items()}
    linear = make_map(joined["weight"], joined["bias"], weights)
    for name in ("weight", "bias") if linear.reads_weight else ("bias",):
        start = 0
        for tensor in held[name] if joined[name] is not None else ():
            tensor.data = joined[name][start : start + tensor.shape[0]]
            start += tensor.shape[0]
    if linear.reads_weight:  # the modules now view the stacked copy: the parts' checkpoint pages go here, while known
        drop_file_pages(parts["weight"])
    linear.keep_parts(parts["weight"])
    return linear


class CachedDecoder:
    """The layers of a loaded Qwen3 decoder with a preallocated KV cache of `max_len` slots."""

    def __init__(
        self,
        layers: torch.nn.ModuleList,
        norm: torch.nn.Module,
        config: object,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        weights: str = "native",
    ):
        check_weights(weights, device)
        self.layers, self.norm = layers, norm
        self.weights = weights
        self.device, self.dtype = device, dtype
        self.hidden_size = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One matrix product for q, k and v, and one for the MLP's gate and up maps: fewer, larger kernels
        # (on a 2-core CPU in bf16 this cut the linear maps' time by about a tenth; docs/benchmarks.md).
        # Each map's kernel is the one measured fastest for its shape on this machine (rvqtts.engine.model.kernels).
        self.qkv, self.out, self.gate_up, self.down = [], [], [], []
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.qkv.append(_stacked(attention.q_proj, attention.k_proj, attention.v_proj, weights=weights))
            self.out.append(module_map(attention.o_proj, weights))
            self.gate_up.append(_stacked(mlp.gate_proj, mlp.up_proj, weights=weights))
            self.down.append(module_map(mlp.down_proj, weights))
            # The checkpoint's pages this layer's maps hold copies of, dropped a layer at a time: so the peak holds
            # one layer's pages, not the model's (a drop per map cost 1 s a load at 0.6B; per layer 0.1-0.2 s).
            layer_maps = (self.qkv[-1], self.out[-1], self.gate_up[-1], self.down[-1])
            drop_file_pages([tensor for linear in layer_maps for tensor in linear.unread()])
        self.q_width = self.n_heads * self.head_dim
        self.kv_width = self.n_kv_heads * self.head_dim
        # Norms, RoPE and attention in one native call each where they run (rvqtts.engine.model.native): bfloat16 on a
        # CPU with it. torch's fused attention ran a bfloat16 query over 1,024 slots 6x slower than float32.
        self.native_rows = (
            device.type == "cpu"
            and dtype == torch.bfloat16
            and self.head_dim <= native.MAX_HEAD_DIM
            and native.unavailable() is None
        )
        # And where every map runs the library's own kernel, a whole layer in one call (no torch dispatch).
        maps = [
            native.layer_maps([self.qkv[i], self.out[i], self.gate_up[i], self.down[i]]) if self.native_rows else None
            for i in range(len(layers))
        ]
        self.native_layers = maps if all(maps) else None
        # Off the CPU, norms run at one row count, as the maps do (rvqtts.engine.model.kernels.in_row_chunks).
        self.norms_in_chunks = one_row_count(device)
        self.allocate(max_len)

    @property
    def prompt_maps_differ(self) -> bool:
        """Whether some map runs a prompt's rows by another kernel than a step's (`LinearMap.many`)."""
        return any(m.bulk != m.kernel for m in self.layer_maps())

    @property
    def native_mode(self) -> str | None:
        """How much of a call runs natively (rvqtts.engine.model.native): "layers", "rows", or None (torch
        throughout)."""
        return "layers" if self.native_layers else "rows" if self.native_rows else None

    def layer_maps(self) -> list[LinearMap]:
        """Every layer's linear maps (what each call applies)."""
        return [*self.qkv, *self.out, *self.gate_up, *self.down]

    def allocate(self, max_len: int, rows: int | None = None) -> None:
        """Fresh, zeroed K and V caches of `max_len` slots per layer for each of `rows` batch rows (as many
        as now where None, else one): row r's region is slots r * max_len onward."""
        rows = rows or getattr(self, "rows", 1)
        shape = (len(self.layers), self.n_kv_heads, rows * max_len, self.head_dim)
        # both made before anything changes: a failed allocation leaves the old caches and layout whole
        k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.k_cache, self.v_cache, self.max_len, self.rows = k_cache, v_cache, max_len, rows

    def run_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: slice | torch.Tensor,
        span: int | slice,
        mask: torch.Tensor | None = None,
        groups: list[tuple[slice, torch.Tensor]] | None = None,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
        spans: list[tuple[slice, torch.Tensor]] | None = None,
        prompt: bool = False,
    ) -> torch.Tensor:
        """The layers over states x [q, hidden] (RoPE tables `cos`, `sin` [1, q, d]), writing keys and values to the
        cache slots `write` (a slice, or slot indices, which keep shapes static) and attending to slots 0..span-1 (or
        the region `span`, a slice: one batch row's). Which slots each query sees: `mask` [q, span]; else `groups`
        (query slices and the slots [n, L] each of them attends to, in order); else `rows` (row attention,
        rvqtts.engine.model.attention: each query's slots [q, span] in position order, None: the first `span`, and
        which of them it sees); else `spans` (query r over the cache region `spans[r][0]`, seeing where `spans[r][1]`
        [1, width] is true, in an attention call of its own); else all. Returns the final-normed states [q, hidden]. Run
        natively (`native_rows`), norms, RoPE, attention and the activation are library calls, whole layers where every
        map runs its kernel (`native_layers`): the same bits. A `prompt` (a prefill's rows) runs maps by
        `LinearMap.many`."""
        native_rows = self.runs_natively()
        read = span if isinstance(span, slice) else slice(0, span)
        if native_rows and read.start and rows is None and groups is None:  # a region: its slots, in order
            rows, mask = (torch.arange(read.start, read.stop, device=x.device).expand(x.shape[0], -1), mask), None
        span = read.stop - read.start
        attn_mask = None if mask is None else mask[None, None]
        if (
            native_rows
            and self.native_layers
            and groups is None
            and (mask is None or mask.dtype == torch.bool)
            and not (prompt and self.prompt_maps_differ)
        ):
            return self.run_native_layers(x, cos, sin, write, span, *(rows or (None, mask)))
        for i in range(len(self.layers)):
            if native_rows:  # the keys and values go straight to the cache
                q = self.native_attention_inputs(i, x, cos, sin, write, prompt)
            else:
                q, k, v = self.attention_inputs(i, x, cos, sin, prompt)
                self.write_cache(i, k, v, write)
            if native_rows and (rows is not None or groups is not None or mask is None or mask.dtype == torch.bool):
                out = self.attend_natively(i, q, span, mask, groups, rows)
            else:
                out = self.attend_layer(i, q, read, attn_mask, groups, rows, spans)
            x = self.layer_rest(i, x, out, prompt)
        return self.rms(self.norm, x)

    def write_cache(self, i: int, k: torch.Tensor, v: torch.Tensor, write: slice | torch.Tensor) -> None:
        """Layer i's keys and values [heads, q, d] into the cache slots `write` (a slice, or slot indices)."""
        if isinstance(write, slice):
            self.k_cache[i, :, write] = k
            self.v_cache[i, :, write] = v
        else:
            self.k_cache[i].index_copy_(1, write, k)
            self.v_cache[i].index_copy_(1, write, v)

    def attend_natively(
        self,
        i: int,
        q: torch.Tensor,
        span: int,
        mask: torch.Tensor | None,
        groups: list[tuple[slice, torch.Tensor]] | None,
        rows: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Layer i's attention by the native library, the queries q [heads, q, d] seeing what `run_layers` says."""
        if rows is not None:
            return native.attend(q, self.k_cache[i], self.v_cache[i], span, *rows)
        if groups is not None:
            return torch.cat(
                [
                    native.attend(q[:, queries], self.k_cache[i], self.v_cache[i], slots.shape[1], slots)
                    for queries, slots in groups
                ],
                dim=1,
            )
        return native.attend(q, self.k_cache[i], self.v_cache[i], span, None, mask)

    def attend_layer(
        self,
        i: int,
        q: torch.Tensor,
        read: slice,
        attn_mask: torch.Tensor | None,
        groups: list[tuple[slice, torch.Tensor]] | None,
        rows: tuple[torch.Tensor, torch.Tensor] | None,
        spans: list[tuple[slice, torch.Tensor]] | None,
    ) -> torch.Tensor:
        """Layer i's attention by torch, the queries q [heads, q, d] seeing what `run_layers` says."""
        if rows is not None:
            slots, visible = rows
            span = read.stop - read.start
            keys, values = (  # each query's keys in position order: the first `span` slots, or gathered
                cache[None, i, :, :span].expand(len(visible), -1, -1, -1)
                if slots is None
                else cache[i].index_select(1, slots.flatten()).view(cache.shape[1], *slots.shape, -1).transpose(0, 1)
                for cache in (self.k_cache, self.v_cache)
            )
            return attend_rows(q, keys, values, visible)
        if groups is not None:
            return torch.cat([self.attend_gathered(i, q[:, queries], slots) for queries, slots in groups], dim=1)
        if spans is not None:
            return torch.cat(
                [
                    self.attend(
                        q[None, :, r : r + 1],
                        self.k_cache[None, i, :, region],
                        self.v_cache[None, i, :, region],
                        visible[None, None],
                    )[0]
                    for r, (region, visible) in enumerate(spans)
                ],
                dim=1,
            )
        # 4-D inputs take torch's fused CPU attention kernel (3-D ones fall back to the unfused math).
        return self.attend(q[None], self.k_cache[None, i, :, read], self.v_cache[None, i, :, read], attn_mask)[0]

    def run_native_layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: slice | torch.Tensor,
        span: int,
        slots: torch.Tensor | None,
        visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """`run_layers` with one native call per layer (rvqtts.engine.model.native.layer): the same bits."""
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        shape = (self.n_heads, self.n_kv_heads, self.head_dim)
        for i, layer in enumerate(self.layers):
            attention = layer.self_attn
            native.layer(
                x,
                (layer.input_layernorm.weight, layer.post_attention_layernorm.weight),
                layer.input_layernorm.variance_epsilon,
                self.native_layers[i],
                shape,
                (attention.q_norm.weight, attention.k_norm.weight),
                cos,
                sin,
                (self.k_cache[i], self.v_cache[i]),
                write,
                span,
                slots,
                visible,
            )
        return self.rms(self.norm, x)

    def runs_natively(self) -> bool:
        """Whether this call runs its rows natively: where `native_rows`, unless traced (graphs stay torch's)."""
        return self.native_rows and not torch.jit.is_tracing()

    def rms(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One of the model's RMSNorms over x, natively where this decoder runs its rows so."""
        if self.runs_natively():
            return native.rms_norm(x, norm.weight, norm.variance_epsilon)
        return self.normed(norm, x)

    def normed(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The module `norm` over x [n, ...]: in calls of one row count where `norms_in_chunks`."""
        if self.norms_in_chunks and not torch.jit.is_tracing():
            return in_row_chunks(norm, x)
        return norm(x)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)

    def attend_gathered(self, i: int, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Layer i's attention of queries [heads, n, d], each over its own cache slots `slots` [n, L]:
        a batch of n single-query attentions, each computed as a plain step computes its one query."""
        keys = self.k_cache[i][:, slots].transpose(0, 1)  # [n, kv_heads, L, d]
        values = self.v_cache[i][:, slots].transpose(0, 1)
        return self.attend(q.transpose(0, 1)[:, :, None], keys, values)[:, :, 0].transpose(0, 1)

    def attention_inputs(
        self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prompt: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's queries [heads, q, d] and keys, values [kv_heads, q, d] for states x [q, hidden]:
        one fused map, the q/k norms, then RoPE with the slots' `cos`, `sin` [1, q, d]. Nothing reads
        x's shape, so traced graphs hold no size lookups (Core ML's converter mishandles them)."""
        layer = self.layers[i]
        qkv = self.qkv[i].many if prompt else self.qkv[i]
        q, k, v = qkv(self.normed(layer.input_layernorm, x)).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = self.normed(layer.self_attn.q_norm, q.view(-1, self.n_heads, self.head_dim)).transpose(0, 1)
        k = self.normed(layer.self_attn.k_norm, k.view(-1, self.n_kv_heads, self.head_dim)).transpose(0, 1)
        v = v.view(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def native_attention_inputs(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write: slice | torch.Tensor,
        prompt: bool = False,
    ) -> torch.Tensor:
        """`attention_inputs` natively (rvqtts.engine.model.native): the queries [heads, q, d], with the keys and values
        written to the cache slots `write`."""
        layer = self.layers[i]
        attention = layer.self_attn
        qkv = self.qkv[i].many if prompt else self.qkv[i]
        return native.attention_inputs(
            qkv(self.rms(layer.input_layernorm, x)),
            self.n_heads,
            self.n_kv_heads,
            attention.q_norm.weight,
            attention.k_norm.weight,
            cos[0].contiguous(),
            sin[0].contiguous(),
            attention.q_norm.variance_epsilon,
            self.k_cache[i],
            self.v_cache[i],
            write,
        )

    def layer_rest(self, i: int, x: torch.Tensor, attended: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """Layer i after attention: output map and residual, then the MLP (gate and up fused) and residual.
        `attended` is the attention output [heads, q, d]; a `prompt`'s maps run by `LinearMap.many`."""
        layer = self.layers[i]
        out, gate_up, down = ((m.many if prompt else m) for m in (self.out[i], self.gate_up[i], self.down[i]))
        x = x + out(attended.transpose(0, 1).flatten(1))
        gate_up = gate_up(self.rms(layer.post_attention_layernorm, x))
        if self.runs_natively():
            return x + down(native.silu_times_up(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return x + down(layer.mlp.act_fn(gate) * up)
