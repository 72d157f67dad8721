"""The runners a loaded model keeps between utterances: the talker's (rvqtts.engine.model.talker), the inner loop's
parts (rvqtts.engine.loop.inner_loop) and a batch's code predictor runner, with the frame loop over them
(rvqtts.engine.loop.frame_loop). Each is made on first use and kept: a KV cache only grows, and fused weights and
captured graphs are reused. What the inner loop runs is fixed when the runners are made (`Synthesizer.using` makes
others)."""

from __future__ import annotations

import torch

from rvqtts.engine.backends.fused import FusedLoop
from rvqtts.engine.loop.frame_loop import FrameLoop
from rvqtts.engine.loop.inner_loop import LoopParts
from rvqtts.engine.model.graphs import StaticCalls, graphs_on
from rvqtts.engine.model.kernels import kernels_used
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.model.talker import CAPACITY_STEP, TalkerRunner
from rvqtts.engine.speculative.rounds import plain_frames, speculative_frames
from rvqtts.engine.speculative.speculation import TreePolicy
from rvqtts.support.memory import tensors_mib

WARM_SLOTS = 1024  # the talker's cache a warm-up makes: a prompt and about a minute of speech after it


class Runners:
    """The runners of one model's `talker` (qwen-tts's module, with its code predictor) in one weight format, for one
    inner loop: `speculation` (None: the plain loop), CUDA graphs on or off (replaying the talker's and the inner
    loop's calls on CUDA devices), or `fused`, a Core ML package's calls (rvqtts.engine.backends.coreml).
    `talker_runner`: one to share (another inner loop over the same talker)."""

    def __init__(
        self,
        talker: torch.nn.Module,
        weights: str = "native",
        speculation: TreePolicy | None = None,
        cuda_graphs: bool = True,
        fused: FusedLoop | None = None,
        talker_runner: TalkerRunner | None = None,
    ):
        self.talker_module = talker
        self.code_predictor = talker.code_predictor
        self.weights = weights  # "int8": both loops run 8-bit weights (rvqtts.engine.model.quantize)
        self.speculation, self.cuda_graphs, self.fused = speculation, cuda_graphs, fused
        self._talker = talker_runner
        self._parts: LoopParts | None = None
        self._batch: PredictorRunner | None = None

    def talker(self) -> TalkerRunner:
        """The talker runner."""
        if self._talker is None:
            calls = StaticCalls.for_device(self.talker_module.codec_head.weight.device, self.cuda_graphs)
            self._talker = TalkerRunner(self.talker_module, calls=calls, weights=self.weights)
        return self._talker

    def inner_parts(self) -> LoopParts:
        """The inner loop's parts: a package's fused calls, or a code predictor runner with room for the tree."""
        if self._parts is None:
            self._parts = (
                LoopParts.package(self.fused, self.speculation)
                if self.fused is not None
                else LoopParts.build(self.code_predictor, self.speculation, self.cuda_graphs, self.weights)
            )
        return self._parts

    def warm_up(self, sampling: SamplingConfig) -> None:
        """Capture ahead the static calls (CUDA graphs) that utterances replay, so that none pays for them: the talker's
        cache made WARM_SLOTS long (a cache that grows starts its captures over) and its step over each span of it,
        and one frame of the inner loop at `sampling` on zeros, plain and by each tree it may start with (the online
        choice started first: its call costs are measured then, once per machine). Nothing else is kept: every cache
        slot these calls write is written again before a call reads it. Nothing runs where the calls are eager (a
        CPU's)."""
        if not graphs_on(self.talker_module.codec_head.weight.device, self.cuda_graphs):
            return  # and no runner is made before a run asks for it
        talker, parts = self.talker(), self.inner_parts()
        with torch.inference_mode():
            talker.reserve(WARM_SLOTS)
            zero = torch.zeros(1, talker.hidden_size, device=talker.device, dtype=talker.dtype)
            for position in range(0, talker.max_len, CAPACITY_STEP):
                talker.step(zero, position)
            runner = parts.runner
            if runner is None:  # a Core ML package's calls
                return
            prefixes = torch.zeros(1, 2, talker.hidden_size, device=runner.device, dtype=runner.dtype)
            noise = torch.zeros(1, runner.code_groups - 1, runner.vocab_size, device=runner.device)
            plain_frames(runner, prefixes, noise, sampling, parts.calls)
            if parts.speculation is not None:
                parts.speculation.start(runner, sampling)
                for tree in parts.speculation.first_trees():
                    speculative_frames(runner, prefixes, noise, sampling, [tree], parts.offsets, parts.calls)

    def batch_runner(self) -> PredictorRunner:
        """The code predictor runner of batches (its cache grows by rows, each row with room for a tree
        round): the inner loop's where it runs eagerly; beside it where CUDA graphs read that one's cache
        tensors."""
        parts = self.inner_parts()
        if parts.calls.mode == "eager":
            return parts.runner
        if self._batch is None or self._batch.max_len != parts.runner.max_len:
            self._batch = PredictorRunner(self.code_predictor, parts.runner.max_len, self.weights)
        return self._batch

    def batch_speculation(self, rows: int) -> TreePolicy | None:
        """What a batch of `rows` lines speculates with: the plain loop or a given tree as for one line; where
        the tree size is chosen online, that choice's own for these rows (`OnlineSpeculation.for_rows`)."""
        return self.speculation and self.speculation.for_rows(rows)

    def frame_loop(self, rows: int = 1) -> FrameLoop:
        """The frame loop over the kept runners: one utterance's (the inner loop's parts and static calls), or `rows`
        at a time (the batch's runner and speculation, eagerly)."""
        parts = self.inner_parts() if rows == 1 else LoopParts.of(self.batch_runner(), self.batch_speculation(rows))
        return FrameLoop(self.talker(), parts, self.talker_module.config.codec_eos_token_id, rows)

    def release_rows(self) -> None:
        """Let a batch's rows go: a later one-line run grows its caches from one row."""
        for runner in (self.talker(), self.batch_runner()):
            runner.allocate(runner.max_len, 1)

    def kernels_record(self) -> dict:
        """The kernels of each loop's linear maps (rvqtts.engine.model.kernels), how much of each runs natively
        (rvqtts.engine.model.native) and how the predictor attends (rvqtts.engine.model.attention), of the runners
        made."""
        kernels = {}
        if self._talker is not None:
            talker = self._talker
            kernels["talker"] = kernels_used(talker.layer_maps() + [talker.head]) | {"native": talker.native_mode}
        if self._parts is not None and self._parts.runner is not None:
            runner = self._parts.runner
            kernels["predictor"] = kernels_used(runner.linear_maps()) | {
                "attention": "rows" if runner.row_attention else "gathered",
                "native": runner.native_mode,
            }
        return kernels

    def caches_mib(self) -> dict[str, float]:
        """MiB held by the runners' KV caches: the talker's, the inner loop's and a batch's code predictor's."""
        inner = self._parts.runner if self._parts is not None else None
        runners = {"talker_kv": self._talker, "predictor_kv": inner, "batch_predictor_kv": self._batch}
        return {
            name: tensors_mib([getattr(runner, "k_cache", None), getattr(runner, "v_cache", None)])
            for name, runner in runners.items()
        }
