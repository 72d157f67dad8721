"""What every benchmark shares: timing calls side by side, random models at the real dimensions, trees
shaped like calibrated ones. Timings, not tests: every comparison is measured side by side in one run
(alternatives interleaved repetition by repetition), because the machines they run on are shared and
noisy; report medians and ratios, never one-off times."""

from __future__ import annotations

import time
from typing import Callable

import torch

from rvqtts.engine.model.devices import synchronize
from rvqtts.engine.speculative.tree import SHIPPED_TREES, Tree, grow_tree, load_acceptance

PREDICTOR_DIMS = {"0.6b": 1024, "1.7b": 2048}  # talker width in front of the (same) 1024-wide predictor
KV_LENGTH = 8  # committed slots before a timed call: mid-frame (a frame holds 2 to 17)


def random_code_predictor(
    dims: str, dtype: torch.dtype, device: str, seed: int = 0, layers: int | None = None
) -> torch.nn.Module:
    """qwen-tts's code predictor at the real dimensions `dims` (a key of PREDICTOR_DIMS; the CLI checks it) with
    random weights (cost does not depend on them); `layers` fewer than the released five where only the shapes of
    one layer matter (tests)."""
    from rvqtts.qwen.compat import qwen_tts

    qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerCodePredictorConfig, Qwen3TTSTalkerConfig
    from qwen_tts.core.models.modeling_qwen3_tts import (
        Qwen3TTSTalkerCodePredictorModelForConditionalGeneration as CodePredictor,
    )

    depth = {} if layers is None else {"num_hidden_layers": layers}
    config = Qwen3TTSTalkerCodePredictorConfig(num_code_groups=16, **depth)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = CodePredictor(config, Qwen3TTSTalkerConfig(hidden_size=PREDICTOR_DIMS[dims]))
    return model.to(device=device, dtype=dtype).eval()


def interleaved_ms(
    calls: dict[str, Callable[[], object]],
    device: torch.device,
    warmup: int = 5,
    repeats: int = 30,
    reset: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds of each call, `repeats` times, the calls taking turns so that load on a shared
    machine falls on all of them alike. `reset` runs untimed before every call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(warmup + repeats):
        for name, call in calls.items():
            if reset:
                reset()
            synchronize(device)
            started = time.perf_counter()
            call()
            synchronize(device)
            if repeat >= warmup:
                times[name].append((time.perf_counter() - started) * 1e3)
    return times


def timing_tree(nodes: int) -> Tree:
    """A tree of `nodes` nodes shaped like a calibrated one (grown from the shipped prior table)."""
    prior = load_acceptance(SHIPPED_TREES / "prior-acceptance.json")["acceptance"]
    return grow_tree(prior, nodes)


def talker_width(code_predictor: torch.nn.Module) -> int:
    """Width of what the talker hands the predictor (its embeddings), before any projection to 1024."""
    return getattr(
        code_predictor.small_to_mtp_projection, "in_features", code_predictor.model.codec_embedding[0].weight.shape[1]
    )


def quantile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
