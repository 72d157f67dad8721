"""The floors of a model call, both measured in the same run as the call: reading the weights it touches, and its
rows' multiply-adds at this device's peak (docs/benchmarks.md, "What the figures mean")."""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch

from rvqtts.bench.harness import interleaved_ms
from rvqtts.engine.model.kernels import LinearMap


def distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors once each (a weight reached twice, or tied, is read once)."""
    seen, kept = set(), []
    for tensor in tensors:
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in seen:
            seen.add(key)
            kept.append(tensor.detach())
    return kept


def megabytes(tensors: list[torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def read_pass(tensors: list[torch.Tensor], one_buffer: bool | None = None) -> Callable[[], None]:
    """A call that reads every byte of `tensors` once: the floor of a call that reads them. On a CPU it reads the
    tensors themselves; off it (`one_buffer`), a copy of their bytes in one buffer, read by one kernel: a GPU reads
    a few hundred tensors one launch each at the launches' pace, not its memory's."""
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]  # the weights are contiguous: views, no copies
    if one_buffer is None:
        one_buffer = bool(flat) and flat[0].device.type != "cpu"
    if one_buffer:
        flat = [torch.cat(flat)]

    def read() -> None:
        for values in flat:
            values.amax()

    return read


def multiply_adds(tensors: list[torch.Tensor]) -> int:
    """Multiply-adds one row costs through these weights: the elements of their matrices (packed ones
    included; vectors such as biases and scales cost none)."""
    return sum(t.numel() for t in tensors if t.dim() >= 2)


def peak_multiply_adds_per_ms(dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    """The compute side of the floor: multiply-adds per millisecond a dense square matrix product of
    `size` reaches on this device (the best of `repeats`, after one warm-up), in `dtype` or, on a CPU, in
    float32 where that is faster: a kernel may widen `dtype` to float32 in registers (rvqtts's AVX2 ones do),
    and torch's bfloat16 product on a CPU without AVX512-BF16 runs far below the FMA units' peak. With the
    read pass it bounds a call from below twice: q rows through W weights cost at least q * W / this."""
    candidates = (dtype, torch.float32) if device.type == "cpu" and dtype != torch.float32 else (dtype,)
    return max(_dense_multiply_adds_per_ms(candidate, device, size, repeats) for candidate in candidates)


def _dense_multiply_adds_per_ms(dtype: torch.dtype, device: torch.device, size: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    with torch.inference_mode():
        times = interleaved_ms({"mm": partial(torch.mm, a, b)}, device, warmup=1, repeats=repeats)
    return size**3 / min(times["mm"])


def module_weights(*modules: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters of `modules`, once each: what qwen-tts's own forward reads of them."""
    return distinct(p for module in modules for p in module.parameters())


def decoder_weights(runner: object) -> list[torch.Tensor]:
    """What every call of a rvqtts.engine.model.transformer.CachedDecoder reads: its layers' maps (as they are held:
    the dtype's own weights, or 8-bit ones and their scales) and norms, and the final norm."""
    norms = [p for layer in runner.layers for name, p in layer.named_parameters() if "norm" in name]
    return [t for linear in runner.layer_maps() for t in linear.reads()] + norms + list(runner.norm.parameters())


def predictor_weights(runner: object, heads: Iterable[int]) -> list[torch.Tensor]:
    """A code-predictor call's weights: the layers, the input projection, and the LM heads of `heads`
    (code indices; a plain step scores one code, a tree round drafts and scores several)."""
    project = runner.project.reads() if isinstance(runner.project, LinearMap) else []  # else the identity
    project += [] if runner.project_bias is None else [runner.project_bias]
    return distinct(decoder_weights(runner) + project + [t for index in heads for t in runner.heads[index - 1].reads()])


def talker_weights(runner: object) -> list[torch.Tensor]:
    """A talker step's weights: the layers and the codec head."""
    return distinct(decoder_weights(runner) + runner.head.reads())


def round_heads(plan: object, index: int, last: int) -> list[int]:
    """The LM heads a verify round rooted at c_index reads: one per drafted depth, one per scored depth."""
    drafted = range(index + 1, index + len(plan.draft_ranks) + 1)
    return [*drafted, *(index + d + 1 for d in range(len(plan.depth_slices)) if index + d < last)]
