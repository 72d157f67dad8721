"""The sampler: HF's warpers exactly, Gumbel-max draws that follow softmax(top-k(logits / T)), keyed noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rvqtts.engine.model.sampling import (
    MIN_TEMPERATURE,
    RowSampling,
    SamplingConfig,
    draw,
    draw_checked,
    gumbel_noise,
    target_probs,
    warp_logits,
)

CONFIGS = [
    SamplingConfig(0.9, 50, 1.0),
    SamplingConfig(0.7, 3, 1.0),
    SamplingConfig(1.3, 0, 0.8),
    SamplingConfig(0.9, 5, 0.6),
    SamplingConfig(1.0, 1, 1.0),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_warp_equals_hf_warpers(config):
    """Temperature, then top-k, then top-p, as qwen-tts's HF generate() applies them."""
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :10] = 1.5  # ties at the k-th value are kept by HF
    warpers = LogitsProcessorList([TemperatureLogitsWarper(config.temperature)])
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1:
        warpers.append(TopPLogitsWarper(config.top_p))
    expected = warpers(None, logits.clone())
    ours = warp_logits(logits, config)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(expected)
    assert torch.allclose(ours[kept], expected[kept], rtol=0, atol=1e-6)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])


def empirical(config: SamplingConfig, draws: int = 20000) -> np.ndarray:
    """Counts of Gumbel-max draws, one independent noise key (frame) per draw."""
    noise = torch.from_numpy(np.stack([gumbel_noise(7, 0, f, [1], LOGITS.numel())[0] for f in range(draws)]))
    samples = draw(LOGITS.expand(draws, -1), noise, config)
    return np.bincount(samples.numpy(), minlength=LOGITS.numel())


def assert_matches(counts: np.ndarray, probs: torch.Tensor) -> None:
    probs = probs.double().numpy()
    assert counts[probs == 0].sum() == 0, "a draw landed outside the kept set"
    support = probs > 0
    if support.sum() > 1:
        expected = probs[support] / probs[support].sum() * counts.sum()
        result = chisquare(counts[support], expected)
        assert result.pvalue > 1e-3, (counts, probs)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(1.0, 0, 1.0),
        SamplingConfig(0.9, 50, 1.0),
        SamplingConfig(0.5, 0, 1.0),
        SamplingConfig(1.0, 3, 1.0),
        SamplingConfig(1.0, 0, 0.7),
    ],
)
def test_draws_follow_the_target_distribution(config):
    probs = target_probs(LOGITS, config)
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    assert_matches(empirical(config), probs)


def test_each_knob_changes_the_distribution_as_it_should():
    plain = target_probs(LOGITS, SamplingConfig(1.0, 0, 1.0))
    assert torch.allclose(plain, LOGITS.softmax(-1))
    cold = target_probs(LOGITS, SamplingConfig(0.5, 0, 1.0))
    assert cold[0] > plain[0] and cold[-1] < plain[-1]
    assert torch.allclose(cold, (LOGITS / 0.5).softmax(-1))
    top3 = target_probs(LOGITS, SamplingConfig(1.0, 3, 1.0))
    assert (top3[3:] == 0).all() and torch.allclose(top3[:3], LOGITS[:3].softmax(-1))
    nucleus = target_probs(LOGITS, SamplingConfig(1.0, 0, 0.8))
    # Cumulative masses 0.44, 0.71, 0.87, ...: the smallest set holding 0.8 is the top three.
    assert (nucleus[3:] == 0).all() and (nucleus[:3] > 0).all()
    counts = empirical(SamplingConfig(1.0, 3, 1.0), 3000)
    assert counts[3:].sum() == 0 and (counts[:3] > 0).all()
    greedy = SamplingConfig(do_sample=False)
    assert draw(LOGITS, torch.randn(6) * 100, greedy).item() == 0


def test_noise_depends_only_on_its_key():
    whole = gumbel_noise(1, 2, 3, [1, 2, 3, 4], 50)
    assert whole.shape == (4, 50) and whole.dtype == np.float32
    assert np.array_equal(gumbel_noise(1, 2, 3, [3], 50)[0], whole[2])
    assert np.array_equal(gumbel_noise(1, 2, 3, [4, 1], 20), whole[[3, 0], :20])
    for other in (
        gumbel_noise(9, 2, 3, [1], 50),
        gumbel_noise(1, 9, 3, [1], 50),
        gumbel_noise(1, 2, 9, [1], 50),
        gumbel_noise(1, 2, 3, [9], 50),
    ):
        assert not np.array_equal(other[0], whole[0])
    assert not np.array_equal(whole[0], whole[1])


def test_noise_is_standard_gumbel_and_the_layout_is_frozen():
    sample = gumbel_noise(0, 0, 0, list(range(1, 41)), 2048).astype(np.float64).ravel()
    assert abs(sample.mean() - 0.5772) < 0.02 and abs(sample.std() - np.pi / 6**0.5) < 0.02
    # The key layout is part of --seed's promise: these values must never change silently.
    assert gumbel_noise(0, 0, 0, [1], 3).tolist() == FROZEN


FROZEN = [[0.3738376200199127, -0.8050708174705505, -0.9002622961997986]]


def test_rows_sampled_differently_each_draw_what_their_own_config_draws():
    """A call whose rows belong to frames of different settings (a server's requests sharing calls): each row's
    code and the finite flag are those its own config gives it, in any order of rows, for the rows of a tree round
    too (`take` by each row's frame); one shared config is the plain config itself."""
    generator = torch.Generator().manual_seed(3)
    configs = [
        SamplingConfig(),
        SamplingConfig(temperature=0.5, top_k=5),
        SamplingConfig(temperature=1.3, top_k=0, top_p=0.7),
        SamplingConfig(do_sample=False),
    ]
    frames = torch.tensor([0, 1, 2, 3, 1, 0, 3, 2])  # each row's frame, as a round's layout gives them
    per_frame = [configs[0], configs[1], configs[2], configs[3]]
    logits = torch.randn(len(frames), 300, generator=generator) * 3
    noise = -torch.log(-torch.log(torch.rand(len(frames), 300, generator=generator)))
    mixed = RowSampling.of(per_frame, torch.device("cpu"))
    codes, finite = draw_checked(logits, noise, mixed.take(frames))
    alone = [draw(logits[r : r + 1], noise[r : r + 1], per_frame[f])[0] for r, f in enumerate(frames.tolist())]
    assert codes.tolist() == [int(code) for code in alone] and bool(finite.all())
    assert codes.tolist() != draw(logits, noise, configs[0]).tolist()  # not every row by the first's config
    assert RowSampling.of([configs[1]] * 3, torch.device("cpu")) is configs[1]
    logits[5, :] = float("nan")
    assert draw_checked(logits, noise, mixed.take(frames))[1].tolist() == [r != 5 for r in range(len(frames))]


def test_a_temperature_below_the_minimum_draws_greedily_and_never_overflows():
    """Logits divided by a temperature of 1e-300 overflow float32 and no code could be drawn: a temperature below
    MIN_TEMPERATURE (0 included) draws greedily, the limit of sampling as the temperature goes to 0."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0)) * 30
    noise = torch.from_numpy(gumbel_noise(1, 0, 0, range(4), 100))
    for temperature in (0.0, 1e-300, MIN_TEMPERATURE / 2):
        config = SamplingConfig(temperature=temperature, top_k=5)
        assert not config.do_sample
        codes, finite = draw_checked(logits, noise, config)
        assert torch.equal(codes, logits.argmax(-1)) and bool(finite.all())
    assert SamplingConfig(temperature=MIN_TEMPERATURE).do_sample
    with pytest.raises(ValueError, match="0 .greedy. or positive"):
        SamplingConfig(temperature=-1e-9)
    with pytest.raises(ValueError, match="at most 10000"):  # 1e308 is inf in float32, and -inf / inf is NaN
        SamplingConfig(temperature=1e308)
