"""The fused round (the module Core ML converts): same noise, same codes and calls as the engine, and it
traces to a static graph that generalises over the root's index."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_prefix

from rvqtts.engine.backends.fused import FusedCalls, FusedLoop
from rvqtts.engine.loop.inner_loop import InnerLoop, count_frame
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import SamplingConfig, gumbel_noise
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import LoopStats, Speculation
from rvqtts.engine.speculative.tree import grow_tree
from rvqtts.synthesis.synthesizer import Synthesizer

TABLE = [
    [0.5, 0.2, 0.1, 0.06, 0.04, 0.03, 0.02, 0.01] * 2,
    [0.4, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01] * 2,
    [0.3, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01] * 2,
]


@pytest.mark.parametrize("which", ["tiny", "narrow"])
def test_fused_rounds_give_the_engines_codes(which, request):
    synth = request.getfixturevalue(which)
    tree = grow_tree(TABLE, 16)
    offsets = Offsets(torch.randn(3, synth.hidden_size, generator=torch.Generator().manual_seed(16)) * 0.5)
    loop = InnerLoop(synth.code_predictor, Speculation(tree, offsets), seed=11)
    calls = FusedCalls.modules(PredictorRunner(synth.code_predictor, 16), tree, offsets.vectors, SamplingConfig())
    fused = FusedLoop(calls, tree, SamplingConfig())
    stats = LoopStats()
    for frame in range(40):
        prefix = random_prefix(synth, seed=frame)
        noise = torch.from_numpy(gumbel_noise(11, 0, frame, np.arange(1, 16), loop.runner.vocab_size))
        done = fused.frame(prefix, noise)
        count_frame(stats, done)
        assert done.codes == loop.frame(prefix, SamplingConfig(), 0, frame), f"frame {frame}"
    assert stats == loop.stats  # the same calls, codes, rounds and acceptance depths
    plain = InnerLoop(synth.code_predictor, None, seed=11)
    plain_stats = LoopStats()
    for frame in range(10):  # the plain q = 1 step Core ML runs for --no-spec
        prefix = random_prefix(synth, seed=frame)
        noise = torch.from_numpy(gumbel_noise(11, 0, frame, np.arange(1, 16), loop.runner.vocab_size))
        done = fused.plain_frame(prefix, noise)
        count_frame(plain_stats, done)
        assert done.codes == plain.frame(prefix, SamplingConfig(), 0, frame)
    assert plain_stats == plain.stats
    if which == "narrow":  # deep paths were accepted, so drafts from the fused call were walked
        assert loop.stats.accepted_per_depth[1] > 10


def test_the_fused_round_traces_to_a_static_graph(tiny_dir):
    synth = Synthesizer.from_checkpoint(tiny_dir)
    synth.code_predictor.requires_grad_(False)  # traced weights become constants
    tree = grow_tree(TABLE, 8)
    runner = PredictorRunner(synth.code_predictor, 16)
    calls = FusedCalls.modules(runner, tree, torch.zeros(3, synth.hidden_size), SamplingConfig())
    decoder = FusedLoop(calls, tree, SamplingConfig())
    q, generator = tree.nodes + 1, torch.Generator().manual_seed(0)

    def inputs(index: int):
        return (
            torch.randint(0, 2048, (q,), generator=generator),
            torch.tensor([index]),
            torch.randn(decoder.k_cache.shape, generator=generator),
            torch.randn(decoder.v_cache.shape, generator=generator),
            decoder.mask(index + 1, decoder.ancestors),
            torch.randn(q, 2048, generator=generator),
        )

    with torch.no_grad():
        traced = torch.jit.trace(decoder.calls.round, inputs(3), check_trace=False)
        for index in (1, 7, 14):  # one graph for every root position, the frame's end included
            example = inputs(index)
            for ours, theirs in zip(decoder.calls.round(*example), traced(*example)):
                assert torch.equal(ours, theirs)
        step = (
            torch.tensor([7]),
            torch.tensor([4]),
            decoder.k_cache,
            decoder.v_cache,
            decoder.mask(5, torch.zeros(1, 1)),
            torch.randn(1, 2048, generator=generator),
        )
        traced_step = torch.jit.trace(decoder.calls.step, step, check_trace=False)
        later = (step[0], torch.tensor([14]), *step[2:4], decoder.mask(15, torch.zeros(1, 1)), step[5])
        assert all(torch.equal(a, b) for a, b in zip(decoder.calls.step(*later), traced_step(*later)))
    draws, ranks, new_k, _ = traced(*inputs(5))
    assert draws.shape == (q,) and ranks.shape == (q, 3, max(tree.max_rank_by_depth()))
    assert new_k.shape == (decoder.k_cache.shape[0], decoder.k_cache.shape[1], q, decoder.k_cache.shape[3])
