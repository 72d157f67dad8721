"""`rvqtts bench predictor`: what one predictor call costs per query length (a plain step, a tree round),
against its read and compute floors and qwen-tts's own step, and one whole frame's inner loop."""

from __future__ import annotations

import statistics
from functools import partial
from typing import Callable

import torch
from rich.table import Table

from rvqtts.bench.floor import (
    megabytes,
    multiply_adds,
    peak_multiply_adds_per_ms,
    predictor_weights,
    read_pass,
    round_heads,
)
from rvqtts.bench.harness import KV_LENGTH, interleaved_ms, quantile, talker_width, timing_tree
from rvqtts.engine.model.graphs import StaticCalls
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.online import rows_call
from rvqtts.engine.speculative.rounds import plain_frames
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.support.report import figures_table


def _stock_step(code_predictor: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """qwen-tts's own forward for one code at KV length KV_LENGTH (its HF cache, its LM head), and a
    reset that crops the cache back after each call."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        code_predictor(
            inputs_embeds=torch.randn(1, KV_LENGTH, talker_width(code_predictor), device=device, dtype=dtype),
            past_key_values=cache,
            use_cache=True,
        )
    code = torch.tensor([[5]], device=device)

    def step() -> None:
        with torch.inference_mode():
            code_predictor(input_ids=code, past_key_values=cache, use_cache=True, generation_steps=KV_LENGTH - 1)

    return step, lambda: cache.crop(KV_LENGTH)


def _frame_loops(
    code_predictor: torch.nn.Module, device: torch.device, dtype: torch.dtype, weight_format: str = "native"
) -> dict:
    """One frame's whole inner loop (15 codes, sampled with qwen-tts's defaults): qwen-tts's HF
    `generate()` as its talker calls it, and rvqtts's plain loop on the same prefix."""
    groups = code_predictor.config.num_code_groups
    prefix = torch.randn(1, 2, talker_width(code_predictor), device=device, dtype=dtype)
    runner = PredictorRunner(code_predictor, groups, weight_format)
    noise = torch.zeros(groups - 1, code_predictor.config.vocab_size, device=device)
    sampling = SamplingConfig()

    def stock() -> None:
        code_predictor.generate(
            inputs_embeds=prefix,
            max_new_tokens=groups - 1,
            do_sample=True,
            top_p=1.0,
            top_k=50,
            temperature=0.9,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )

    static = StaticCalls.for_device(device)
    return {
        "stock_frame": stock,
        "plain_frame": lambda: plain_frames(runner, prefix, noise[None], sampling, static),
    }


def bench_predictor(
    code_predictor: torch.nn.Module,
    queries: list[int],
    warmup: int = 5,
    repeats: int = 30,
    weights: str = "random",
    progress: Callable[[int, int], None] | None = None,
    weight_format: str = "native",
) -> dict:
    """Median and spread of one predictor call per query length q, as the engine makes it (q = 1: a plain
    step and its draw; q > 1: a verify round of a q - 1 node tree: drafts, forward with tree attention row by
    row, LM heads and draws at every slot; CUDA-graph replays on CUDA), and of qwen-tts's own q = 1 forward,
    interleaved in one run; also one whole frame's inner loop, qwen-tts's HF `generate()` against
    rvqtts's plain loop."""
    weight = code_predictor.lm_head[0].weight
    device, dtype = weight.device, weight.dtype
    depth = 3
    runner = PredictorRunner(code_predictor, code_predictor.config.num_code_groups + max(queries), weight_format)
    offsets = torch.zeros(depth, runner.hidden_size, device=device, dtype=dtype)
    hidden = torch.randn(runner.hidden_size, device=device, dtype=dtype)
    noise = torch.zeros(runner.code_groups - 1, runner.vocab_size, device=device)
    sampling = SamplingConfig()
    index = KV_LENGTH - 1  # the call's root is c_index, after KV_LENGTH committed slots
    static = StaticCalls.for_device(device)
    trees = {q: Speculation(timing_tree(q - 1), Offsets(offsets.float().cpu())) for q in queries if q > 1}
    plans = {q: tree.plan(tree.tree.depth, device) for q, tree in trees.items()}

    def call(q: int) -> Callable[[], object]:  # a plain step (q = 1) or a round, as frames make them
        return partial(rows_call, runner, 1, index, trees.get(q), offsets, hidden, noise, sampling, static)

    calls = {f"q{q}": call(q) for q in queries}
    last = runner.code_groups - 1
    weights_read = {
        q: predictor_weights(runner, [index + 1] if q == 1 else round_heads(plans[q], index, last)) for q in queries
    }
    floors = {f"floor{q}": read_pass(tensors) for q, tensors in weights_read.items()}
    stock, reset_stock = _stock_step(code_predictor, device, dtype)
    with torch.inference_mode():
        for done, call in enumerate(calls.values()):  # compile-free warm-up of every shape's kernels
            call()
            if progress:
                progress(done + 1, len(calls))
        # Cropping the stock cache runs before every call (untimed); it is cheap and leaves ours untouched.
        times = interleaved_ms({**calls, **floors, "stock": stock}, device, warmup, repeats, reset=reset_stock)
        frames = interleaved_ms(
            _frame_loops(code_predictor, device, dtype, weight_format), device, 2, max(3, repeats // 4)
        )
    record = _call_figures(queries, times, weights_read, dtype, device)
    return {
        **record,
        "stock_frame_ms": round(statistics.median(frames["stock_frame"]), 3),
        "plain_frame_ms": round(statistics.median(frames["plain_frame"]), 3),
        "kv_length": KV_LENGTH,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "weights": weights,
        "weight_format": weight_format,
    }


def _call_figures(
    queries: list[int], times: dict[str, list[float]], weights_read: dict, dtype: torch.dtype, device: torch.device
) -> dict:
    """Per query length: the median call and its spread, against its floors (the weights it reads, its
    multiply-adds at the device's peak), q = 1 and qwen-tts's own step."""
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["q1"] if "q1" in medians else None
    peak = peak_multiply_adds_per_ms(dtype, device)
    compute = {q: q * multiply_adds(weights_read[q]) / peak for q in queries}  # every row through every weight
    return {
        "q": list(queries),
        "median_ms": [round(medians[f"q{q}"], 3) for q in queries],
        "floor_ms": [round(medians[f"floor{q}"], 4) for q in queries],
        "ratio_to_floor": [round(medians[f"q{q}"] / medians[f"floor{q}"], 4) for q in queries],
        "compute_floor_ms": [round(compute[q], 6) for q in queries],
        "ratio_to_larger_floor": [round(medians[f"q{q}"] / max(medians[f"floor{q}"], compute[q]), 4) for q in queries],
        "peak_gmac_per_s": round(peak / 1e6, 1),
        "weights_mb": [round(megabytes(weights_read[q]), 3) for q in queries],
        "p10_ms": [round(quantile(times[f"q{q}"], 0.1), 3) for q in queries],
        "p90_ms": [round(quantile(times[f"q{q}"], 0.9), 3) for q in queries],
        "ratio_to_q1": [round(medians[f"q{q}"] / base, 4) if base else None for q in queries],
        "ratio_to_stock_q1": [round(medians[f"q{q}"] / medians["stock"], 4) for q in queries],
        "stock_q1_ms": round(medians["stock"], 3),
        "stock_q1_p10_ms": round(quantile(times["stock"], 0.1), 3),
        "stock_q1_p90_ms": round(quantile(times["stock"], 0.9), 3),
    }


def predictor_table(result: dict) -> Table:
    """`rvqtts bench predictor`: one call's median and spread per query length, against q = 1 and stock."""
    cells = {
        "q": "{q}",
        "median ms": "{median_ms:.2f}",
        "p10-p90 ms": "{p10_ms:.2f}-{p90_ms:.2f}",
        "x q=1": "{ratio_to_q1:.3f}",
        "x stock q=1": "{ratio_to_stock_q1:.3f}",
        "weights MB": "{weights_mb:.1f}",
        "read floor ms": "{floor_ms:.2f}",
        "compute floor ms": "{compute_floor_ms:.2f}",
        "x larger floor": "{ratio_to_larger_floor:.3f}",
    }
    lists = [key for key, value in result.items() if isinstance(value, list)]  # one figure per query length
    table = figures_table(
        f"one code-predictor call, {result['device']} {result['dtype']}, KV length "
        f"{result['kv_length']}, {result['threads']} threads",
        tuple(cells),
        tuple(cells.values()),
        [{key: result[key][i] for key in lists} for i in range(len(result["q"]))],
        f"weights: {result['weights']}; {result['repeats']} interleaved repeats; read floor: one pass reading the "
        f"call's weights, timed in the same run; compute floor: q rows through every weight at "
        f"{result['peak_gmac_per_s']:.0f} G multiply-adds/s (a dense square product timed in the same run); one "
        f"frame's inner loop: stock HF generate() {result['stock_frame_ms']:.1f} ms, rvqtts plain "
        f"{result['plain_frame_ms']:.1f} ms",
    )
    stock = f"{result['stock_q1_ms']:.2f}", f"{result['stock_q1_p10_ms']:.2f}-{result['stock_q1_p90_ms']:.2f}"
    table.add_row("stock 1", *stock, "", "1.000", "", "", "", "")
    return table
