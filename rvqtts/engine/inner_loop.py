"""The inner loop of a frame: c1..c_{G-1} from the talker's hidden state and c0, by whichever engine the
run chose (the plain loop, the speculative tree, or a Core ML package), with noise keyed by (seed,
utterance, frame, position) and the counts users see."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rvqtts.engine.decode import (
    DEFAULT_DEPTH,
    EAGER,
    DecodeStats,
    Speculation,
    decode_frame_plain,
    decode_frame_speculative,
)
from rvqtts.engine.devices import synchronize
from rvqtts.engine.fused import FusedDecoder
from rvqtts.engine.graphs import StaticCalls
from rvqtts.engine.online import OnlineSpeculation
from rvqtts.engine.predictor import PredictorRunner
from rvqtts.engine.sampling import SamplingConfig, residual_noise


@dataclass(frozen=True)
class LoopParts:
    """What an inner loop runs on: the runner (KV cache, fused weights), the offsets on its device, and
    the static calls (CUDA graphs capture these very tensors); or, for Core ML, a fused decoder over a
    package's calls and no runner. Reusable from one utterance to the next, since every frame writes the
    KV slots it reads, as long as the speculation stays the same."""

    speculation: Speculation | OnlineSpeculation | None
    cuda_graphs: bool
    runner: PredictorRunner | None
    offsets: torch.Tensor | None
    calls: StaticCalls
    fused: FusedDecoder | None = None
    weights: str = "native"

    @classmethod
    def build(
        cls,
        code_predictor: torch.nn.Module,
        speculation: Speculation | OnlineSpeculation | None,
        cuda_graphs: bool,
        weights: str = "native",
    ) -> "LoopParts":
        extra = (
            speculation.max_nodes
            if isinstance(speculation, OnlineSpeculation)
            else speculation.tree.nodes
            if speculation
            else -1
        ) + 1
        runner = PredictorRunner(code_predictor, code_predictor.config.num_code_groups + extra, weights)
        offsets = speculation.offsets.vectors.to(runner.device, runner.dtype) if speculation else None
        return cls(
            speculation,
            cuda_graphs,
            runner,
            offsets,
            StaticCalls.for_device(runner.device, cuda_graphs),
            weights=weights,
        )

    @classmethod
    def package(cls, decoder: FusedDecoder, speculation: Speculation | None) -> "LoopParts":
        """Parts whose frames run fused calls (a Core ML package's): speculative with a speculation,
        else the plain q = 1 step."""
        return cls(speculation, False, None, None, EAGER, decoder)


class InnerLoop:
    """Produces c1..c_{G-1} for each frame the frame loop asks for, and counts what it did."""

    def __init__(
        self,
        code_predictor: torch.nn.Module,
        speculation: Speculation | OnlineSpeculation | None,
        seed: int,
        on_frame: Callable[[torch.Tensor, list[int]], None] | None = None,
        cuda_graphs: bool = True,
        parts: LoopParts | None = None,
    ):
        self.speculation = speculation
        self.on_frame = on_frame
        self.seed = seed
        parts = parts or LoopParts.build(code_predictor, speculation, cuda_graphs)
        self.runner, self.offsets, self.calls, self.fused = parts.runner, parts.offsets, parts.calls, parts.fused
        self.code_groups = code_predictor.config.num_code_groups
        self.vocab_size = code_predictor.config.vocab_size
        self.device = self.fused.device if self.fused else self.runner.device
        # One entry per draft depth K, also when nothing is accepted (or nothing is drafted: --no-spec).
        self.stats = DecodeStats(accepted_per_depth=[0] * (speculation.offsets.depth if speculation else DEFAULT_DEPTH))

    def decode(self, prefix: torch.Tensor, sampling: SamplingConfig, utterance: int, frame: int) -> list[int]:
        """The codes c1..c_{G-1} of one frame; `prefix` is [h_t, embedding of c0], shape [2, E]."""
        noise = residual_noise(self.seed, utterance, frame, self.code_groups, self.vocab_size).to(self.device)
        if self.fused is not None:
            if sampling != self.fused.sampling:
                raise ValueError(
                    f"the Core ML package samples with {self.fused.sampling}, but this frame asks "
                    f"for {sampling}: export a package for these settings"
                )
            decode = self.fused.decode if self.speculation else self.fused.decode_plain
            codes = decode(prefix, noise, self.stats)
        elif isinstance(self.speculation, OnlineSpeculation):
            codes = self.decode_online(prefix, noise, sampling)
        elif self.speculation is None:
            codes = decode_frame_plain(self.runner, prefix, noise, sampling, self.stats, self.calls)
        else:
            codes = decode_frame_speculative(
                self.runner, prefix, noise, sampling, self.speculation, self.offsets, self.stats, self.calls
            )
        if self.on_frame:
            self.on_frame(prefix, codes)
        return codes

    def decode_online(self, prefix: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig) -> list[int]:
        """A frame with the tree size the online choice (rvqtts.engine.online) makes now; it learns from the frame."""
        online = self.speculation
        online.start(self.runner, sampling)
        speculation, probe = online.frame_speculation()
        drafted: list = []
        started = time.perf_counter()
        if speculation is None:
            codes = decode_frame_plain(self.runner, prefix, noise, sampling, self.stats, self.calls)
        else:
            codes = decode_frame_speculative(
                self.runner, prefix, noise, sampling, speculation, self.offsets, self.stats, self.calls, drafted
            )
        synchronize(self.device)
        online.observe(codes, drafted, probe, (time.perf_counter() - started) * 1e3)
        return codes


class ForcedLoop(InnerLoop):
    """An inner loop that returns recorded codes instead of sampling them (teacher forcing)."""

    def __init__(
        self, code_predictor: torch.nn.Module, codes: np.ndarray, on_frame: Callable[[torch.Tensor, list[int]], None]
    ):
        super().__init__(code_predictor, None, 0, on_frame=on_frame)
        self.codes = codes

    def decode(self, prefix: torch.Tensor, sampling: SamplingConfig, utterance: int, frame: int) -> list[int]:
        codes = [int(c) for c in self.codes[frame, 1:]]
        self.on_frame(prefix, codes)
        return codes
