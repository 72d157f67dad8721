"""`--tree auto` decided online (rvqtts.engine.speculative.online): acceptance counted from the rounds that run, the
choice made from it and the measured call costs, the same codes whatever the tree size does mid-run, and what
a run learns kept for the next."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import random_prefix
from helpers import run_cli as run

import rvqtts.engine.speculative.online as online_module
from rvqtts.engine.loop.inner_loop import InnerLoop, LoopParts
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import Offsets, predictor_fingerprint
from rvqtts.engine.speculative.online import AcceptanceCounts, OnlineSpeculation, committed_ranks
from rvqtts.engine.speculative.speculation import OBSERVED_RANKS
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.support.measurements import Measurements
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.calibration import acceptance_table

FRAMES = 48


@pytest.fixture(autouse=True)
def measured(monkeypatch):
    """Kernels measured (and so known row-invariant): the online choice runs only where they are."""
    monkeypatch.setenv("RVQTTS_CHOICES", "measured")


def test_counts_give_the_calibration_table_of_the_same_ranks():
    """The online counts and rvqtts.tuning.calibration's offline table agree on the same ranks (-1: past the
    frame's end there, None here)."""
    generator = np.random.default_rng(0)
    ranks = generator.choice([0, 0, 0, 1, 2, 5, OBSERVED_RANKS, -1], size=(40, 14, 3))
    counts = AcceptanceCounts.empty(3)
    for row in ranks.reshape(-1, 3):
        counts.observe([None if r < 0 else int(r) for r in row])
    expected = acceptance_table(ranks, OBSERVED_RANKS)
    assert np.allclose(counts.table(), expected, atol=1e-6)


def test_committed_ranks_read_each_depths_draft_list():
    codes = [5, 6, 7, 8, 9]  # c1..c5
    drafted = [[6, 1, 2], [3, 7, 4], [0, 1, 2]]  # drafts for c2, c3, c4 from the root c1
    assert committed_ranks(drafted, codes, 1) == [0, 1, OBSERVED_RANKS]
    assert committed_ranks(drafted, codes, 4) == [OBSERVED_RANKS, None, None]  # c6, c7 are past the end


def online_loop(synth, costs: dict[int, float], seed: int = 11) -> tuple[InnerLoop, OnlineSpeculation]:
    offsets = Offsets(torch.randn(3, synth.hidden_size, generator=torch.Generator().manual_seed(2)) * 0.5)
    online = OnlineSpeculation(offsets, predictor_fingerprint(synth.code_predictor))
    online.costs, online.costs_source, online.learn_costs = dict(costs), "given", False
    parts = LoopParts.build(synth.code_predictor, online, False)
    return InnerLoop(synth.code_predictor, online, seed, parts=parts), online


def plain_codes(synth, frames: int) -> list[list[int]]:
    loop = InnerLoop(synth.code_predictor, None, seed=11)
    return [loop.frame(random_prefix(synth, seed=f), SamplingConfig(), 0, f) for f in range(frames)]


@pytest.mark.parametrize("which", ["tiny", "narrow"])
def test_codes_equal_the_plain_loops_while_the_tree_size_changes_mid_run(which, request, monkeypatch):
    synth = request.getfixturevalue(which)
    sizes = iter([4, 0, 16, 32, 8, 0, 32, 4])
    monkeypatch.setattr(online_module, "DECIDE_EVERY", 6)
    monkeypatch.setattr(OnlineSpeculation, "decide", lambda self: setattr(self, "budget", next(sizes)))
    loop, online = online_loop(synth, {q: 1.0 for q in (1, 4, 5, 9, 17, 33)})
    codes = [loop.frame(random_prefix(synth, seed=f), SamplingConfig(), 0, f) for f in range(FRAMES)]
    assert codes == plain_codes(synth, FRAMES)
    assert set(online.frames_by_budget) == {0, 4, 8, 16, 32} and online.probes >= 1
    assert loop.stats.frames == FRAMES and loop.stats.codes == 15 * FRAMES
    if which == "narrow":
        assert loop.stats.calls < 15 * FRAMES  # drafts were accepted on the way


def test_the_choice_follows_what_rounds_cost(narrow):
    """On a model whose drafts are often right (codebook 16), rounds that cost what a step costs pay at
    once; rounds that cost their rows do not, and the plain loop stays."""
    cheap, online = online_loop(narrow, {q: 1.0 for q in (1, 4, 5, 9, 17, 33)})
    for f in range(24):
        cheap.frame(random_prefix(narrow, seed=f), SamplingConfig(), 0, f)
    assert online.budget > 0 and online.decisions and online.frames_by_budget[online.budget] > 0
    projected = online.projection()
    assert projected[online.budget]["codes_per_ms"] == max(row["codes_per_ms"] for row in projected.values())
    assert projected[32]["codes_per_call"] > 1.5  # measured on the model, not the prior
    dear, online = online_loop(narrow, {q: float(q) for q in (1, 4, 5, 9, 17, 33)})
    for f in range(24):
        dear.frame(random_prefix(narrow, seed=f), SamplingConfig(), 0, f)
    assert online.budget == 0 and set(online.frames_by_budget) == {0} and 1 <= online.probes < 3


MEASURED = {1: 1.0, 4: 1.1, 5: 1.2, 9: 1.5, 17: 2.0, 33: 3.0}  # call costs at the start: rounds cost about a step
GOOD_DRAFTS = [[0.7, 0.1] + [0.0] * (OBSERVED_RANKS - 2)] * 3  # acceptance at which such rounds pay


def timed_choice(learn: bool, milliseconds_per_call: dict[int, float], frames: int) -> OnlineSpeculation:
    """The choice after `frames` frames, each timed as its calls cost at `milliseconds_per_call` (plain frames
    15 steps; probe and tree frames 6 calls of the round's rows: the prefill and 5 rounds, as the projection
    counts them), from MEASURED costs and GOOD_DRAFTS
    counted over so many roots that the frames do not move them."""
    online = OnlineSpeculation(Offsets(torch.zeros(3, 8)), "model", learn_costs=learn)
    online.costs, online.counts, online.budget = dict(MEASURED), AcceptanceCounts.from_table(GOOD_DRAFTS, 3, 1e6), 0
    codes = list(range(15))
    rounds = [(i, [[codes[i + d]] * OBSERVED_RANKS for d in range(min(3, 14 - i))]) for i in (1, 4, 7, 10, 13)]
    for _ in range(frames):
        speculation, probe = online.frame_speculation()
        if speculation is None:
            online.observe(codes, [], False, 15 * milliseconds_per_call[1])
        else:
            q = online.depth + 1 if probe else online.budget + 1
            online.observe(codes, rounds, probe, 6 * milliseconds_per_call[q])
    return online


@pytest.mark.parametrize("roots", [1e6, online_module.FAR_ROOTS - 1])
def test_a_run_starts_from_what_its_counted_acceptance_chooses(tiny, monkeypatch, roots):
    """With acceptance counted over FAR_ROOTS roots or more (an earlier run's), the first frame runs the tree those
    counts choose, not DECIDE_EVERY frames of the plain loop; with fewer (the prior's), the run starts plain."""
    counts = AcceptanceCounts.from_table(GOOD_DRAFTS, 3, roots)
    monkeypatch.setattr(online_module, "learned_counts", lambda key, depth: counts)
    online = OnlineSpeculation(Offsets(torch.zeros(3, tiny.hidden_size)), "model", learn_costs=False)
    online.costs = dict(MEASURED)
    online.start(LoopParts.build(tiny.code_predictor, online, False).runner, SamplingConfig())
    speculation, probe = online.frame_speculation()
    if roots >= online_module.FAR_ROOTS:
        assert online.budget > 0 and speculation.tree.nodes == online.budget and not probe
        assert online.decisions[0]["frame"] == 0
    else:
        assert online.budget == 0 and not online.decisions


def test_call_costs_are_learned_from_the_frames_timed():
    """Rounds timed at the start at about a step's cost, but at 3x that in the frames that run them: the choice
    tries trees, learns what they cost there and returns to the plain loop (each size tried at most once);
    not learning, it keeps a tree."""
    dear = {1: 1.0, **{q: 3 * ms for q, ms in MEASURED.items() if q > 1}}
    assert timed_choice(False, dear, 96).budget > 0
    online = timed_choice(True, dear, 96)
    assert online.budget == 0 and len(online.decisions) <= 1 + len(online.budgets)
    assert online.call_ms(1) == pytest.approx(1.0) and online.call_ms(4) == pytest.approx(3.3)
    assert all(online.call_ms(q) == pytest.approx(3 * MEASURED[q]) for q in MEASURED if q > 1)
    record = online.record()
    assert record["call_ms"]["5"] == 1.2 and record["call_ms_in_frames"]["4"] == 3.3
    assert record["projected"]["4"]["call_ms"] == pytest.approx(3.6)


def test_a_size_not_run_yet_is_priced_as_the_nearest_size_that_ran():
    """Frames that cost twice their measured calls, plain and probe alike: a size not run is priced at twice its
    measured cost, so the measured ratios still decide (a tree, as at the start)."""
    online = timed_choice(True, {q: 2 * ms for q, ms in MEASURED.items()}, 5 * online_module.PROBE_EVERY)
    assert online.budget > 0 and online.decisions[0]["frame"] == online_module.DECIDE_EVERY
    for q in MEASURED:
        assert online.call_ms(q) == pytest.approx(2 * MEASURED[q])


def test_probes_thin_out_where_trees_are_far_from_paying():
    """Drafts that are rarely right, at rounds that cost their rows: once enough roots are counted the best tree
    projects under FAR of the plain loop's speed, and probes run one frame in FAR_PROBE_EVERY; drafts right often
    enough to come near paying keep the probes where their share puts them."""
    rare = [[0.05, 0.02] + [0.0] * (OBSERVED_RANKS - 2)] * 3
    online = OnlineSpeculation(Offsets(torch.zeros(3, 8)), "model", learn_costs=False)
    online.costs, online.budget = {1: 1.0, 4: 1.2, 5: 2.0, 9: 3.0, 17: 5.0, 33: 9.0}, 0  # a cheap probe chain
    online.counts = AcceptanceCounts.from_table(rare, 3, online_module.FAR_ROOTS - 1)
    online.decide()
    assert not online.far and online.probe_every() < online_module.FAR_PROBE_EVERY  # too few roots yet
    online.counts = AcceptanceCounts.from_table(rare, 3, online_module.FAR_ROOTS)
    online.decide()
    assert (
        online.far
        and online.probe_every() == online_module.FAR_PROBE_EVERY
        and online.record()["trees_far_from_paying"]
    )
    near = timed_choice(False, MEASURED, 1)
    near.costs = {q: 1.3 * ms for q, ms in MEASURED.items()} | {1: 1.0}
    near.decide()
    assert (
        not near.far and near.projection()[4]["codes_per_ms"] > online_module.FAR * near.projection()[0]["codes_per_ms"]
    )


def test_probes_are_spaced_so_that_they_cost_at_most_their_share(narrow):
    """Where a probe's chain of K + 1 rows costs a step, probes run at PROBE_EVERY; where it costs its rows, a
    probe frame costs more than the plain frame it replaces, and probes are spaced so that they add at most
    PROBE_SHARE to the plain loop's time at the acceptance counted."""
    from rvqtts.engine.speculative.tree import frame_codes_per_call

    loop, online = online_loop(narrow, {q: 1.0 for q in (1, 4, 5, 9, 17, 33)})
    loop.frame(random_prefix(narrow, seed=0), SamplingConfig(), 0, 0)
    assert online.probe_every() == online_module.PROBE_EVERY
    loop, online = online_loop(narrow, {q: float(q) for q in (1, 4, 5, 9, 17, 33)})
    loop.frame(random_prefix(narrow, seed=0), SamplingConfig(), 0, 0)
    every = online.probe_every()
    per_call = frame_codes_per_call(online.counts.table(), online_module.probe_tree(3), 15)
    probe_frame, plain_frame = 15 / per_call * 4, 15  # in steps: the chain's calls cost 4 steps each
    assert every > online_module.PROBE_EVERY
    assert (probe_frame - plain_frame) / every <= online_module.PROBE_SHARE * plain_frame
    assert (probe_frame - plain_frame) / (every - 1) > online_module.PROBE_SHARE * plain_frame  # no wider than needed


def refuse_writes(monkeypatch):
    """A cache that refuses every change (as a read-only one would; the tests run as root, whom modes do not stop)."""

    def refused(self):
        raise PermissionError(f"{self.path}: read-only")

    monkeypatch.setattr(Measurements, "update", refused)


def test_a_run_writes_nothing_and_what_it_learns_is_where_the_next_one_starts(narrow, user_cache, monkeypatch):
    """The frames write nothing (a cache that refuses writes does not stop them; the counts stayed in memory);
    `save`, as a run's end and the process's exit call it, keeps them for the next run."""
    first, online = online_loop(narrow, {q: float(q) for q in (1, 4, 5, 9, 17, 33)})
    with monkeypatch.context() as patch:
        refuse_writes(patch)
        for f in range(16):
            first.frame(random_prefix(narrow, seed=f), SamplingConfig(), 0, f)
    assert not (user_cache / "acceptance-online.json").exists()
    online.save()
    learned = online.observed()
    stored = json.loads((user_cache / "acceptance-online.json").read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["reached"][0] == pytest.approx(learned, abs=1)
    second, again = online_loop(narrow, {q: float(q) for q in (1, 4, 5, 9, 17, 33)})
    second.frame(random_prefix(narrow, seed=0), SamplingConfig(), 0, 0)
    assert again.observed() >= learned


def test_call_costs_are_measured_once_and_kept(tiny, user_cache):
    offsets = Offsets.zeros(3, tiny.hidden_size)
    online = OnlineSpeculation(offsets, predictor_fingerprint(tiny.code_predictor))
    parts = LoopParts.build(tiny.code_predictor, online, False)
    costs, source = online_module.call_costs(parts.runner, [1, 5, 17])
    assert set(costs) == {1, 5, 17} and all(ms > 0 for ms in costs.values()) and source.startswith("measured now")
    again, source = online_module.call_costs(parts.runner, [1, 17])
    assert again == {1: costs[1], 17: costs[17]} and "measured before" in source
    assert (user_cache / "call-costs.json").exists()


def test_trees_that_cost_more_steps_than_they_can_accept_codes_are_not_measured(tiny, user_cache, monkeypatch):
    """With a bound of depth + 1 codes a call, lengths are timed shortest first and the first one that costs
    that many steps ends the measuring: longer calls cost more still, and no tree among them can pay."""
    timed = []

    def fake(runner, queries, repeats=9, rows=1):
        timed.append(max(queries))
        return {q: float(q) if q < 9 else 4.5 * q for q in queries}  # a 9-row call costs 40 steps

    monkeypatch.setattr(online_module, "measure_call_costs", fake)
    runner = LoopParts.build(tiny.code_predictor, None, False).runner
    costs, _ = online_module.call_costs(runner, [1, 4, 5, 9, 17, 33], rows=3, bound=4)
    assert costs == {1: 1.0, 4: 4.0} and timed == [1, 4]
    costs, source = online_module.call_costs(runner, [1, 4, 5, 9, 17, 33], rows=3, bound=6)
    assert costs == {1: 1.0, 4: 4.0, 5: 5.0, 9: 40.5} and timed == [1, 4, 5, 9] and "measured now" in source
    again, source = online_module.call_costs(runner, [1, 4, 5, 9, 17, 33], rows=3, bound=6)
    assert again == costs and timed == [1, 4, 5, 9] and "measured before" in source


def test_a_default_run_chooses_online_and_says_what_it_did(tiny_dir, tmp_path):
    stats = tmp_path / "s.json"
    result = run(
        "synth",
        "Hello there, online.",
        "--model",
        tiny_dir,
        "-o",
        tmp_path / "a.wav",
        "--max-frames",
        "12",
        "--dtype",
        "float32",
        "--stats-json",
        stats,
    )
    assert result.exit_code == 0, result.output
    assert "--tree auto: the tree size is chosen online, starting from the plain loop" in result.output
    record = json.loads(stats.read_text())["utterances"][0]
    online = record["online"]
    assert sum(online["frames_by_N"].values()) == record["frames"] and online["probe_frames"] >= 1
    # sizes whose calls cost K + 1 steps or more are not timed (call_costs' bound): which ones depends on the load
    assert {"0"} < set(online["projected"]) <= {"0", "4", "8", "16", "32"} and online["call_ms"]["1"] > 0
    assert record["spec"] is True and record["predictor_codes"] == 15 * record["frames"]
    plain = run(
        "synth",
        "Hello there, online.",
        "--model",
        tiny_dir,
        "-o",
        tmp_path / "b.wav",
        "--max-frames",
        "12",
        "--dtype",
        "float32",
        "--no-spec",
    )
    assert plain.exit_code == 0 and (tmp_path / "a.wav").read_bytes() == (tmp_path / "b.wav").read_bytes()


def test_tune_with_texts_shows_what_the_online_choice_chose_from(tiny_dir, tmp_path, user_cache):
    texts = tmp_path / "lines.txt"
    texts.write_text("One line to speak.\nAnd a second one.\n")
    result = run(
        "tune",
        "--model",
        tiny_dir,
        "--dtype",
        "float32",
        "--texts",
        texts,
        "--max-frames",
        "9",
        "--json",
        tmp_path / "tune.json",
    )
    assert result.exit_code == 0, result.output
    trees = json.loads((tmp_path / "tune.json").read_text())["trees"]
    assert sum(trees["frames_by_N"].values()) == 18 and trees["roots_counted"] > 32  # the prior counts 32
    assert "tree size chosen online" in result.output
    assert (user_cache / "acceptance-online.json").exists()


def test_where_kernels_are_not_known_row_invariant_the_tree_size_stays(tiny, monkeypatch):
    """Unprobed kernels (RVQTTS_CHOICES=fixed) or variant ones might give a round's rows other bits than a
    step's: a timing-driven choice could then change a run's codes from run to run, so none is made, and no call
    is timed for it."""
    monkeypatch.setenv("RVQTTS_CHOICES", "fixed")
    loop, online = online_loop(tiny, {q: 1.0 for q in (1, 4, 5, 9, 17, 33)})
    for f in range(17):
        loop.frame(random_prefix(tiny, seed=f), SamplingConfig(), 0, f)
    assert online.fixed and online.budget == 0 and online.frames_by_budget == {0: 17} and online.probes == 0
    assert loop.stats.calls == 15 * 17
    monkeypatch.setattr(online_module, "call_costs", lambda *args, **kwargs: pytest.fail("timed a call"))
    untimed = OnlineSpeculation(online.offsets, online.fingerprint)
    untimed.start(loop.runner, SamplingConfig())
    assert untimed.fixed and untimed.costs == {} and untimed.record()["call_ms"] == {}
    # A recorded start size runs the shipped tree of that size, whatever earlier runs learned.
    loop, online = online_loop(tiny, {q: 1.0 for q in (1, 4, 5, 9, 16, 17, 33)})
    online.start_budget, online.budgets = 15, (4, 8, 15, 16, 32)
    loop.frame(random_prefix(tiny, seed=0), SamplingConfig(), 0, 0)
    assert online.budget == 15 and online.speculation(15).tree.paths == resolve_tree("15").paths


def test_synthesis_on_a_cache_that_refuses_writes_keeps_its_counts_after(tiny_dir, user_cache, monkeypatch):
    """Once the machine is measured (the first utterance), an utterance writes nothing but its output: the online
    choice's counts wait in memory for the run's end."""
    synth = Synthesizer.load(tiny_dir, EngineChoices(dtype="float32"))
    settings = GenerationSettings(max_frames=24)
    synth.synthesize("Measured first.", seed=1, settings=settings)
    before = synth.speculation.frames_seen
    with monkeypatch.context() as patch:
        refuse_writes(patch)  # the choice decides every 8 frames: it used to save its counts there too
        spoken = synth.synthesize("Then spoken on a cache that refuses writes.", seed=2, settings=settings)
    assert len(spoken.codes) >= 16 and synth.speculation.frames_seen >= before + 16
    assert not (user_cache / "acceptance-online.json").exists()
    synth.speculation.save()
    stored = json.loads((user_cache / "acceptance-online.json").read_text())
    assert list(stored.values()) == [synth.speculation.counts.record()]


def test_counts_stay_in_memory_across_samplings_and_are_shared_by_a_batchs_choice(narrow, user_cache):
    """Frames under other sampling settings count apart; coming back finds the counts as they were (not the cache's,
    which nothing wrote), and a batch's choice for the same model, drafter and sampling counts into the same record."""
    loop, online = online_loop(narrow, {q: float(q) for q in (1, 4, 5, 9, 17, 33)})
    for f in range(8):
        loop.frame(random_prefix(narrow, seed=f), SamplingConfig(), 0, f)
    learned = online.observed()
    assert learned > online_module.PRIOR_ROUNDS
    loop.frame(random_prefix(narrow, seed=8), SamplingConfig(temperature=0.5), 0, 8)
    assert online.observed() < learned  # another sampling: its own counts
    loop.frame(random_prefix(narrow, seed=9), SamplingConfig(), 0, 9)
    assert online.observed() >= learned and not (user_cache / "acceptance-online.json").exists()
    batch = online.for_rows(2)
    batch.start(LoopParts.build(narrow.code_predictor, batch, False).runner, SamplingConfig())
    assert batch.counts is online.counts
