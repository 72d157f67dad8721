"""Static-shape calls, replayed from CUDA graphs on CUDA devices: one launch instead of the few hundred small kernels
that bound a 1024-wide model's call on a GPU. A call's shapes are fixed by its kind and code index, so each is
captured once, on first use, and replayed with its inputs copied into static buffers (the graph bakes in the
sampling settings, so they are part of the key). A replay overwrites the previous replay's outputs: callers read
them first. Mode "emulated" runs the same buffer discipline without a graph, so CPU tests check the plumbing.
docs/engine.md, "Static shapes and CUDA graphs"."""

from __future__ import annotations

from typing import Callable, Hashable

import torch

MODES = ("eager", "emulated", "cuda")


class StaticCalls:
    """Runs `fn(*inputs)` eagerly, or through static buffers: replaying a CUDA graph captured on first
    use (mode "cuda"), or re-running `fn` on the buffers (mode "emulated", for tests)."""

    def __init__(self, mode: str = "eager"):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.entries: dict[Hashable, tuple[list[torch.Tensor], list[torch.Tensor], object]] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None

    def __call__(
        self, key: Hashable, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        if self.mode == "eager":
            return tuple(fn(*inputs))
        if key not in self.entries:
            self.entries[key] = self._capture(fn, inputs)
        static_inputs, outputs, graph = self.entries[key]
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        if graph is None:
            for buffer, value in zip(outputs, fn(*static_inputs)):
                buffer.copy_(value)
        else:
            graph.replay()
        return tuple(outputs)

    def _capture(self, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        # Calls may write the KV cache, but only the slots they are about to write anyway, with the
        # values of these very inputs: running them here (warm-up) changes nothing the real call reads.
        static_inputs = [value.clone() for value in inputs]
        if self.mode == "emulated":
            return static_inputs, [value.clone() for value in fn(*static_inputs)], None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static_inputs)  # lazy kernel initialisation must not happen during capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = list(fn(*static_inputs))
        return static_inputs, outputs, graph

    @classmethod
    def for_device(cls, device: torch.device, enabled: bool = True) -> "StaticCalls":
        """CUDA graphs on a CUDA device when enabled; plain eager calls everywhere else."""
        return cls("cuda" if graphs_on(device, enabled) else "eager")


def graphs_on(device: torch.device, enabled: bool = True) -> bool:
    """Whether calls on `device` replay CUDA graphs: on a CUDA device, when enabled."""
    return enabled and device.type == "cuda"
