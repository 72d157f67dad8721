"""The code predictor's attention as small matrix products over a fixed width of slots per query (its own keys in a
plain step's order, then masked slots), one product per query and KV head, as qwen-tts's eager attention computes
it. Every query then has the plain step's width and layout, so a tree round's queries equal plain steps wherever a
query's bits do not depend on the other queries of its call: `rows_exact` checks that once per process and shape;
where it fails, the runner keeps the per-depth gathered attention. docs/engine.md, "The predictor call"."""

from __future__ import annotations

import torch

MAX_TREE_NODES = 64  # the largest tree a round carries: the check below covers rounds up to this size
_EXACT: dict[tuple, bool] = {}


def attention_width(code_groups: int) -> int:
    """Slots each query attends over: a frame's committed slots (at most G - 1) and a draft path of at
    most K + 1 <= G slots."""
    return 2 * code_groups


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Queries [heads, n, d] over their own keys and values [n, kv_heads, w, d] (in position order), each
    seeing the slots where `visible` [n, w] is true: one product per query and KV head, over the G query
    heads that share it. Returns [heads, n, d]."""
    heads, n, d = q.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = q.reshape(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n * kv_heads, group, d)
    scores = torch.bmm(rows, keys.reshape(n * kv_heads, width, d).transpose(1, 2)) * d**-0.5
    scores = scores.view(n, kv_heads * group, width).masked_fill(~visible[:, None], float("-inf"))
    weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype).view(n * kv_heads, group, width)
    out = torch.bmm(weights, values.reshape(n * kv_heads, width, d))
    return out.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(heads, n, d)


def rows_exact(
    heads: int,
    kv_heads: int,
    head_dim: int,
    width: int,
    max_rows: int,
    device: torch.device,
    dtype: torch.dtype,
) -> bool:
    """Whether, on random data at these shapes, every query of calls of 2..max_rows queries gets the bits it
    gets in a call of its own (each query its own keys and a random count of visible leading slots)."""
    generator = torch.Generator().manual_seed(0)

    def sample(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q = sample(heads, max_rows, head_dim)
    keys, values = sample(max_rows, kv_heads, width, head_dim), sample(max_rows, kv_heads, width, head_dim)
    lengths = torch.randint(1, width + 1, (max_rows, 1), generator=generator)
    visible = (torch.arange(width)[None] < lengths).to(device)
    with torch.inference_mode():
        alone = torch.cat(
            [
                attend_rows(q[:, r : r + 1], keys[r : r + 1], values[r : r + 1], visible[r : r + 1])
                for r in range(max_rows)
            ],
            dim=1,
        )
        return all(
            torch.equal(attend_rows(q[:, :n], keys[:n], values[:n], visible[:n]), alone[:, :n])
            for n in range(2, max_rows + 1)
        )


def row_attention_exact(config: object, device: torch.device, dtype: torch.dtype) -> bool:
    """`rows_exact` at a code predictor's shapes, for every round it can run (up to MAX_TREE_NODES nodes),
    once per process. It depends on the model and machine alone, so every runner of a model (plain or
    speculative) attends the same way; on a GPU as on a CPU, checked on the device itself."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        attention_width(config.num_code_groups),
        MAX_TREE_NODES + 1,
    )
    key = (*shape, str(dtype), str(device), torch.get_num_threads())
    if key not in _EXACT:
        _EXACT[key] = rows_exact(*shape, device, dtype)
    return _EXACT[key]
