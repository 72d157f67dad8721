"""The inner loop: speculative codes equal plain codes, follow the exact joint distribution, and are counted."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from exactness import broken_walk, unexplained_differences
from helpers import linear_maps_are_row_invariant, random_prefix, stock_path_logits
from scipy.stats import chisquare

import rvqtts.engine.speculative.rounds
from rvqtts.engine.loop.inner_loop import InnerLoop
from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.sampling import SamplingConfig, residual_noise, target_probs
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import grow_tree

# A plausible acceptance table (falling with depth and rank) to shape trees of any budget.
TABLE = [
    [0.5, 0.2, 0.1, 0.06, 0.04, 0.03, 0.02, 0.01] * 2,
    [0.4, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01] * 2,
    [0.3, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01] * 2,
]


def random_offsets(hidden: int, seed: int) -> Offsets:
    return Offsets(torch.randn(3, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5)


PLAIN_CODES: dict = {}


def plain_codes(synth, frames: int) -> list[list[int]]:
    """Plain codes of the parity frames, computed once per model."""
    if id(synth) not in PLAIN_CODES:
        codes, stats = decode_many(synth, None, frames)
        assert stats.calls == 15 * frames
        PLAIN_CODES[id(synth)] = codes
    return PLAIN_CODES[id(synth)]


def decode_many(synth, speculation, frames: int, sampling=SamplingConfig()):
    loop = InnerLoop(synth.code_predictor, speculation, seed=11)
    codes = [loop.frame(random_prefix(synth, seed=f), sampling, utterance=0, frame=f) for f in range(frames)]
    return codes, loop.stats


@pytest.mark.parametrize("which", ["tiny", "narrow"])
@pytest.mark.parametrize("budget", [4, 8, 16, 32])
def test_speculative_codes_equal_plain_codes(which, budget, request):
    synth = request.getfixturevalue(which)
    frames = 200 if which == "narrow" else 60  # narrow's drafts are accepted deep; tiny's (2048 codes) at depth 1
    plain = plain_codes(synth, frames)
    speculation = Speculation(grow_tree(TABLE, budget), random_offsets(synth.hidden_size, budget))
    spec, stats = decode_many(synth, speculation, frames)
    mismatches = [f for f in range(frames) if spec[f] != plain[f]]
    if linear_maps_are_row_invariant(synth.code_predictor, rows=budget + 1):
        assert not mismatches, f"frames {mismatches[:10]} differ"
    else:  # these are the fixed kernels (not measured), which need not keep rows invariant: near-ties may flip
        prefixes = [random_prefix(synth, seed=f) for f in mismatches]
        config = synth.code_predictor.config
        noises = [residual_noise(11, 0, f, config.num_code_groups, config.vocab_size) for f in mismatches]
        plain_rows, spec_rows = ([codes[f] for f in mismatches] for codes in (plain, spec))
        found = unexplained_differences(synth.code_predictor, prefixes, noises, SamplingConfig(), plain_rows, spec_rows)
        assert not found and len(mismatches) <= frames // 20, f"frames {mismatches[:10]} differ: {found}"
    assert stats.calls < 15 * frames and stats.accepted_per_depth[0] > 0
    if which == "narrow":  # the parity must have been tested on accepted drafts, deep ones included
        assert stats.accepted_per_depth[0] > frames and stats.accepted_per_depth[1] > frames // 10


def test_codes_per_call_is_counted_from_real_calls(narrow, monkeypatch):
    calls = []
    original = rvqtts.engine.model.predictor.PredictorRunner.forward_rows
    monkeypatch.setattr(
        rvqtts.engine.model.predictor.PredictorRunner,
        "forward_rows",
        lambda self, *args, **kwargs: calls.append(1) or original(self, *args, **kwargs),
    )
    speculation = Speculation(grow_tree(TABLE, 16), random_offsets(narrow.hidden_size, 0))
    frames = 50
    codes, stats = decode_many(narrow, speculation, frames)
    assert all(len(c) == 15 for c in codes)
    assert stats.calls == len(calls) and stats.frames == frames and stats.codes == 15 * frames
    assert stats.calls * stats.codes_per_call == pytest.approx(15 * frames)
    assert stats.codes_per_call > 1.2
    # A frame is a prefill (c1) and rounds; a round emits its accepted drafts and one drawn code, except a
    # frame's last round when it accepted the frame's last code.
    assert stats.rounds == stats.calls - frames
    assert 0 <= frames + stats.rounds + sum(stats.accepted_per_depth) - stats.codes <= frames


def exact_joint(synth, prefix, sampling) -> np.ndarray:
    """P(c1, c2, c3) for one context, from qwen-tts's own forward and the target warping."""
    code_predictor = synth.code_predictor
    vocab = code_predictor.config.vocab_size
    joint = np.zeros((vocab,) * 3)
    with torch.no_grad():
        for c1, c2 in itertools.product(range(vocab), repeat=2):
            logits = stock_path_logits(code_predictor, prefix, [c1, c2])
            probs = target_probs(logits, sampling).double().numpy()
            joint[c1, c2] = probs[0, c1] * probs[1, c2] * probs[2]
    return joint


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, pooling outcomes expected fewer than 5 times into one bin; 0 if any count is
    on an outcome of probability zero."""
    if counts[probs == 0].sum():
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big & (probs > 0)].sum())
    expected = np.append(expected[big], expected[~big & (probs > 0)].sum())
    return chisquare(observed, expected).pvalue


def speculative_histogram(synth, frames: int, sampling) -> tuple[np.ndarray, np.ndarray]:
    prefix = random_prefix(synth, seed=21)
    speculation = Speculation(grow_tree(TABLE, 16), random_offsets(synth.hidden_size, 1))
    loop = InnerLoop(synth.code_predictor, speculation, seed=5)
    vocab = synth.code_predictor.config.vocab_size
    counts = np.zeros((vocab,) * 3, dtype=np.int64)
    for frame in range(frames):
        c1, c2, c3 = loop.frame(prefix, sampling, utterance=0, frame=frame)
        counts[c1, c2, c3] += 1
    assert loop.stats.accepted_per_depth[0] > frames // 5, "the tree must be exercised"
    return counts.ravel(), exact_joint(synth, prefix, sampling).ravel()


SAMPLING = SamplingConfig(temperature=0.9, top_k=5)
# The smallest sample that fails a broken verifier every time, with a wide margin: over the first 1,000 to
# 20,000 frames of these seeds the broken walk's p-value is below 1e-300 (inside the support too) and the
# correct one's 0.49-0.99 (1,000 frames: 0.487; measured 2026-12-03, the proof kept in docs/engine.md).
FRAMES = 1000


def test_speculative_frames_follow_the_exact_joint_distribution(small):
    counts, probs = speculative_histogram(small, FRAMES, SAMPLING)
    assert (probs > 0).sum() == 125  # top-5 of 8 at each of three positions
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_the_distribution_test_catches_a_broken_verifier(small, monkeypatch):
    monkeypatch.setattr(rvqtts.engine.speculative.rounds, "walk_tree", broken_walk)
    counts, probs = speculative_histogram(small, FRAMES, SAMPLING)
    assert chi_square_pvalue(counts, probs) < 1e-6
    # The statistic itself has the power, not only the support check: frames inside the support alone fail too.
    assert chi_square_pvalue(np.where(probs > 0, counts, 0), probs) < 1e-6


def test_static_calls_give_the_eager_codes(narrow):
    """The CUDA-graph path's plumbing, on CPU: every call goes through static input and output buffers
    (as a graph replay would, outputs overwritten by the next run of the same call), and the codes
    are the eager codes, plain and speculative, with deep acceptance exercised."""
    frames = 40
    speculation = Speculation(grow_tree(TABLE, 16), random_offsets(narrow.hidden_size, 16))
    for spec in (None, speculation):
        eager, _ = decode_many(narrow, spec, frames)
        loop = InnerLoop(narrow.code_predictor, spec, seed=11)
        loop.calls = StaticCalls("emulated")
        static = [
            loop.frame(random_prefix(narrow, seed=f), SamplingConfig(), utterance=0, frame=f) for f in range(frames)
        ]
        assert static == eager
        kinds = {key[0] for key in loop.calls.entries}
        assert kinds == ({"plain"} if spec is None else {"prefill", "rounds"})
        if spec is None:  # the whole plain frame in one call
            assert len(loop.calls.entries) == 1
        else:  # a round's key holds its layout's: (slots, attention, ((row, index, tree),))
            indices = [key[1][2][0][1] for key in loop.calls.entries if key[0] != "prefill"]
            assert len(indices) > 5  # rounds rooted at many different indices


def test_static_calls_overwrite_outputs_and_pick_their_mode():
    calls = StaticCalls("emulated")
    first = calls("double", lambda x: (2 * x,), torch.tensor([1.0]))[0]
    second = calls("double", lambda x: (2 * x,), torch.tensor([5.0]))[0]
    assert second.item() == 10.0 and first.item() == 10.0  # the same static buffer, as a graph replay gives
    assert StaticCalls.for_device(torch.device("cpu")).mode == "eager"
    with pytest.raises(ValueError, match="unknown mode 'graph'"):
        StaticCalls("graph")


@pytest.mark.parametrize("tree", [None, "4"])
def test_a_warm_up_captures_the_calls_an_utterance_replays_and_changes_no_code(tiny_dir, tree, monkeypatch):
    """Static calls (a GPU's CUDA graphs; emulated here) are captured at load (`Runners.warm_up`, which
    `Synthesizer.load` runs): the talker's step over every span of its first cache, the inner loop's plain calls
    and a round of the starting tree. An utterance after it gets the codes it gets without one, and its plain frames
    capture nothing more. Where calls are eager (a CPU's) it makes nothing, not even the runners."""
    from rvqtts.engine.loop import runners
    from rvqtts.engine.speculative.tree import resolve_tree
    from rvqtts.synthesis.settings import GenerationSettings
    from rvqtts.synthesis.synthesizer import Synthesizer

    eager = Synthesizer.from_checkpoint(tiny_dir)
    eager.runners.warm_up(eager.sampling(GenerationSettings()).predictor)
    assert eager.runners._talker is None and eager.runners._parts is None
    monkeypatch.setattr(StaticCalls, "for_device", classmethod(lambda cls, device, enabled=True: cls("emulated")))
    monkeypatch.setattr(runners, "graphs_on", lambda device, enabled=True: enabled)

    def loaded() -> Synthesizer:
        synth = Synthesizer.from_checkpoint(tiny_dir)
        hidden = synth.code_predictor.config.hidden_size
        return synth.using(tree and Speculation(resolve_tree(tree), Offsets.zeros(3, hidden)))

    def codes(synth: Synthesizer) -> np.ndarray:
        return synth.synthesize("Warm graphs.", "vivian", "english", seed=3, settings=settings).codes

    settings = GenerationSettings(max_frames=6)
    cold, warm = loaded(), loaded()
    warm.runners.warm_up(warm.sampling(GenerationSettings()).predictor)
    talker, inner = warm.runners.talker().calls, warm.runners.inner_parts().calls
    assert set(talker.entries) == {("talker", span) for span in (256, 512, 768, 1024)}
    captured = set(inner.entries)
    kinds = {key[0] for key in captured}
    assert kinds == ({"plain", "prefill", "rounds"} if tree else {"plain"})
    assert np.array_equal(codes(warm), codes(cold))
    assert set(talker.entries) == {("talker", span) for span in (256, 512, 768, 1024)}
    assert tree or set(inner.entries) == captured


@pytest.mark.parametrize("row_attention", [True, False])
@pytest.mark.parametrize("tree", [None, "4"])
def test_no_static_call_reads_a_value_back_to_the_host(narrow, tree, row_attention, monkeypatch):
    """A CUDA graph's capture fails on any read of a device value by the host (`.tolist()`, `.item()`, `bool()`,
    `int()`): every call the loops make static (the talker's step, the plain frame, a round, a prefill) is run here
    with those reads refused, with row attention and with the gathered one (a GPU whose probe fails)."""
    from rvqtts.engine.model.talker import TalkerRunner
    from rvqtts.engine.speculative.tree import resolve_tree

    def refused(*args, **kwargs):
        raise AssertionError("a static call read a device value back to the host")

    capture = StaticCalls._capture

    def guarded(self, fn, inputs):
        with pytest.MonkeyPatch.context() as patch:
            for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
                patch.setattr(torch.Tensor, name, refused)
            return capture(self, fn, inputs)

    monkeypatch.setattr(StaticCalls, "_capture", guarded)
    speculation = tree and Speculation(resolve_tree(tree), random_offsets(narrow.hidden_size, 4))
    loop = InnerLoop(narrow.code_predictor, speculation, seed=11)
    loop.runner.row_attention, loop.calls = row_attention, StaticCalls("emulated")
    for f in range(3):
        loop.frame(random_prefix(narrow, seed=f), SamplingConfig(), utterance=0, frame=f)
    talker = TalkerRunner(narrow.talker, calls=StaticCalls("emulated"))
    talker.step(torch.zeros(1, talker.hidden_size), 3)
    assert loop.calls.entries and talker.calls.entries
