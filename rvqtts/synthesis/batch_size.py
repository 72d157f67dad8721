"""`--batch-size auto`: how many utterances a batch speaks together, measured once per machine and model
(`frame_costs`, kept in batch-sizes.json; 1 with RVQTTS_CHOICES=fixed), and bounded by memory (`fitting_rows`).
The rule and its costs: docs/usage.md ("Choices measured on your machine"), docs/benchmarks.md. Rows are
nearly free while the calls read their weights and cost their multiply-adds once compute binds; the decoder's
work does not shrink, and each added row makes every line of the batch wait longer for its first audio."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rvqtts.engine.model.devices import synchronize
from rvqtts.engine.model.kernels import device_key, kernels_used, measured_choices
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.online import predictor_key
from rvqtts.engine.speculative.rounds import plain_frames
from rvqtts.support.measurements import BATCH_SIZES
from rvqtts.synthesis.speech_model import SpeechModel

CANDIDATES = (1, 2, 4, 8)  # more rows: every line waits longer for its first file (docs/benchmarks.md)
WITHIN = 1.10  # the smallest B whose frame costs at most this much more than the cheapest
CONTEXT = 128  # the talker position timed: a prompt and a few seconds of speech
DECODED_FRAMES = 16
MEMORY_SHARE = 0.5  # of the memory available, what a batch's caches may take


def frame_costs(synth: SpeechModel, candidates: tuple[int, ...] = CANDIDATES, repeats: int = 3) -> dict[int, float]:
    """Milliseconds per frame of one line at each batch size: a talker step and a frame's inner loop over B
    rows, divided by B, plus the speech decoder's time per frame; medians of `repeats` after a warm-up."""
    talker, runner = synth.runners.talker(), synth.runners.batch_runner()
    device, generator = talker.device, torch.Generator().manual_seed(0)
    rows = max(candidates)
    talker.reserve(CONTEXT + 1, rows)
    groups, vocab = runner.code_groups, runner.vocab_size
    inputs = torch.randn(rows, talker.hidden_size, generator=generator).to(device, talker.dtype)
    prefixes = torch.randn(rows, 2, synth.talker.config.hidden_size, generator=generator).to(device, runner.dtype)
    noise = torch.zeros(rows, groups - 1, vocab, device=device)
    codes = np.random.default_rng(0).integers(0, vocab, (DECODED_FRAMES, groups))
    times: dict[int, list[float]] = {b: [] for b in candidates}
    decoder: list[float] = []
    with torch.inference_mode():
        for turn in range(repeats + 1):  # the first turn warms up
            for b in candidates:
                synchronize(device)
                started = time.perf_counter()
                talker.step_rows(inputs[:b], [CONTEXT] * b, list(range(b)))
                plain_frames(runner, prefixes[:b], noise[:b], SamplingConfig())
                synchronize(device)
                if turn:
                    times[b].append((time.perf_counter() - started) * 1e3 / b)
            started = time.perf_counter()
            synth.codec.decode(codes)
            if turn:
                decoder.append((time.perf_counter() - started) * 1e3 / DECODED_FRAMES)
    synth.runners.release_rows()  # the measured rows' caches are not kept
    per_frame = statistics.median(decoder)
    return {b: round(statistics.median(values) + per_frame, 3) for b, values in times.items()}


def batch_key(synth: SpeechModel) -> tuple[str, str]:
    """What a batch size holds for: the machine (CPU model, torch, threads; or the device), and the model's
    loops as their costs depend on them (talker width and depth, the predictor's key)."""
    talker, runner = synth.runners.talker(), synth.runners.batch_runner()
    machine = device_key(talker.device)
    native = f"/native-{talker.native_mode}" if talker.native_mode else ""
    return machine, f"talker {talker.hidden_size}x{len(talker.layers)}{native} | predictor {predictor_key(runner)}"


def choose_batch_size(synth: SpeechModel, lines: int, progress: Callable[[str], None] | None = None) -> tuple[int, str]:
    """The batch size for `lines` lines on this machine and model, and where it came from."""
    if lines <= 1:
        return 1, "one line to make"
    if synth.runners.inner_parts().runner is None:
        return 1, "the inner loop runs on a Core ML package (one line at a time)"
    if not measured_choices():
        return 1, "RVQTTS_CHOICES=fixed (no measurement)"
    if not rows_invariant(synth):
        return 1, (
            "the linear maps here were not all measured to keep rows invariant: one line at a time keeps each "
            "line's one-line bits"
        )
    costs, source = measured_frame_costs(synth, progress)
    shown = ", ".join(f"{b}: {ms:.1f}" for b, ms in sorted(costs.items()))
    return min(best_batch_size(costs), lines), f"ms per frame of a line at each batch size {shown} ({source})"


def best_batch_size(costs: dict[int, float]) -> int:
    """The smallest batch size whose frame costs at most WITHIN the cheapest."""
    best = min(costs.values())
    return min(b for b, ms in costs.items() if ms <= WITHIN * best)


def measured_frame_costs(
    synth: SpeechModel, progress: Callable[[str], None] | None = None
) -> tuple[dict[int, float], str]:
    """`frame_costs` on this machine and model, from batch-sizes.json where measured before, else measured now and
    kept there; and where they came from."""
    machine, key = batch_key(synth)
    stored = BATCH_SIZES.read().get(machine, {}).get(key)
    if stored:
        return {int(b): float(ms) for b, ms in stored.items()}, f"measured before, {BATCH_SIZES.kept}"
    if progress:
        progress("measuring batch sizes on this machine (once)")
    costs = frame_costs(synth)
    with BATCH_SIZES.update() as records:
        records.setdefault(machine, {})[key] = {str(b): ms for b, ms in sorted(costs.items())}
    return costs, f"measured now, {BATCH_SIZES.kept}"


def rows_invariant(synth: SpeechModel) -> bool:
    """Whether every linear map of both loops was measured to give each row the bits it gets alone (so a
    batched line's codes are its one-line run's)."""
    talker, runner = synth.runners.talker(), synth.runners.batch_runner()
    return all(
        kernels_used(maps)["row_invariant"] for maps in (talker.layer_maps() + [talker.head], runner.linear_maps())
    )


def row_bytes(synth: SpeechModel, slots: int) -> int:
    """Memory one batch row takes: its talker cache region of `slots` positions, and its code predictor
    cache region."""
    talker, runner = synth.runners.talker(), synth.runners.batch_runner()
    per_slot = 2 * len(talker.layers) * talker.n_kv_heads * talker.head_dim * talker.k_cache.element_size()
    predictor = 2 * runner.k_cache[:, :, : runner.max_len].numel() * runner.k_cache.element_size()
    return per_slot * slots + predictor


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on the device (a CPU's MemAvailable), or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def cache_allowance(synth: SpeechModel) -> float | None:
    """The bytes a batch's caches may take: MEMORY_SHARE of the memory available now, and the caches held now,
    which a batch's replace (None where unknown)."""
    talker = synth.runners.talker()
    available = available_bytes(talker.device)
    if available is None:
        return None
    return MEMORY_SHARE * available + talker.k_cache.numel() * 2 * talker.k_cache.element_size()


def fitting_rows(synth: SpeechModel, rows: int, slots: int) -> int:
    """At most `rows` rows whose caches (of `slots` talker positions each) fit in the cache allowance (as many as
    asked where that is unknown; at least one)."""
    allowance = cache_allowance(synth)
    return rows if allowance is None else max(1, min(rows, int(allowance // row_bytes(synth, slots))))


def fitting_slots(synth: SpeechModel, rows: int) -> float:
    """The talker positions each of `rows` rows may hold within the cache allowance (unbounded where unknown)."""
    allowance = cache_allowance(synth)
    if allowance is None:
        return float("inf")
    fixed = row_bytes(synth, 0)
    return int((allowance / rows - fixed) // (row_bytes(synth, 1) - fixed))
