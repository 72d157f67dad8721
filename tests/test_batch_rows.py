"""Batches that fill the rows (rvqtts.engine.loop.frame_loop): several utterances in every call of both loops, each
utterance's codes and audio the ones it gets alone, rows refilled as utterances end."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

import rvqtts.engine.speculative.online as online_module
from rvqtts.engine.loop.inner_loop import LoopParts
from rvqtts.engine.model import talker as talker_module
from rvqtts.engine.model.sampling import SamplingConfig, gumbel_noise
from rvqtts.engine.model.talker import TalkerRunner
from rvqtts.engine.speculative.offsets import Offsets, predictor_fingerprint
from rvqtts.engine.speculative.online import OnlineSpeculation
from rvqtts.engine.speculative.rounds import plain_frames, speculative_frames
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.synthesis import batch_size
from rvqtts.synthesis.pipeline import speak
from rvqtts.synthesis.settings import GenerationSettings, Line, Synthesis
from rvqtts.synthesis.synthesizer import Synthesizer
from tests.helpers import random_prefix, run_cli

TEXTS = [
    "Hello there.",
    "A longer sentence, which makes more frames than the first one does. And a second one.",
    "Short.",
    "The fourth line is here. It has two sentences.",
    "Five.",
]


def _count_rows(monkeypatch) -> list[int]:
    """The row counts of every batched talker step from now on."""
    counts: list[int] = []
    step_rows = TalkerRunner.step_rows

    def counted(self, embeds, positions, rows):
        counts.append(len(rows))
        return step_rows(self, embeds, positions, rows)

    monkeypatch.setattr(TalkerRunner, "step_rows", counted)
    return counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_speaks_every_line_as_it_speaks_alone(tiny_dir, released_06_kernels, measured, monkeypatch, dtype):
    """Lines of different lengths, chunk counts, seeds and sampling settings, two or three at a time: rows end and
    are refilled mid-batch, every line's codes and samples equal its one-line run's, the batch's tree rounds (every
    row's frame in one call, out of step as acceptance differs, rows drawn by their own settings) making the calls
    and accepting what the line's own rounds do, and a line the model cannot speak fails alone."""
    synth = Synthesizer.from_checkpoint(tiny_dir if dtype == "float32" else released_06_kernels, dtype=dtype)
    synth = synth.using(Speculation(resolve_tree("8"), Offsets.zeros(3, synth.hidden_size)))
    settings = GenerationSettings(max_frames=16 if dtype == "float32" else 9)  # chunks of 16 frames: lines of 1-3
    own = {  # lines sampled by their own settings share the calls of lines sampled by the batch's
        1: GenerationSettings(max_frames=settings.max_frames, temperature=0.6, top_k=20),
        2: GenerationSettings(max_frames=settings.max_frames, top_p=0.8, predictor_temperature=1.2),
    }
    lines = [
        Line(text=text, utterance=index + 3, seed=index % 2 or None, settings=own.get(index))
        for index, text in enumerate(TEXTS)
    ]
    alone = [  # seeds 5 (the batch's) and 1 (the line's own) share the batch's calls
        synth.synthesize(
            line.text, seed=line.seed or 5, utterance=line.utterance, settings=line.settings or settings, chunk_chars=40
        )
        for line in lines
    ]
    rows = _count_rows(monkeypatch)
    grown = []
    allocate = TalkerRunner.allocate

    def counted_allocate(self, max_len, rows=None):
        if hasattr(self, "k_cache") and self.rows > 1 and max_len > self.max_len:
            grown.append(max_len)
        return allocate(self, max_len, rows)

    monkeypatch.setattr(TalkerRunner, "allocate", counted_allocate)
    monkeypatch.setattr(talker_module, "CAPACITY_STEP", 16)  # the cache grows while other rows are mid-line
    synth.runners.talker().allocate(16, 1)
    batch_size = 2 if dtype == "float32" else 3
    bad = [Line(text="Nobody speaks this.", speaker="nobody"), Line(text="  ")]
    outcomes = dict(
        synth.synthesize_many(
            bad[:1] + lines + bad[1:], seed=5, settings=settings, chunk_chars=40, batch_size=batch_size
        )
    )
    assert sorted(outcomes) == list(range(len(lines) + 2))
    assert "nobody" in str(outcomes[0]) and "empty" in str(outcomes[len(lines) + 1])
    together = [outcomes[index + 1] for index in range(len(lines))]
    assert grown  # the cache grew while several rows were in use
    assert synth.runners.talker().rows == 1 and synth.runners.batch_runner().rows == 1  # the batch's rows let go
    assert max(rows) == batch_size and len(rows) < sum(len(a.codes) for a in alone) - len(lines)
    if dtype == "float32":
        assert sorted({a.chunks for a in alone}) == [1, 2, 3] and len({len(a.codes) for a in alone}) > 2
    for index, one in enumerate(alone):
        made = together[index]
        assert np.array_equal(made.codes, one.codes), index
        assert np.array_equal(made.audio, one.audio), index
        assert made.seed == one.seed == (lines[index].seed or 5)
        record = made.record()
        assert record["batch_rows"] == batch_size and record["frames"] == len(one.codes)
        assert record["batch_row_mib"] > 0 and one.record()["batch_row_mib"] is None
        assert record["predictor_calls"] == one.record()["predictor_calls"]
        assert made.stats.accepted_per_depth == one.stats.accepted_per_depth and record["tree_nodes"] == 8
    plain_calls = sum(len(one.codes) for one in alone) * (synth.code_predictor.config.num_code_groups - 1)
    assert sum(made.record()["predictor_calls"] for made in together) < plain_calls  # trees were accepted


def test_a_batched_talker_step_gives_each_row_the_bits_of_its_own_step(tiny, measured):
    """Rows of different prompt lengths, stepped together, equal their one-row steps (torch's attention over
    gathered slots, float32)."""
    talker = tiny.model.talker
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3]
    prompts = [torch.randn(n, talker.config.hidden_size, generator=generator) for n in lengths]
    inputs = torch.randn(3, 3, talker.config.hidden_size, generator=generator)
    batched = TalkerRunner(talker)
    firsts = [batched.prefill(prompt, row=row) for row, prompt in enumerate(prompts)]
    for row, prompt in enumerate(prompts):
        alone = TalkerRunner(talker)
        assert torch.equal(alone.prefill(prompt)[1], firsts[row][1])
    steps = [batched.step_rows(inputs[t], [n + t for n in lengths], [0, 1, 2]) for t in range(3)]
    for row, prompt in enumerate(prompts):
        alone = TalkerRunner(talker)
        alone.prefill(prompt)
        for t in range(3):
            hidden, logits = alone.step(inputs[t, row : row + 1], lengths[row] + t)
            assert torch.equal(steps[t][0][row], hidden) and torch.equal(steps[t][1][row], logits)


def test_a_batch_file_writes_the_files_of_a_one_line_run_and_resumes(tiny_dir, tmp_path, measured):
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(text + "\n" for text in TEXTS))
    common = ["synth", "-f", lines, "--model", tiny_dir, "--max-frames", 12, "-q"]
    one = run_cli(*common, "--out-dir", tmp_path / "one", "--batch-size", 1)
    began = time.perf_counter()
    many = run_cli(*common, "--out-dir", tmp_path / "many", "--batch-size", 3, "--stats-json", tmp_path / "s.json")
    elapsed = time.perf_counter() - began
    assert one.exit_code == many.exit_code == 0, many.output
    # three lines at once overlap: the total is the batch's own wall, not the sum of theirs
    total = json.loads((tmp_path / "s.json").read_text())["total"]
    assert total["wall_seconds"] <= elapsed and total["wall_seconds"] < total["lines_wall_seconds"]
    assert total["rtf"] == pytest.approx(total["wall_seconds"] / total["audio_seconds"], rel=1e-3)
    written = sorted(p.name for p in (tmp_path / "one").glob("*.wav"))
    assert len(written) == 5 and written == sorted(p.name for p in (tmp_path / "many").glob("*.wav"))
    for name in written:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "many" / name).read_bytes(), name
    entries = [json.loads(raw) for raw in (tmp_path / "many" / "manifest.jsonl").read_text().splitlines()]
    assert [e["line"] for e in entries] == [1, 2, 3, 4, 5] and {e["batch_rows"] for e in entries} == {3}
    (tmp_path / "many" / written[1]).unlink()  # resumed: only the missing file is made, the same bytes
    again = run_cli(*common, "--out-dir", tmp_path / "many", "--batch-size", 3)
    assert again.exit_code == 0 and len(list((tmp_path / "many").glob("*.wav"))) == 5
    assert (tmp_path / "one" / written[1]).read_bytes() == (tmp_path / "many" / written[1]).read_bytes()


def test_a_line_whose_audio_fails_fails_alone_and_a_batch_that_cannot_fit_runs_line_by_line(
    tiny_dir, measured, monkeypatch
):
    synth = Synthesizer.from_checkpoint(tiny_dir)
    settings = GenerationSettings(max_frames=6)
    lines = [Line(text=text) for text in TEXTS[:3]]
    alone = [synth.synthesize(text, utterance=index, settings=settings) for index, text in enumerate(TEXTS[:3])]
    assert list(synth.synthesize_many([], settings=settings)) == []
    decode = synth.codec.decode
    calls = []

    def failing(codes, clone=None):
        calls.append(len(codes))
        if len(calls) == 2:
            raise RuntimeError("the decoder broke")
        return decode(codes, clone)

    monkeypatch.setattr(synth.codec, "decode", failing)
    outcomes = list(synth.synthesize_many(lines, settings=settings, batch_size=3))
    broken = [index for index, outcome in outcomes if isinstance(outcome, Exception)]
    assert len(broken) == 1 and "the decoder broke" in str(dict(outcomes)[broken[0]])
    assert sorted(index for index, _ in outcomes) == [0, 1, 2]
    for index, outcome in outcomes:
        if index not in broken:
            assert np.array_equal(outcome.audio, alone[index].audio)  # utterance: the line's index
    monkeypatch.setattr(synth.codec, "decode", decode)
    monkeypatch.setattr(batch_size, "available_bytes", lambda device: 0)
    notices = []
    one_by_one = dict(synth.synthesize_many(lines, settings=settings, batch_size=3, on_notice=notices.append))
    assert "speaking 1 at a time" in notices[0] and {s.record()["batch_rows"] for s in one_by_one.values()} == {1}


def test_auto_takes_the_smallest_size_within_a_tenth_of_the_cheapest_measured_once(
    tiny_dir, measured, monkeypatch, user_cache
):
    tiny = Synthesizer.from_checkpoint(tiny_dir)  # its runners' kernels measured (and probed for invariance)
    assert batch_size.choose_batch_size(tiny, 1)[0] == 1
    measured_costs = batch_size.frame_costs(tiny, (1, 2))
    assert set(measured_costs) == {1, 2} and all(ms > 0 for ms in measured_costs.values())
    assert (
        tiny.runners.talker().rows == 1 and tiny.runners.batch_runner().rows == 1
    )  # the measured rows' caches are let go
    monkeypatch.setattr(batch_size, "frame_costs", lambda synth: {1: 100.0, 2: 60.0, 4: 51.0, 8: 47.0})
    assert batch_size.choose_batch_size(tiny, 16)[0] == 4  # 51 <= 1.1 x 47; 60 is not
    monkeypatch.setattr(batch_size, "frame_costs", lambda synth: pytest.fail("measured again"))
    chosen, source = batch_size.choose_batch_size(tiny, 3)
    assert chosen == 3 and "measured before" in source and (user_cache / "batch-sizes.json").is_file()
    monkeypatch.setenv("RVQTTS_CHOICES", "fixed")
    assert batch_size.choose_batch_size(tiny, 16) == (1, "RVQTTS_CHOICES=fixed (no measurement)")


def test_a_batch_that_would_not_fit_in_memory_is_cut_to_one_that_does(tiny, monkeypatch):
    per_row = batch_size.row_bytes(tiny, 1000)
    assert per_row > batch_size.row_bytes(tiny, 500) > 0
    monkeypatch.setattr(batch_size, "available_bytes", lambda device: 6 * per_row)
    assert batch_size.fitting_rows(tiny, 8, 1000) in (3, 4)  # half of 6 rows' memory, and the one-line cache
    assert batch_size.fitting_rows(tiny, 2, 1000) == 2
    monkeypatch.setattr(batch_size, "available_bytes", lambda device: 0)
    assert batch_size.fitting_rows(tiny, 8, 1000) == 1


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--batch-size", 0], "--batch-size must be auto or a whole number of at least 1"),
        (["--batch-size", "many"], "--batch-size must be auto or a whole number of at least 1"),
    ],
)
def test_batch_sizes_that_cannot_run_are_refused_with_what_to_do(tiny_dir, tmp_path, arguments, message):
    lines = tmp_path / "lines.txt"
    lines.write_text("Hello.\n")
    result = run_cli("synth", "-f", lines, "--out-dir", tmp_path / "out", "--model", tiny_dir, *arguments)
    assert result.exit_code == 2 and message in result.output
    alone = run_cli("synth", "Hello.", "-o", tmp_path / "a.wav", "--model", tiny_dir, "--batch-size", 2)
    assert alone.exit_code == 2 and "--batch-size is for batch files" in alone.output


def test_bench_batch_times_each_size_beside_stock_qwen_tts(tiny_dir, tmp_path):
    texts = tmp_path / "lines.txt"
    texts.write_text("Hello there.\nA second line.\nThe third.\n")
    out = tmp_path / "batch.json"
    result = run_cli(
        "bench", "batch", "--texts", texts, "--model", tiny_dir, "--sizes", "1,2", "--max-frames", 4, "--json", out
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert [row["batch_size"] for row in figures["rows"]] == [1, 2] and figures["lines"] == 3
    for row in figures["rows"]:
        assert row["rvqtts"]["audio_seconds"] == figures["rows"][0]["rvqtts"]["audio_seconds"] > 0  # the same audio
        assert row["rvqtts"]["throughput"] > 0 and row["stock"]["throughput"] > 0
        assert row["rvqtts"]["first_file_seconds"] <= row["rvqtts"]["wall_seconds"]
    assert figures["rows"][0]["rvqtts"]["throughput_vs_b1"] == 1.0
    refused = run_cli("bench", "batch", "--texts", texts, "--model", tiny_dir, "--sizes", "0")
    assert refused.exit_code == 2 and "at least 1" in refused.output


@pytest.mark.parametrize("which, attention", [("narrow", "rows"), ("narrow", "gathered"), ("released_06", "rows")])
def test_a_batched_round_gives_every_frame_the_codes_and_rounds_it_gets_alone(which, attention, request, measured):
    """Frames decoded together by tree rounds (every frame's round in one call, each at its own root index)
    equal their one-frame speculative runs: codes, calls and accepted depths; and the plain loop's codes.
    A model whose drafts are often right (codebook 16) puts the frames out of step; a frame without a tree
    takes plain steps in the same calls."""
    synth = (
        request.getfixturevalue("narrow")
        if which == "narrow"
        else Synthesizer.from_checkpoint(request.getfixturevalue("released_06_kernels"), dtype="bfloat16")
    )
    speculation = Speculation(resolve_tree("16"), Offsets.zeros(3, synth.hidden_size))
    parts = LoopParts.build(synth.code_predictor, speculation, False)
    runner = parts.runner
    runner.row_attention = attention == "rows"  # gathered: per depth, as off the CPU
    groups, vocab = synth.code_predictor.config.num_code_groups, synth.code_predictor.config.vocab_size
    sampling = SamplingConfig(do_sample=which != "narrow")
    prefixes = torch.stack([random_prefix(synth, seed=f) for f in range(6)]).to(runner.dtype)
    noise = torch.stack([torch.from_numpy(gumbel_noise(3, f, 0, np.arange(1, groups), vocab)) for f in range(6)])
    speculations = [None if f == 3 else speculation for f in range(6)]  # (random weights at the released widths
    # accept drafts in frames 2 and 5 of these six)
    frames = speculative_frames(runner, prefixes, noise, sampling, speculations, parts.offsets)
    for f, frame in enumerate(frames):
        one = slice(f, f + 1)  # the frame alone, in row 0
        assert [frame.codes] == plain_frames(runner, prefixes[one], noise[one], sampling)
        if speculations[f] is None:
            assert frame.calls == groups - 1 and not frame.accepted and not frame.drafted
            continue
        (alone,) = speculative_frames(runner, prefixes[one], noise[one], sampling, [speculation], parts.offsets)
        assert frame.codes == alone.codes and frame.calls == alone.calls and frame.accepted == alone.accepted
    assert len({frame.calls for frame in frames}) > 2 and min(frame.calls for frame in frames) < groups - 1


def test_a_batch_chooses_its_tree_size_online_at_its_rows_and_keeps_every_lines_codes(
    narrow, measured, user_cache, monkeypatch
):
    """Where the tree size is chosen online, a batch has a choice of its own whose call costs are measured at
    its rows; the size changing mid-batch (forced here) changes no line's codes."""
    offsets = Offsets(torch.randn(3, narrow.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.5)
    online = narrow.using(OnlineSpeculation(offsets, predictor_fingerprint(narrow.code_predictor)))
    sizes = iter([4, 0, 16, 32, 8] * 20)
    monkeypatch.setattr(online_module, "DECIDE_EVERY", 6)
    monkeypatch.setattr(OnlineSpeculation, "decide", lambda self: setattr(self, "budget", next(sizes)))
    settings = GenerationSettings(max_frames=12)
    lines = [Line(text=text, utterance=index) for index, text in enumerate(TEXTS[:4])]
    together = dict(online.synthesize_many(lines, seed=4, settings=settings, batch_size=3))
    batch_online = online.runners.batch_speculation(3)
    alone = [online.synthesize(line.text, seed=4, utterance=line.utterance, settings=settings) for line in lines]
    for index, one in enumerate(alone):
        assert np.array_equal(together[index].codes, one.codes), index
        for made in (one, together[index]):  # each line's own frames by tree size, not the run's so far
            assert sum(made.record()["online"]["frames_by_N"].values()) == len(made.codes), index
    assert batch_online.rows == 3 and batch_online is not online.speculation
    assert len(batch_online.frames_by_budget) >= 3 and together[0].record()["online"]["rows"] == 3
    costs = json.loads((user_cache / "call-costs.json").read_text())
    assert any(key.endswith("/rows-3") for machine in costs.values() for key in machine)


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("where", ["talker", "code predictor"])
def test_a_row_whose_logits_go_non_finite_fails_alone(tiny_dir, measured, monkeypatch, where, spec):
    """NaN in one row's logits (an overflow that its text alone meets) fails that line with NonFiniteError and frees
    its row; the lines beside it, in the same calls, speak what they speak alone."""
    from rvqtts.engine.model.predictor import PredictorRunner
    from rvqtts.engine.model.sampling import NonFiniteError

    synth = Synthesizer.from_checkpoint(tiny_dir, dtype="float32")
    synth = synth.using(Speculation(resolve_tree("4"), Offsets.zeros(3, synth.hidden_size)) if spec else None)
    settings = GenerationSettings(max_frames=6)
    lines = [Line(text=text, speaker=synth.speakers[0]) for text in ("One line.", "The poisoned line.", "A third one.")]
    alone = {
        i: synth.synthesize(line.text, line.speaker, seed=3, utterance=i, settings=settings).audio
        for i, line in enumerate(lines)
        if i != 1
    }
    if where == "talker":  # row 1's talker logits, the c0 of its second frame: batched steps carry rows 0..2
        step_rows = TalkerRunner.step_rows

        def nan_in_row_1(self, embeds, positions, rows):
            hidden, logits = step_rows(self, embeds, positions, rows)
            if 1 in rows:
                logits = logits.clone()
                logits[rows.index(1)] = float("nan")
            return hidden, logits

        monkeypatch.setattr(TalkerRunner, "step_rows", nan_in_row_1)
    else:  # frame 1's scores of c1, in the first call of the three frames' inner loop
        logits = PredictorRunner.logits

        def nan_in_frame_1(self, hidden, index):
            scores = logits(self, hidden, index)
            if index == 1 and scores.shape[0] == 3:
                scores[1] = float("nan")
            return scores

        monkeypatch.setattr(PredictorRunner, "logits", nan_in_frame_1)
    results = dict(synth.synthesize_many(lines, seed=3, settings=settings, batch_size=3))
    assert isinstance(results[1], NonFiniteError) and where in str(results[1])
    for i in (0, 2):
        assert np.array_equal(results[i].audio, alone[i]), f"line {i} changed beside the failing row"


def test_streamed_lines_decode_their_pieces_together_and_a_line_whose_decoding_fails_fails_alone(
    tiny_dir, measured, monkeypatch
):
    """Three streamed lines in three rows: their due pieces are decoded in shared passes, and each line's pieces
    join to its one-line stream's samples up to float rounding; a pass that fails is redone line by line, so only
    the line whose own decoding fails fails, the others' samples unchanged."""
    from rvqtts.qwen.codec import StreamPacing
    from rvqtts.synthesis import pipeline

    synth = Synthesizer.from_checkpoint(tiny_dir)
    settings, pacing = GenerationSettings(max_frames=9), StreamPacing()
    lines = [Line(text=text, utterance=index) for index, text in enumerate(TEXTS[:3])]

    def spoken(batch: list[Line], rows: int) -> dict:
        pieces: dict = {}
        for index, item in synth.synthesize_many(batch, settings=settings, batch_size=rows, stream=pacing):
            pieces.setdefault(index, []).append(item)
        return pieces

    alone = [spoken([line], 1)[0] for line in lines]
    created, passes, broken = [], [], []  # the decoders made (a line each, in order), the passes' streams
    streaming_decoder, push_together = synth.codec.streaming_decoder, pipeline.push_together
    breaking: list[int] = []  # the lines (by order) whose decoder breaks every pass it is in

    def recorded_decoder():
        created.append(streaming_decoder())
        if len(created) - 1 in breaking:
            broken.append(created[-1])
        return created[-1]

    def counted(streams, codes):
        passes.append(len(streams))
        if any(stream in broken for stream in streams):
            raise RuntimeError("the decoder broke")
        return push_together(streams, codes)

    monkeypatch.setattr(synth.codec, "streaming_decoder", recorded_decoder)
    monkeypatch.setattr(pipeline, "push_together", counted)
    for broken_lines in ([], [1]):
        breaking[:] = broken_lines
        created.clear()
        passes.clear()
        together = spoken(lines, 3)
        assert max(passes) == 3  # the three first pieces in one pass
        for index, own in enumerate(alone):
            made = together[index]
            if index in breaking:
                assert isinstance(made[-1], RuntimeError) and len(made) == 1
                assert made[-1].__context__ is None  # its own error, not chained to the shared pass's (its tensors)
                continue
            assert np.array_equal(made[-1].codes, own[-1].codes)
            streamed, expected = np.concatenate(made[:-1]), np.concatenate(own[:-1])
            assert streamed.shape == expected.shape and np.abs(streamed - expected).max() <= 1e-5


def test_the_between_frames_hook_runs_once_a_frame_with_its_rows(tiny, measured):
    """`speak(between_frames=...)` runs once after each frame of the loop (a server runs its waiting tasks there),
    told how many rows made it: not once per row."""
    calls: list[int] = []
    lines = [Line(text=text, utterance=0, seed=1, settings=GenerationSettings(max_frames=12)) for text in TEXTS[:2]]
    spoken = [item for _, item in speak(tiny, lines, None, 2, between_frames=calls.append)]
    frames = sum(len(item.codes) for item in spoken if isinstance(item, Synthesis))
    assert sum(calls) == frames and max(calls) == 2 and len(calls) < frames
