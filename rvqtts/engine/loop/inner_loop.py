"""The inner loop of a frame: c1..c_{G-1} from the talker's hidden state and c0, plain or by the speculative tree,
with noise keyed by (seed, utterance, frame, position) and the counts users see (docs/engine.md, "One frame")."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rvqtts.engine.backends.fused import FusedLoop
from rvqtts.engine.model.devices import synchronize
from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import RowSampling, SamplingConfig, residual_noise
from rvqtts.engine.speculative.rounds import FrameRounds, plain_frames, speculative_frames
from rvqtts.engine.speculative.speculation import DEFAULT_DEPTH, EAGER, LoopStats, Speculation, TreePolicy


@dataclass(frozen=True)
class LoopParts:
    """What an inner loop runs on: the runner (KV cache, fused weights), the offsets on its device, and
    the static calls (CUDA graphs capture these very tensors); or, for Core ML, a fused loop over a
    package's calls and no runner. Reusable from one utterance to the next, since every frame writes the
    KV slots it reads, as long as the speculation stays the same."""

    speculation: TreePolicy | None
    runner: PredictorRunner | None
    offsets: torch.Tensor | None
    calls: StaticCalls
    fused: FusedLoop | None = None

    @classmethod
    def build(
        cls,
        code_predictor: torch.nn.Module,
        speculation: TreePolicy | None,
        cuda_graphs: bool,
        weights: str = "native",
    ) -> "LoopParts":
        extra = (speculation.max_nodes if speculation else -1) + 1
        runner = PredictorRunner(code_predictor, code_predictor.config.num_code_groups + extra, weights)
        return cls.of(runner, speculation, StaticCalls.for_device(runner.device, cuda_graphs))

    @classmethod
    def of(
        cls,
        runner: PredictorRunner,
        speculation: TreePolicy | None,
        calls: StaticCalls = EAGER,
    ) -> "LoopParts":
        """Parts over `runner` (its rows room enough for the speculation's rounds), the offsets on its device."""
        offsets = speculation.offsets.vectors.to(runner.device, runner.dtype) if speculation else None
        return cls(speculation, runner, offsets, calls)

    @classmethod
    def package(cls, loop: FusedLoop, speculation: Speculation | None) -> "LoopParts":
        """Parts whose frames run fused calls (a Core ML package's): speculative with a speculation,
        else the plain q = 1 step."""
        return cls(speculation, None, None, EAGER, loop)


class InnerLoop:
    """Produces c1..c_{G-1} for each frame asked for, one frame at a time on the PyTorch runner, and counts what it
    did (the frame loop runs batches and Core ML packages)."""

    def __init__(
        self, code_predictor: torch.nn.Module, speculation: TreePolicy | None, seed: int, parts: LoopParts | None = None
    ):
        self.speculation, self.seed = speculation, seed
        parts = parts or LoopParts.build(code_predictor, speculation, True)
        self.runner, self.offsets, self.calls = parts.runner, parts.offsets, parts.calls
        # One entry per draft depth K, also when nothing is accepted (or nothing is drafted: --no-spec).
        self.stats = LoopStats(accepted_per_depth=[0] * (speculation.offsets.depth if speculation else DEFAULT_DEPTH))

    def frame(self, prefix: torch.Tensor, sampling: SamplingConfig, utterance: int, frame: int) -> list[int]:
        """The codes c1..c_{G-1} of one frame; `prefix` is [h_t, embedding of c0], shape [2, E]."""
        runner = self.runner
        noise = residual_noise(self.seed, utterance, frame, runner.code_groups, runner.vocab_size).to(runner.device)
        (done,) = inner_frames(runner, prefix[None], noise[None], sampling, self.speculation, self.offsets, self.calls)
        count_frame(self.stats, done)
        return done.codes


def inner_frames(
    runner: PredictorRunner,
    prefixes: torch.Tensor,  # [n, 2, E]: each frame's [h_t, embedding of c0]
    noise: torch.Tensor,  # [n, G-1, V]
    sampling: SamplingConfig | RowSampling,
    speculation: TreePolicy | None,
    offsets: torch.Tensor | None,  # [K, H]
    calls: StaticCalls = EAGER,
) -> list[FrameRounds]:
    """c1..c_{G-1} of n frames in shared calls: plain, by a fixed tree, or by the tree size the online choice
    (rvqtts.engine.speculative.online) makes now, which learns from these frames (its probe, a draft chain that keeps
    acceptance counted, runs on the first frame while the others step plain)."""
    policy, probe = speculation, False
    if policy is not None:
        policy.start(runner, sampling)
        speculation, probe = policy.frame_speculation()
    started = time.perf_counter()
    if speculation is None:
        last = runner.code_groups - 1
        rests = plain_frames(runner, prefixes, noise, sampling, calls)
        # its share of the steps, timed where they run eagerly as a round's parts are (rounds.Laps)
        plain = {"plain": (time.perf_counter() - started) / len(rests)} if calls.mode == "eager" else {}
        frames = [
            FrameRounds(r, last, None, None, codes=rest, calls=len(rest), parts=plain) for r, rest in enumerate(rests)
        ]
    else:
        trees = [speculation] + [None if probe else speculation] * (prefixes.shape[0] - 1)
        frames = speculative_frames(runner, prefixes, noise, sampling, trees, offsets, calls)
    synchronize(runner.device)
    if policy is not None:
        share, budget = (time.perf_counter() - started) * 1e3 / len(frames), policy.budget
        for frame in frames:  # the size they ran at (a choice made while observing them applies from the next)
            frame.budget = budget
            policy.observe(frame.codes, frame.drafted, probe and bool(frame.drafted), share)
    return frames


def count_frame(stats: LoopStats, frame: FrameRounds) -> None:
    """A frame's calls, codes, accepted depths and its calls' seconds by part, into `stats`."""
    for accepted in frame.accepted:
        stats.count_accepted(accepted)
    stats.count_frame(frame.calls, len(frame.codes))
    stats.count_parts(frame.parts)
