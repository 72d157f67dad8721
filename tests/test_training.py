"""Offsets training on planted structure, and what training must leave alone.

Planted data: per frame a random z, hidden states h_k = z + k d (k = 1..L) and codes c_k sampled from
softmax(W_k h_k). Then c_{k+j} ~ softmax(W_{k+j}(h_k + j d)) for every k, so the offsets b_j = j d are
the true parameters of every depth's drafts: the optimum that training must reach, and zero offsets
(reused heads) fall clearly short of it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_contexts

from rvqtts.engine.loop.inner_loop import InnerLoop
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import grow_tree
from rvqtts.tuning.calibration import replay_calls
from rvqtts.tuning.drafters import OffsetDrafter
from rvqtts.tuning.drafts import DraftData, draft_ranks, frozen_draft_data, head_weights
from rvqtts.tuning.training import TrainingConfig, evaluate, fit_offsets, train_drafter

RAW = SamplingConfig(temperature=1.0, top_k=0)  # the planted codes are drawn from the raw softmax


def train_offsets(weights, train, held, config, sampling):
    """Offsets [K, H] trained from zero (reused heads), and the training record (as fit_offsets trains them)."""
    drafter = OffsetDrafter(config.depth, weights.shape[2])
    record = train_drafter(drafter, weights, train, held, config, sampling)
    return drafter.vectors.detach().cpu(), record


def planted(frames: int = 4000, length: int = 6, vocab: int = 32, hidden: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(length, vocab, hidden, generator=generator) / hidden**0.5 * 2
    step = torch.randn(hidden, generator=generator) * 0.35
    z = torch.randn(frames, hidden, generator=generator)
    states = z[:, None] + torch.arange(1, length + 1)[None, :, None] * step
    probs = torch.einsum("nkh,kvh->nkv", states, weights).softmax(-1)
    codes = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(frames, length)
    data = DraftData(states, codes)
    cut = frames * 3 // 4
    optimum = torch.stack([j * step for j in (1, 2, 3)])
    return weights, data.take(torch.arange(cut)), data.take(torch.arange(cut, frames)), optimum


@pytest.mark.parametrize("target", ["hard", "soft"])
def test_planted_offsets_are_learned_to_the_planted_optimum(target):
    weights, train, held, optimum = planted()
    config = TrainingConfig(target=target, learning_rate=1e-2, eval_every=100)
    trained, record = train_offsets(weights, train, held, config, RAW)
    best, got, zero = (
        evaluate(OffsetDrafter(3, 16, vectors), weights, held, target, RAW)
        for vectors in (optimum, trained, torch.zeros_like(optimum))
    )
    # Measured: hard 4.2012 vs 4.1980 (zeros 5.046); soft 4.1527 vs 4.1527 (zeros 5.037).
    assert got["loss"] <= best["loss"] + 0.02
    assert zero["loss"] >= best["loss"] + 0.5
    for d in range(3):  # top-1 drafts agree with the sampled codes as often as the optimum's do
        assert abs(got["top1_by_depth"][d] - best["top1_by_depth"][d]) <= 0.01
    assert zero["top1_by_depth"][2] <= best["top1_by_depth"][2] - 0.08
    assert torch.nn.functional.cosine_similarity(trained, optimum, dim=1).min() > 0.99
    assert record["held_out_loss"] == pytest.approx(got["loss"], abs=1e-4)
    assert record["initial_held_out_loss"] == pytest.approx(zero["loss"], abs=1e-4)


def test_planted_drafts_rank_higher_with_the_learned_offsets():
    weights, train, held, optimum = planted()
    trained, _ = train_offsets(weights, train, held, TrainingConfig(learning_rate=1e-2, eval_every=100), RAW)
    hits = [
        (draft_ranks(OffsetDrafter(3, 16, vectors), weights, held, 4) == 0).sum((0, 1))
        for vectors in (torch.zeros(3, 16), trained)
    ]
    assert (hits[1] > hits[0]).all()


def test_training_stops_early_and_keeps_the_best_offsets():
    weights, train, held, _ = planted(frames=400)
    config = TrainingConfig(learning_rate=5e-2, eval_every=20, patience=2, max_steps=5000)
    _, record = train_offsets(weights, train, held, config, RAW)
    assert record["stopped_early"] and record["steps"] < 5000
    assert record["best_step"] <= record["steps"] - 2 * 20
    assert record["held_out_loss"] < record["initial_held_out_loss"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("depth", 0, "between 1 and 14"),
        ("depth", 15, "between 1 and 14"),
        ("target", "kl", "hard, soft"),
        ("batch", 0, "batch must be at least 1"),
        ("learning_rate", 0.0, "learning rate must be positive"),
    ],
)
def test_bad_training_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainingConfig(**{field: value})


def test_batched_drafts_match_the_engine_runner(tiny):
    frames = random_contexts(tiny, 4)
    prefixes = frames.prefixes(tiny.talker.get_input_embeddings())
    data = frozen_draft_data(tiny.code_predictor, prefixes, frames.codes[:, 1:])
    offsets = torch.randn(3, tiny.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.1
    ranks = draft_ranks(OffsetDrafter(3, tiny.hidden_size, offsets), head_weights(tiny.code_predictor), data, 8)
    loop = InnerLoop(tiny.code_predictor, None, 0)
    runner = loop.runner
    for f in range(4):  # the runner's step-by-step hidden states give the same top-8 drafts
        hidden = [runner.prefill(prefixes[f])]
        for index in range(1, 15):
            hidden.append(runner.step(torch.tensor([int(frames.codes[f, index])]), index))
        for k in (1, 7, 12):
            for j in (1, 2, 3):
                top = torch.topk(runner.logits(hidden[k - 1] + offsets[j - 1], k + j), 8).indices.tolist()
                truth = int(frames.codes[f, k + j])
                assert ranks[f, k - 1, j - 1] == (top.index(truth) if truth in top else 8)
    assert (ranks[:, 12:, 2] == -1).all() and (ranks[:, :12, 2] >= 0).all()


@pytest.mark.parametrize("self_distill", [False, True])
def test_fitted_offsets_carry_provenance_and_leave_the_codes_unchanged(small, self_distill):
    frames = random_contexts(small, 400)
    config = TrainingConfig(learning_rate=1e-2, max_steps=400, eval_every=50)
    offsets, record = fit_offsets(small, frames, config, held_out=0.25, self_distill=self_distill, model_name="small")
    # Measured: held-out loss 4.770 -> 4.336 (recorded codes), 5.315 -> 5.171 (resampled).
    assert record["held_out_loss"] < record["initial_held_out_loss"] - 0.05
    assert not offsets.is_zero and offsets.vectors.shape == (3, small.hidden_size)
    assert record["frames"] == 400 and record["held_out_frames"] == 100
    assert record["source"] == "random test frames" and ("self-distillation" in record["codes"]) == self_distill
    assert offsets.model == "small" and offsets.model_fingerprint
    tree = grow_tree([[0.5, 0.3, 0.2], [0.5, 0.3], [0.5]], 8)
    prefixes = frames.prefixes(small.talker.get_input_embeddings())
    plain = InnerLoop(small.code_predictor, None, seed=5)
    trained = InnerLoop(small.code_predictor, Speculation(tree, offsets), seed=5)
    for f in range(100):
        assert trained.frame(prefixes[f], SamplingConfig(), 0, f) == plain.frame(prefixes[f], SamplingConfig(), 0, f)
    assert trained.stats.calls < plain.stats.calls


def test_replayed_calls_equal_the_engine_calls(narrow):
    frames = random_contexts(narrow, 150)  # codes sampled by the plain loop with seed 0
    prefixes = frames.prefixes(narrow.talker.get_input_embeddings())
    vectors = torch.randn(3, narrow.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.3
    tree = grow_tree([[0.4, 0.2, 0.1, 0.05], [0.5, 0.2], [0.6, 0.1]], 12)
    data = frozen_draft_data(narrow.code_predictor, prefixes, frames.codes[:, 1:])
    ranks = draft_ranks(OffsetDrafter(3, narrow.hidden_size, vectors), head_weights(narrow.code_predictor), data, 16)
    loop = InnerLoop(narrow.code_predictor, Speculation(tree, Offsets(vectors)), seed=0)
    engine = []
    for f, prefix in enumerate(prefixes):
        before = loop.stats.calls
        loop.frame(prefix, SamplingConfig(), 0, f)
        engine.append(loop.stats.calls - before)
    replayed = replay_calls(ranks, tree)
    assert replayed.tolist() == engine
    assert sum(engine) < 15 * 150 * 0.8  # deep paths were accepted, so the replay was tested on them
