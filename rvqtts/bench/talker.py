"""`rvqtts bench talker`: one talker step, rvqtts's against qwen-tts's, by context length."""

from __future__ import annotations

import statistics
from functools import partial

import torch
from rich.table import Table

from rvqtts.bench.floor import megabytes, multiply_adds, peak_multiply_adds_per_ms, read_pass, talker_weights
from rvqtts.bench.harness import interleaved_ms
from rvqtts.support.report import figures_table


def bench_talker(
    talker: torch.nn.Module, contexts: list[int], repeats: int = 20, seed: int = 0, weight_format: str = "native"
) -> dict:
    """One talker step at each context length: rvqtts's runner (rvqtts.engine.model.talker) against qwen-tts's talker
    transformer and codec head as its HF loop calls them (a dynamic cache, the attention mask and MRoPE
    positions of generate()), the two taking turns. The stock step's code-predictor call, which qwen-tts
    makes inside the same forward, is not part of it: this is the talker's share of a frame."""

    from rvqtts.engine.model.talker import TalkerRunner

    device, dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
    generator = torch.Generator().manual_seed(seed)
    runner = TalkerRunner(talker, weights=weight_format)
    weights = talker_weights(runner)
    floor = read_pass(weights)
    rows = [_step_times(talker, runner, floor, length, generator, repeats) for length in contexts]
    peak = peak_multiply_adds_per_ms(dtype, device)
    return {
        "rows": rows,
        "repeats": repeats,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "layers": talker.config.num_hidden_layers,
        "hidden_size": talker.config.hidden_size,
        "weights_mb": round(megabytes(weights), 3),
        "weight_format": weight_format,
        "compute_floor_ms": round(multiply_adds(weights) / peak, 6),  # one row through every weight
        "peak_gmac_per_s": round(peak / 1e6, 1),
    }


def talker_table(result: dict) -> Table:
    """`rvqtts bench talker`: one talker step, rvqtts's against qwen-tts's, by context length."""
    return figures_table(
        f"talker step, {result['device']} {result['dtype']}, median of {result['repeats']}",
        ("context", "stock ms", "rvqtts ms", "rvqtts / stock", "floor ms", "rvqtts / floor"),
        ("{context}", "{stock_ms:.2f}", "{rvqtts_ms:.2f}", "{ratio:.3f}", "{floor_ms:.2f}", "{ratio_to_floor:.3f}"),
        result["rows"],
        f"floor: one pass reading the step's {result['weights_mb']:.0f} MB of weights, timed in the same run; its one "
        f"row's multiply-adds at this device's peak (a timed dense product): {result['compute_floor_ms']:.2f} ms",
    )


def _step_times(talker: torch.nn.Module, runner, floor, length: int, generator: torch.Generator, repeats: int) -> dict:
    """One context length's step, rvqtts's against qwen-tts's and the weights' read floor, taking turns."""
    from transformers import DynamicCache

    device, dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
    prompt = (0.02 * torch.randn(length, talker.config.hidden_size, generator=generator)).to(device, dtype)
    step = (0.02 * torch.randn(1, talker.config.hidden_size, generator=generator)).to(device, dtype)
    cache = DynamicCache()
    mask = torch.ones(1, length + 1, dtype=torch.long, device=device)
    positions = torch.full((3, 1, 1), length, dtype=torch.long, device=device)
    with torch.inference_mode():
        runner.prefill(prompt)
        talker.model(inputs_embeds=prompt[None], past_key_values=cache, use_cache=True)

        def stock() -> torch.Tensor:
            hidden = talker.model(
                inputs_embeds=step[None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
            return talker.codec_head(hidden)

        times = interleaved_ms(
            {"stock": stock, "rvqtts": partial(runner.step, step, length), "floor": floor},
            device,
            warmup=3,
            repeats=repeats,
            reset=lambda: cache.crop(length),
        )
    stock_ms, ours_ms, floor_ms = (statistics.median(times[name]) for name in ("stock", "rvqtts", "floor"))
    return {
        "context": length,
        "stock_ms": round(stock_ms, 2),
        "rvqtts_ms": round(ours_ms, 2),
        "ratio": round(ours_ms / stock_ms, 3),
        "floor_ms": round(floor_ms, 4),
        "ratio_to_floor": round(ours_ms / floor_ms, 3),
    }
