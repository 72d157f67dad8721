"""`--tree auto`: how many tree nodes the inner loop runs (N = 0: the plain loop), chosen while it synthesizes from
this model's acceptance, counted from the rounds that run, and this machine's call costs. The choice changes the
speed, never the codes. docs/engine.md, "The tree size chosen online"."""

from __future__ import annotations

import atexit
import hashlib
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from rvqtts.engine.model.devices import synchronize
from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.kernels import device_key
from rvqtts.engine.model.native import source_digest
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import RowSampling, SamplingConfig
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.rounds import FrameRounds, rounds_call, rounds_layout, steps_call
from rvqtts.engine.speculative.speculation import OBSERVED_RANKS, Speculation
from rvqtts.engine.speculative.tree import SHIPPED_TREES, Tree, frame_codes_per_call, grow_tree, load_acceptance
from rvqtts.support.files import cache_dir
from rvqtts.support.measurements import ACCEPTANCE, CALL_COSTS, Measurements

BUDGETS = (4, 8, 16, 32)  # tree sizes the online choice weighs against the plain loop
PROBE_EVERY = 8  # while the plain loop runs, one frame in this many drafts a chain to count acceptance
SETTLED_ROOTS = 512  # once this many roots are counted (the prior's included), probes thin out to
SETTLED_PROBE_EVERY = 32  # one frame in this many
PROBE_SHARE = 0.02  # the most probing may add to the plain loop's time, at the acceptance counted so far
FAR = 0.8  # the best tree projected at most this share of the plain loop's speed: far from paying
FAR_ROOTS = 128  # roots counted (the prior's included) before a tree is called far
FAR_PROBE_EVERY = 128  # frames between probes while the trees are far from paying
DECIDE_EVERY = 8  # frames between choices
SWITCH_MARGIN = 1.03  # a new choice must project this much faster than the one running
REGROW_EVERY = 64  # frames after which the running size's tree is grown again from the counts
LEARN_FRAMES = 4  # frames a call size must have run before their timing replaces its measured cost
PRIOR_ROUNDS = 32  # how many rounds' worth the starting table counts for


@dataclass
class AcceptanceCounts:
    """Per depth d (1..K): `reached[d-1]` roots whose drafts at depths < d all held the committed codes
    within their first OBSERVED_RANKS ranks, and `hits[d-1][r]` of those where the committed code at
    depth d was the rank-r draft. The ratio is rvqtts.tuning.calibration's acceptance table."""

    reached: list[float]
    hits: list[list[float]]

    @classmethod
    def empty(cls, depth: int) -> "AcceptanceCounts":
        return cls([0.0] * depth, [[0.0] * OBSERVED_RANKS for _ in range(depth)])

    @classmethod
    def from_table(cls, table: list[list[float]], depth: int, rounds: float) -> "AcceptanceCounts":
        """A table weighted as `rounds` observations at every depth (missing entries count as misses)."""
        rows = [table[d] if d < len(table) else [] for d in range(depth)]
        hits = [[rounds * row[r] if r < len(row) else 0.0 for r in range(OBSERVED_RANKS)] for row in rows]
        return cls([rounds if d < len(table) else 0.0 for d in range(depth)], hits)

    def observe(self, ranks: list[int | None]) -> None:
        """One root's ranks of the committed codes at depths 1..K (None: past the frame's end, or not
        drafted at that depth; OBSERVED_RANKS: not among the drafts)."""
        for d, rank in enumerate(ranks):
            if rank is None:
                return
            self.reached[d] += 1
            if rank >= OBSERVED_RANKS:
                return
            self.hits[d][rank] += 1

    def table(self) -> list[list[float]]:
        return [[hit / reached if reached else 0.0 for hit in hits] for reached, hits in zip(self.reached, self.hits)]

    def record(self) -> dict:
        return {
            "reached": [round(r, 3) for r in self.reached],
            "hits": [[round(h, 3) for h in row] for row in self.hits],
        }


def committed_ranks(drafted: list[list[int]], codes: list[int], index: int) -> list[int | None]:
    """Ranks of the committed codes c_{index+1..} among a round's drafts [depth][width] made at root
    c_index (codes[m - 1] is c_m): None past the frame's end, OBSERVED_RANKS where not among the first
    OBSERVED_RANKS drafts."""
    committed = codes[index:]
    return [
        None if j >= len(committed) else top.index(committed[j]) if committed[j] in top else OBSERVED_RANKS
        for j, top in enumerate(row[:OBSERVED_RANKS] for row in drafted)
    ]


def probe_tree(depth: int) -> Tree:
    """A chain of the top draft at every depth: K + 1 rows a call, and ranks counted at every depth."""
    return Tree(tuple((0,) * d for d in range(1, depth + 1)), source="online probe: the top draft at each depth")


def predictor_key(runner: PredictorRunner) -> str:
    """What a call's cost depends on besides the machine: dtype, weight format, the predictor's shape, how
    its rounds attend (rvqtts.engine.model.attention), how much runs natively and which build of the native library
    (rvqtts.engine.model.native: a new version's kernels cost otherwise, so its costs are measured anew)."""
    attention = "rows" if runner.row_attention else "gathered"
    native = f"/native-{runner.native_mode}-{source_digest()}" if runner.native_mode else ""
    return (
        f"{str(runner.dtype).removeprefix('torch.')}/{runner.weights}/{runner.hidden_size}x"
        f"{len(runner.layers)}x{runner.vocab_size}/{attention}{native}"
    )


def measure_call_costs(
    runner: PredictorRunner, queries: list[int], repeats: int = 9, rows: int = 1
) -> dict[int, float]:
    """Milliseconds of one predictor call per query length q (1: a plain step; q > 1: a round of a q - 1
    node tree) for each of `rows` frames (a batch's: rvqtts.engine.speculative.rounds), mid-frame, the lengths taking
    turns; median of `repeats` after a warm-up."""
    device, depth = runner.device, 3
    offsets = torch.zeros(depth, runner.hidden_size, device=device, dtype=runner.dtype)
    hidden = torch.randn(runner.hidden_size, device=device, dtype=runner.dtype)
    noise = torch.zeros(runner.code_groups - 1, runner.vocab_size, device=device)
    index = min(7, runner.code_groups - 2)  # mid-frame (7 of 15 residual codes), within the model's own codes
    sampling, static = SamplingConfig(), StaticCalls.for_device(device)
    prior = load_acceptance(SHIPPED_TREES / "prior-acceptance.json")["acceptance"]

    def call(q: int):
        speculation = Speculation(grow_tree(prior, q - 1), Offsets(offsets.float().cpu())) if q > 1 else None
        return partial(rows_call, runner, rows, index, speculation, offsets, hidden, noise, sampling, static)

    calls = {q: call(q) for q in queries}
    times: dict[int, list[float]] = {q: [] for q in queries}
    with torch.inference_mode():
        for turn in range(repeats + 1):  # the first turn warms up
            for q, run in calls.items():
                synchronize(device)
                started = time.perf_counter()
                run()
                synchronize(device)
                if turn:
                    times[q].append((time.perf_counter() - started) * 1e3)
    return {q: round(statistics.median(values), 4) for q, values in times.items()}


def rows_call(
    runner: PredictorRunner,
    rows: int,
    index: int,
    speculation: Speculation | None,
    offsets: torch.Tensor,
    hidden: torch.Tensor,
    noise: torch.Tensor,
    sampling: SamplingConfig,
    calls: StaticCalls,
) -> None:
    """One call of `rows` frames at code `index`: a plain step of each (no speculation), or each one's
    round of the speculation's tree (rvqtts.engine.speculative.rounds.rounds_call), through `calls` as frames make
    it."""
    codes = torch.full((rows,), 5, device=runner.device)
    noise = noise[None].expand(rows, -1, -1)
    if speculation is None:
        calls(("cost", index, rows, sampling), partial(steps_call, runner, index, sampling), codes, noise)
        return
    key, layout = rounds_layout(runner, [FrameRounds(r, index, 5, hidden, speculation) for r in range(rows)])
    calls(
        ("cost", key, sampling),
        partial(rounds_call, runner, layout, offsets, sampling),
        hidden.expand(rows, -1),
        codes,
        noise,
    )


def call_costs(
    runner: PredictorRunner, queries: list[int], rows: int = 1, bound: float | None = None
) -> tuple[dict[int, float], str]:
    """Call costs per query length for this runner at `rows` frames a call, and where they came from: measured once per
    machine, predictor key and rows (call-costs.json), shortest first, each beside a plain step. With `bound`, the
    lengths past one that costs `bound` steps are left out (no tree that accepts at most `bound` codes a call pays
    there)."""
    machine = device_key(runner.device)
    key = predictor_key(runner) + (f"/rows-{rows}" if rows > 1 else "")
    known = {int(q): float(ms) for q, ms in CALL_COSTS.read().get(machine, {}).get(key, {}).items()}
    measured = False
    for q in sorted(set(queries) | {1}):
        if bound is not None and 1 in known and any(known[p] >= bound * known[1] for p in known if 1 < p < q):
            break
        if q not in known:
            known.update(measure_call_costs(runner, [1, q], rows=rows))
            measured = True
    if measured:
        with CALL_COSTS.update() as records:
            records.setdefault(machine, {})[key] = {str(q): ms for q, ms in sorted(known.items())}
    source = f"measured {'now' if measured else 'before'} ({CALL_COSTS.kept})"
    return {q: known[q] for q in queries if q in known}, source


def drafter_key(fingerprint: str, offsets: Offsets, sampling: SamplingConfig) -> str:
    """What acceptance depends on: the model, the drafter's offsets and the predictor's sampling."""
    digest = hashlib.sha256(offsets.vectors.float().numpy().tobytes()).hexdigest()[:12]
    return f"{fingerprint}/{digest}/t{sampling.temperature}k{sampling.top_k}p{sampling.top_p}s{int(sampling.do_sample)}"


@dataclass
class OnlineSpeculation:
    """The tree size chosen online for one model and drafter (see the module's docstring): which
    Speculation (or None, the plain loop) each frame runs, learning from every frame it sees."""

    offsets: Offsets
    fingerprint: str
    start_budget: int = 0
    budgets: tuple[int, ...] = BUDGETS
    rows: int = 1  # frames in every call (a batch's lines): call costs are measured at rows x (N + 1)
    counts: AcceptanceCounts | None = None
    costs: dict[int, float] = field(default_factory=dict)
    costs_source: str = ""
    budget: int = -1  # the budget running now; -1 until the first frame
    codes_per_frame: int = 15
    frames_seen: int = 0
    steps: int = 0  # calls of frame_speculation: frames, or a batch's frame steps of `rows` frames each
    frames_by_budget: dict[int, int] = field(default_factory=dict)
    ms_by_budget: dict[int, float] = field(default_factory=dict)
    learn_costs: bool = True  # learn call costs from the frames timed (False: `costs` stay as given)
    in_frames: dict[int, list[float]] = field(default_factory=dict)  # q -> [ms, calls, frames] in this run's frames
    probes: int = 0
    far: bool = False  # the best tree far from paying at the last choice (probes thinned to FAR_PROBE_EVERY)
    decisions: list[dict] = field(default_factory=list)
    fixed: str | None = None  # why the tree size is not chosen online here (None: it is)
    _trees: dict[int, Speculation] = field(default_factory=dict, repr=False)
    _probe: Speculation | None = field(default=None, repr=False)
    _batches: dict[int, "OnlineSpeculation"] = field(default_factory=dict, repr=False)
    _learned_key: str = ""

    def __post_init__(self) -> None:
        if self.start_budget > 0:  # a recorded best size is a candidate too
            self.budgets = tuple(sorted({*self.budgets, self.start_budget}))

    @property
    def depth(self) -> int:
        return self.offsets.depth

    @property
    def max_nodes(self) -> int:
        """The largest tree a frame may run (the runner's KV cache must hold it)."""
        return max(max(self.budgets), self.depth)

    def start(self, runner: PredictorRunner, sampling: SamplingConfig | RowSampling) -> None:
        """Ready for a run: measured call costs, and the counts this model's last run left (or the prior).
        Where a round's queries are not known to get the plain steps' bits (`PredictorRunner.rounds_exact`: the maps
        measured row-invariant, rvqtts.engine.model.kernels, and the attention), a tree round's rows may differ from
        plain steps in the last bit, so a choice that changes with timings could change a run's codes from one run to
        the next: there the start budget stays, and nothing is decided."""
        self.codes_per_frame = runner.code_groups - 1
        if self.budget < 0 and not runner.rounds_exact:
            self.fixed = (
                "this device's calls are not all measured row-invariant: the tree size stays "
                "where it started, so that runs repeat"
            )
        if not self.costs and not self.fixed:  # trees dearer than depth + 1 steps are not weighed: none can pay
            self.costs, self.costs_source = call_costs(
                runner, [1, self.depth + 1] + [n + 1 for n in self.budgets], self.rows, bound=self.depth + 1
            )
        if isinstance(sampling, RowSampling):  # rows sampled differently: counted under the first's settings
            sampling = sampling.configs[0]
        key = drafter_key(self.fingerprint, self.offsets, sampling)
        if self.counts is None or key != self._learned_key:
            self._learned_key = key
            self.counts = prior_counts(self.depth) if self.fixed else learned_counts(key, self.depth)
        if self.budget < 0:
            self.budget = self.start_budget
        if self.steps == 0 and self.budget == 0 and not self.fixed and self.observed() >= FAR_ROOTS:
            self.decide()  # counted acceptance (an earlier run's): the first frame runs what it chooses

    def for_rows(self, rows: int) -> "OnlineSpeculation":
        """The choice for batches of `rows` lines: the same model, drafter and candidate sizes, its call costs
        measured at rows x (N + 1), starting from the plain loop (a batch's rows go to lines unless trees
        are measured to pay on top of them); kept from one batch to the next."""
        if rows not in self._batches:
            self._batches[rows] = OnlineSpeculation(self.offsets, self.fingerprint, budgets=self.budgets, rows=rows)
        return self._batches[rows]

    def speculation(self, budget: int) -> Speculation:
        """The tree of `budget` nodes grown from the current counts (kept until the next choice)."""
        if budget not in self._trees:
            tree = grow_tree(self.counts.table(), budget, source=f"grown online from {self.observed()} roots")
            self._trees[budget] = Speculation(tree, self.offsets)
        return self._trees[budget]

    def frame_speculation(self) -> tuple[Speculation | None, bool]:
        """What the next frame (or a batch's next frame step) runs, and whether it is a probe (a draft chain
        run in place of the plain loop, to keep measuring acceptance)."""
        step, self.steps = self.steps, self.steps + 1
        if self.budget > 0:
            return self.speculation(self.budget), False
        if self.fixed or step % self.probe_every():
            return None, False
        return self.probe(), True

    def probe(self) -> Speculation:
        """The draft chain a probe frame runs."""
        if self._probe is None:
            self._probe = Speculation(probe_tree(self.depth), self.offsets)
        return self._probe

    def first_trees(self) -> list[Speculation]:
        """The tree the choice starts with, if any, and the probe's chain where probes run."""
        return ([self.speculation(self.budget)] if self.budget > 0 else []) + ([] if self.fixed else [self.probe()])

    def probe_every(self) -> int:
        """Frames between probes: PROBE_EVERY, SETTLED_PROBE_EVERY once SETTLED_ROOTS roots are counted (or in a batch),
        FAR_PROBE_EVERY while the trees are far from paying (`decide`), or more where a probe frame costs more than a
        plain one repays, so that probing adds at most PROBE_SHARE to the plain loop's time."""
        every = PROBE_EVERY if self.observed() < SETTLED_ROOTS and self.rows == 1 else SETTLED_PROBE_EVERY
        if self.far and self.rows == 1:
            every = FAR_PROBE_EVERY
        chain = self.depth + 1
        if self.rows > 1 or chain not in self.costs:
            return every
        per_call = frame_codes_per_call(self.counts.table(), probe_tree(self.depth), self.codes_per_frame)
        extra = self.codes_per_frame * (self.call_ms(chain) / self.call_ms(1) / per_call - 1)  # steps a probe adds
        return max(every, math.ceil(extra / (PROBE_SHARE * self.codes_per_frame)))

    def observe(
        self, codes: list[int], drafted: list[tuple[int, list[list[int]]]], probe: bool, milliseconds: float
    ) -> None:
        """A finished frame: its codes, each round's root index and drafts, and the frame's inner-loop
        time; choose again when due."""
        for index, rows in drafted if not self.fixed else ():  # fixed: the prior's tree, run after run
            self.counts.observe(committed_ranks(rows, codes, index))
        self.frames_seen += 1
        self.probes += probe
        self.frames_by_budget[self.budget] = self.frames_by_budget.get(self.budget, 0) + 1
        self.ms_by_budget[self.budget] = self.ms_by_budget.get(self.budget, 0.0) + milliseconds
        if self.learn_costs and self.rows == 1:  # a batch's frames share calls: no one call size to credit
            q = self.depth + 1 if probe else self.budget + 1
            totals = self.in_frames.setdefault(q, [0.0, 0, 0])
            totals[0] += milliseconds
            totals[1] += 1 + len(drafted) if drafted else self.codes_per_frame  # the prefill, then rounds or steps
            totals[2] += 1
        if self.frames_seen % DECIDE_EVERY == 0 and not self.fixed:
            self.decide()

    def call_ms(self, q: int) -> float:
        """What a call of q rows costs: its mean over this run's frames once LEARN_FRAMES have run it (they price
        what the start-up timing misses: caches the talker's step left cold, the host's load), else its measured
        cost scaled as the nearest q with frames enough was (so measured ratios hold until frames say otherwise)."""
        ran = {p: ms / calls for p, (ms, calls, frames) in self.in_frames.items() if frames >= LEARN_FRAMES}
        if q in ran:
            return ran[q]
        near = min((p for p in ran if p in self.costs), key=lambda p: (abs(p - q), p), default=None)
        return self.costs[q] * ran[near] / self.costs[near] if near else self.costs[q]

    def projection(self) -> dict[int, dict]:
        """Per budget (0: the plain loop): codes per call over a frame under the current counts, the call's
        cost, codes per millisecond and the inner loop's projected time per frame."""
        table = self.counts.table()
        step = self.call_ms(1)
        rows = {0: {"codes_per_call": 1.0, "call_ms": step, "codes_per_ms": 1.0 / step}}
        for n in (n for n in self.budgets if n + 1 in self.costs):  # the timed ones (call_costs' bound)
            codes, call_ms = frame_codes_per_call(table, grow_tree(table, n), self.codes_per_frame), self.call_ms(n + 1)
            rows[n] = {"codes_per_call": round(codes, 4), "call_ms": call_ms, "codes_per_ms": codes / call_ms}
        for row in rows.values():
            row["inner_loop_ms_per_frame"] = self.codes_per_frame / row["codes_per_ms"]
        return rows

    def decide(self) -> None:
        rows = self.projection()
        trees = [row["codes_per_ms"] for n, row in rows.items() if n > 0]
        self.far = self.observed() >= FAR_ROOTS and bool(trees) and max(trees) <= FAR * rows[0]["codes_per_ms"]
        best = max(rows, key=lambda n: rows[n]["codes_per_ms"])
        current = rows.get(self.budget, rows[0])
        if best != self.budget and rows[best]["codes_per_ms"] > SWITCH_MARGIN * current["codes_per_ms"]:
            self.budget = best
            self.decisions.append(
                {
                    "frame": self.frames_seen,
                    "N": best,
                    "projected_speedup": round(rows[best]["codes_per_ms"] / rows[0]["codes_per_ms"], 4),
                }
            )
            self._trees.clear()  # the new size's tree grows from the counts as they are now
        elif self.frames_seen % REGROW_EVERY == 0:
            self._trees.clear()  # now and then, not at every choice: each new tree is a new static call

    def observed(self) -> int:
        return int(self.counts.reached[0]) if self.counts else 0

    def save(self) -> None:
        """Keep what this process's runs learned in the user's cache: the next run starts from it."""
        save_learned()

    def record(self, frames_by_budget: dict[int, int] | None = None) -> dict:
        """What `--stats-json` shows under "online"; `frames_by_budget`: one utterance's own frames by N
        (the choice is shared by the utterances of a run: its other figures are the run's so far)."""
        rows = self.projection() if self.counts and self.costs else {}
        realized = {
            str(n): round(self.ms_by_budget[n] / frames, 3) for n, frames in sorted(self.frames_by_budget.items())
        }
        own = self.frames_by_budget if frames_by_budget is None else frames_by_budget
        return {
            "N": self.budget,
            "fixed": self.fixed,
            "rows": self.rows,
            "frames_by_N": {str(n): f for n, f in sorted(own.items()) if f},
            "inner_loop_ms_per_frame_by_N": realized,
            "probe_frames": self.probes,
            "trees_far_from_paying": self.far,
            "roots_counted": self.observed(),
            "acceptance": [[round(a, 4) for a in row] for row in self.counts.table()] if self.counts else None,
            "call_ms": {str(q): ms for q, ms in sorted(self.costs.items())},
            "call_costs": self.costs_source,
            "call_ms_in_frames": {
                str(q): round(ms / calls, 4) for q, (ms, calls, frames) in sorted(self.in_frames.items())
            },
            "projected": {str(n): {k: round(v, 4) for k, v in row.items()} for n, row in rows.items()},
            "decisions": self.decisions[-20:],
        }


# What the online choices of this process count, by (where they save, model and drafter key): one record per key,
# shared by every choice that counts it (one line's, a batch's, a later run's in this process), kept in memory while
# frames run and saved when a run ends (`save_learned`) and as the process exits, never inside synthesis.
_LEARNING: dict[tuple[Measurements, str], AcceptanceCounts] = {}


def learned_counts(key: str, depth: int) -> AcceptanceCounts:
    """The counts for a model and drafter: this process's, else what the user's cache kept, else the prior."""
    store = ACCEPTANCE.at(cache_dir())
    if (store, key) not in _LEARNING:
        stored = store.read().get(key)
        if isinstance(stored, dict) and "reached" in stored:
            _LEARNING[store, key] = AcceptanceCounts(stored["reached"], stored["hits"])
        else:
            _LEARNING[store, key] = prior_counts(depth)
    return _LEARNING[store, key]


def prior_counts(depth: int) -> AcceptanceCounts:
    """The shipped prior table, weighted as PRIOR_ROUNDS rounds."""
    prior = load_acceptance(SHIPPED_TREES / "prior-acceptance.json")["acceptance"]
    return AcceptanceCounts.from_table(prior, depth, PRIOR_ROUNDS)


def save_learned() -> None:
    """Save the counts of every online choice this process ran, one write per cache folder."""
    learning = list(_LEARNING.items())  # as it is now: an engine thread may start counting another key meanwhile
    for store in {store for (store, _), _ in learning}:
        with store.update() as records:
            records.update({key: counts.record() for (kept, key), counts in learning if kept == store})


@atexit.register
def keep_learned() -> None:
    """`save_learned` where a run ends: as the process exits, as a server shuts down (uvicorn ends a SIGTERM with the
    signal itself, so exit handlers never run there), after a Ray worker's lines. A cache that refuses it is said
    on stderr, not raised."""
    try:
        save_learned()
    except OSError as error:
        print(f"rvqtts: warning: what --tree auto learned was not kept: {error}", file=sys.stderr)
