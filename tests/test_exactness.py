"""Speculative == plain where it is hard: the released 0.6B widths on a checkpoint whose drafts land (the
paper-acceptance shape with offsets that move a state j positions on: over 2 codes per call, drafts accepted at
every depth), with the kernels users get (measured: native where the CPU has them), in bfloat16 and float32. The
inner loop frame by frame, whole utterances (codes and WAV bytes), a batch of lines, and a stream against the whole.
A difference is allowed only where the kernels are not row-invariant and only as a near-tie the test shows
(tests/exactness.py); a planted broken verifier fails every comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exactness import broken_walk, first_difference, float32_reference, paper_offsets, unexplained_differences
from helpers import decode_frames, frame_noises, frame_prefixes, linear_maps_are_row_invariant

import rvqtts.engine.speculative.rounds
from rvqtts.engine.model.sampling import SamplingConfig, residual_noise
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.qwen.codec import StreamPacing
from rvqtts.support.audio import audio_bytes
from rvqtts.synthesis.batch_size import rows_invariant
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.synthesizer import Synthesizer

DTYPES = ("bfloat16", "float32")
FRAMES = {"bfloat16": 20, "float32": 10}  # float32's calls cost about twice bfloat16's here
TREE = "16"
SEED, UTTERANCE = 7, 3
TEXT = "Exactness is tested where the drafts land."
SETTINGS = GenerationSettings(max_frames=12)
LINES = ["The first line.", "A second, longer line of text.", "Third."]


def load(paper_dir, dtype: str) -> tuple[Synthesizer, Speculation]:
    synth = Synthesizer.from_checkpoint(paper_dir, dtype=dtype)
    return synth, Speculation(resolve_tree(TREE), paper_offsets(synth))


def assert_drafts_land(stats) -> None:
    assert stats.codes_per_call > 1.8, f"{stats.codes_per_call:.2f} codes per call: the drafts must land"
    assert min(stats.accepted_per_depth[:3]) > 0, f"accepted per depth {stats.accepted_per_depth}: every depth"


def inner_loop_differences(synth: Synthesizer, speculation: Speculation, frames: int):
    """The plain loop against tree rounds over the same frames: the differences not shown to be near-ties, whether
    there were any differences at all, and the speculative run's statistics."""
    plain, _ = decode_frames(synth, None, frames)
    spec, stats = decode_frames(synth, speculation, frames)
    prefixes, noises = frame_prefixes(synth, frames), frame_noises(synth, frames)
    found = unexplained_differences(synth.code_predictor, prefixes, noises, SamplingConfig(), plain, spec)
    return found, not np.array_equal(plain, spec), stats


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_rounds_draw_the_plain_loops_codes_where_drafts_land(paper_dir, released_06_kernels, measured, dtype):
    """Frame by frame: every code equal where the measured kernels are row-invariant (every CPU measured so far),
    else differing only by near-ties."""
    synth, speculation = load(paper_dir, dtype)
    unexplained, differ, stats = inner_loop_differences(synth, speculation, FRAMES[dtype])
    assert_drafts_land(stats)
    assert not unexplained, f"{dtype}: frames differ beyond a near-tie: {unexplained}"
    if linear_maps_are_row_invariant(synth.code_predictor, rows=int(TREE) + 1):
        assert not differ, f"{dtype}: the kernels are row-invariant, yet codes differ"


def spoken(synth: Synthesizer, speculation: Speculation | None, stream: bool = False):
    """One utterance of TEXT with or without the tree: its Synthesis and every frame's (prefix, codes)."""
    frames: list[tuple[torch.Tensor, list[int]]] = []
    run = dict(seed=SEED, utterance=UTTERANCE, settings=SETTINGS, on_frame=lambda p, c: frames.append((p.clone(), c)))
    synth = synth.using(speculation)
    if not stream:
        return synth.synthesize(TEXT, **run), frames
    audio_stream = synth.stream(TEXT, **run, pacing=StreamPacing(1, 1))
    pieces = list(audio_stream)
    return audio_stream.result, frames, np.concatenate(pieces)


def utterance_difference(synth: Synthesizer, frames_a: list, frames_b: list):
    """The first frame where two runs of the utterance differ, as a near-tie or not (None where every frame's
    codes are equal). Up to that frame both runs fed the talker the same codes, so its prefix is the same."""
    config = synth.code_predictor.config
    dtype = synth.code_predictor.lm_head[0].weight.dtype
    for frame, ((prefix, codes_a), (prefix_b, codes_b)) in enumerate(zip(frames_a, frames_b)):
        if codes_a != codes_b:
            assert torch.equal(prefix, prefix_b), f"frame {frame}: the talker's input differs before its codes do"
            noise = residual_noise(SEED, UTTERANCE, frame, config.num_code_groups, config.vocab_size)
            sampling = synth.sampling(SETTINGS).predictor
            reference = float32_reference(synth.code_predictor)
            return first_difference(reference, dtype, prefix, noise, sampling, codes_a, codes_b, frame)
    assert len(frames_a) == len(frames_b)
    return None


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_seed_writes_the_same_wav_speculative_or_plain(paper_dir, released_06_kernels, measured, dtype):
    """A whole utterance through the talker, both loops and the speech decoder: the same codes and WAV bytes with
    and without the tree (a near-tie, where the kernels are not row-invariant, is shown and ends the comparison)."""
    synth, speculation = load(paper_dir, dtype)
    spec, spec_frames = spoken(synth, speculation)
    plain, plain_frames = spoken(synth, None)
    assert_drafts_land(spec.stats)
    assert plain.stats.codes_per_call == 1.0 and len(plain.codes) == SETTINGS.max_frames
    difference = utterance_difference(synth, spec_frames, plain_frames)
    if difference is not None:
        assert difference.near_tie and not rows_invariant(synth), f"{dtype}: {difference}"
        return
    assert np.array_equal(spec.codes, plain.codes)
    assert audio_bytes(spec.audio, spec.sample_rate) == audio_bytes(plain.audio, plain.sample_rate)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_streamed_speculative_utterance_has_the_plain_streams_samples_and_the_whole_runs_codes(
    paper_dir, released_06_kernels, measured, dtype
):
    """Streamed a frame at a time with the tree against the same stream without it: the same codes and samples, bit
    for bit; and the codes of the whole plain run (its samples differ from a stream's by the incremental decoder's
    rounding alone, tests/test_streaming.py)."""
    synth, speculation = load(paper_dir, dtype)
    streamed, stream_frames, audio = spoken(synth, speculation, stream=True)
    plain, plain_frames, plain_audio = spoken(synth, None, stream=True)
    whole, _ = spoken(synth, None)
    assert_drafts_land(streamed.stats)
    assert np.array_equal(plain.codes, whole.codes)
    difference = utterance_difference(synth, stream_frames, plain_frames)
    if difference is not None:
        assert difference.near_tie and not rows_invariant(synth), f"{dtype}: {difference}"
        return
    assert np.array_equal(streamed.codes, plain.codes)
    assert np.array_equal(streamed.audio, audio) and np.array_equal(audio, plain_audio)


def test_a_batch_of_speculative_lines_writes_each_lines_plain_wav(paper_dir, released_06_kernels, measured):
    """Three lines in bfloat16, together in every call of both loops with the tree (rows out of step as their
    acceptance differs), against each line alone without it: the same codes and WAV bytes."""
    synth, speculation = load(paper_dir, "bfloat16")
    if not rows_invariant(synth):
        pytest.skip("no row-invariant kernel here: a batched line is its own run only up to near-ties")
    lines = [Line(text=text, utterance=index) for index, text in enumerate(LINES)]
    together = dict(synth.using(speculation).synthesize_many(lines, seed=SEED, settings=SETTINGS, batch_size=3))
    assert all(result.batch_rows == 3 for result in together.values())
    assert sum(r.stats.codes for r in together.values()) > 1.8 * sum(r.stats.calls for r in together.values())
    for index, line in enumerate(lines):
        alone = synth.synthesize(line.text, seed=SEED, utterance=index, settings=SETTINGS)
        assert np.array_equal(together[index].codes, alone.codes), index
        assert audio_bytes(together[index].audio, 24000) == audio_bytes(alone.audio, 24000), index


def test_a_planted_broken_verifier_fails_every_comparison(paper_dir, released_06_kernels, measured, monkeypatch):
    """The verifier accepting a drafted child that does not hold the target's draw (tests/test_inner_loop.py's
    broken_walk): the frame comparison finds differences beyond near-ties in most frames, and the utterance
    comparison finds one at its first differing frame."""
    synth, speculation = load(paper_dir, "bfloat16")
    monkeypatch.setattr(rvqtts.engine.speculative.rounds, "walk_tree", broken_walk)
    unexplained, _, _ = inner_loop_differences(synth, speculation, FRAMES["bfloat16"])
    assert len(unexplained) >= FRAMES["bfloat16"] // 2, unexplained
    spec, spec_frames = spoken(synth, speculation)
    _, plain_frames = spoken(synth, None)
    difference = utterance_difference(synth, spec_frames, plain_frames)
    assert difference is not None and not difference.near_tie, difference
