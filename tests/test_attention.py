"""Row attention (rvqtts.engine.model.attention): what it computes, that masked slots never matter, that the check can
fail, and that a runner decodes the same codes with it as with the gathered attention's rule of exactness
(speculative equal to plain, code for code)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import decode_frames

import rvqtts.engine.model.attention as attention
import rvqtts.engine.model.predictor as predictor_module
from rvqtts.engine.model.attention import MAX_TREE_NODES, attend_rows, attention_width, rows_exact
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import Tree, resolve_tree

HEADS, KV_HEADS, HEAD_DIM, WIDTH = 4, 2, 16, 12


def random_rows(rows: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, rows, HEAD_DIM, generator=generator).to(dtype)
    keys = torch.randn(rows, KV_HEADS, WIDTH, HEAD_DIM, generator=generator).to(dtype)
    values = torch.randn(rows, KV_HEADS, WIDTH, HEAD_DIM, generator=generator).to(dtype)
    lengths = torch.randint(1, WIDTH + 1, (rows, 1), generator=generator)
    return q, keys, values, torch.arange(WIDTH)[None] < lengths


def test_each_query_attends_to_its_visible_slots_with_its_kv_heads():
    q, keys, values, visible = random_rows(5)
    out = attend_rows(q, keys, values, visible)
    group = HEADS // KV_HEADS
    for r in range(5):
        seen = visible[r]
        k = keys[r][:, seen].repeat_interleave(group, 0)  # query head h reads KV head h // group
        v = values[r][:, seen].repeat_interleave(group, 0)
        reference = F.scaled_dot_product_attention(q[:, r : r + 1], k, v)[:, 0]
        torch.testing.assert_close(out[:, r], reference, atol=1e-5, rtol=1e-5)


def test_masked_slots_contents_never_matter():
    q, keys, values, visible = random_rows(6, torch.bfloat16)
    other_keys, other_values = keys.clone(), values.clone()
    hidden = ~visible[:, None, :, None].expand_as(keys)
    other_keys[hidden] = 1e4
    other_values[hidden] = -3e3
    assert torch.equal(attend_rows(q, keys, values, visible), attend_rows(q, other_keys, other_values, visible))


def test_the_check_finds_queries_that_depend_on_their_neighbours(monkeypatch):
    honest = attention.attend_rows

    def leaky(q, keys, values, visible):  # each query nudged by how many share the call
        return honest(q, keys, values, visible) * (1 + 1e-3 * (q.shape[1] - 1))

    monkeypatch.setattr(attention, "attend_rows", leaky)
    assert not rows_exact(HEADS, KV_HEADS, HEAD_DIM, WIDTH, 9, torch.device("cpu"), torch.float32)


def test_rounds_carry_at_most_the_checked_tree_size(tiny):
    offsets = Offsets(torch.zeros(3, tiny.hidden_size))
    wide = Tree(tuple((rank,) for rank in range(MAX_TREE_NODES + 1)))
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_NODES}"):
        Speculation(wide, offsets)
    assert attention_width(16) >= 15 + 3 + 1  # committed slots and a depth-3 path, as the rounds need


@pytest.mark.parametrize("row_attention", [True, False])
def test_speculative_codes_equal_plain_codes_either_way(released_06_dir, row_attention, monkeypatch):
    """At the released 0.6B layout in bfloat16, with row attention on (where this machine keeps its rows
    exact) or off: a 15-node tree's codes are the plain loop's, frame for frame."""
    from rvqtts.synthesis.synthesizer import Synthesizer

    synth = Synthesizer.from_checkpoint(released_06_dir, dtype="bfloat16")
    config = synth.code_predictor.config
    if row_attention and not attention.row_attention_exact(config, torch.device("cpu"), torch.bfloat16):
        pytest.skip("this machine's small matrix products do not keep a query's bits alone and in a call")
    monkeypatch.setattr(predictor_module, "row_attention_exact", lambda *args: row_attention)
    assert predictor_module.PredictorRunner(synth.code_predictor, 2).row_attention is row_attention
    offsets = Offsets(torch.randn(3, synth.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5)
    plain, _ = decode_frames(synth, None, 12)
    spec, stats = decode_frames(synth, Speculation(resolve_tree("15"), offsets), 12)
    assert np.array_equal(plain, spec) and stats.accepted_per_depth[0] > 0
