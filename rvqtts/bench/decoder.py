"""`rvqtts bench decoder`: the speech decoder's cost per frame as an utterance grows."""

from __future__ import annotations

import statistics
from functools import partial

import torch

from rvqtts.bench.harness import interleaved_ms


def bench_decoder(tts: object, lengths: list[int], repeats: int = 3, seed: int = 0) -> dict:
    """What the speech decoder costs per frame as an utterance grows: qwen-tts's `decode()` on random
    codes of each length (its cost does not depend on the codes), the lengths interleaved. Past 300
    frames qwen-tts decodes in chunks of 300 with 25 frames of left context."""
    tokenizer = tts.model.speech_tokenizer
    device = next(tokenizer.model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    groups = tts.model.config.talker_config.num_code_groups
    vocab = tts.model.config.talker_config.code_predictor_config.vocab_size
    items = {
        n: [{"audio_codes": torch.randint(0, vocab, (n, groups), generator=generator).to(device)}] for n in lengths
    }
    with torch.inference_mode():
        times = interleaved_ms(
            {f"f{n}": partial(tokenizer.decode, items[n]) for n in lengths}, device, warmup=1, repeats=repeats
        )
    rows = [
        {
            "frames": n,
            "ms": round(statistics.median(times[f"f{n}"]), 1),
            "ms_per_frame": round(statistics.median(times[f"f{n}"]) / n, 2),
        }
        for n in lengths
    ]
    return {
        "rows": rows,
        "repeats": repeats,
        "device": str(device),
        "dtype": str(next(tokenizer.model.parameters()).dtype).removeprefix("torch."),
    }
