"""End to end through rvqtts's frame loop: speculative and plain, seeds, and stock qwen-tts left as it was."""

from __future__ import annotations

import numpy as np
import torch

from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import resolve_tree

TEXT = "Hello world. This is a test."


def synthesize(synth, speculation, seed=3):
    """TEXT by `synth` (plain), or by the same model with another inner loop (`Synthesizer.using`)."""
    return (synth.using(speculation) if speculation else synth).synthesize(
        TEXT, speaker="ryan", language="english", seed=seed
    )


def test_speculative_and_plain_synthesis_give_the_same_codes_and_audio(tiny):
    offsets = Offsets(torch.randn(3, tiny.hidden_size, generator=torch.Generator().manual_seed(0)))
    plain = synthesize(tiny, None)
    spec = synthesize(tiny, Speculation(resolve_tree("16"), offsets))
    frames = plain.codes.shape[0]
    assert frames > 10 and plain.codes.shape == (frames, 16)
    assert np.array_equal(plain.codes, spec.codes)
    assert np.array_equal(plain.audio, spec.audio)
    assert plain.sample_rate == 24000 and plain.audio.shape == (frames * 1920,)
    assert np.abs(plain.audio).max() > 1e-2, "the tiny speech decoder must make audible sound"
    assert plain.stats.frames == spec.stats.frames == frames
    assert plain.stats.calls == 15 * frames and spec.stats.calls < plain.stats.calls
    assert spec.stats.codes == 15 * frames
    assert min(plain.seconds.wall, plain.seconds.talker, plain.seconds.predictor, plain.seconds.decoder) > 0
    # the inner loop's time by part: every part of a round, within the predictor's time per frame
    parts = {"prefill", "layout", "drafts", "forward", "heads", "draws", "walk"}
    for run, named in ((plain, {"plain"}), (spec, parts)):
        record = run.record()
        by_part = record["inner_loop_ms_by_part"]
        assert set(by_part) == named and all(ms >= 0 for ms in by_part.values())
        assert 0 < sum(by_part.values()) <= 1e3 * record["predictor_seconds"] / frames + 0.01


def test_seed_fixes_the_codes_and_the_stock_loop_comes_back(tiny):
    first = synthesize(tiny, None, 1)
    parts = tiny.runners.inner_parts()
    again, other = synthesize(tiny, None, 1), synthesize(tiny, None, 2)
    assert tiny.runners.inner_parts() is parts  # the runner and its static calls serve every utterance of a speculation
    assert np.array_equal(first.codes, again.codes)
    assert not np.array_equal(first.codes[:5], other.codes[:5])
    assert "generate" not in vars(tiny.code_predictor) and not tiny.talker._forward_pre_hooks
    torch.manual_seed(0)
    wavs, _ = tiny.tts.generate_custom_voice(text=TEXT, speaker="ryan", language="english", max_new_tokens=4)
    assert wavs[0].size > 0
