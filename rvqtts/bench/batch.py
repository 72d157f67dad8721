"""`rvqtts bench batch`: throughput of batches (Synthesizer.synthesize_many) at several batch sizes on the
same lines, beside stock qwen-tts's own batched call at the same sizes, taking turns size by size."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from rich.table import Table

from rvqtts.support.report import titled_table
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.synthesis.text import frame_limit


def stock_batches(
    synth: Synthesizer,
    texts: list[str],
    size: int,
    speaker: str | None,
    language: str,
    settings: GenerationSettings,
    seed: int,
) -> dict:
    """qwen-tts's `generate_custom_voice` over consecutive groups of `size` lines (its list-of-texts call):
    wall seconds, audio seconds, and when its first files were done."""
    sampling = synth.sampling(settings)
    torch.manual_seed(seed)
    started, audio, first = time.perf_counter(), 0.0, None
    for start in range(0, len(texts), size):
        group = texts[start : start + size]
        limit = max(frame_limit(text, settings.max_frames, synth.default_max_frames) for text in group)
        wavs, rate = synth.tts.generate_custom_voice(
            text=group,
            speaker=[speaker] * len(group),
            language=[language] * len(group),
            **sampling.generate_kwargs(limit),
        )
        audio += sum(wav.size / rate for wav in wavs)
        first = first or time.perf_counter() - started
    return {"wall_seconds": time.perf_counter() - started, "audio_seconds": audio, "first_file_seconds": first}


def rvqtts_batches(
    synth: Synthesizer,
    texts: list[str],
    size: int,
    speaker: str | None,
    language: str,
    settings: GenerationSettings,
    seed: int,
) -> dict:
    """`synthesize_many` over every line at batch size `size`: wall seconds, audio seconds, when its first
    file was done, and each line's time to first audio."""
    lines = [Line(text=text, speaker=speaker, language=language, utterance=number) for number, text in enumerate(texts)]
    started, audio, first, firsts = time.perf_counter(), 0.0, None, []
    for _, outcome in synth.synthesize_many(lines, seed, settings, chunk_chars=None, batch_size=size):
        if isinstance(outcome, Exception):
            raise outcome
        audio += outcome.audio.size / outcome.sample_rate
        first = first or time.perf_counter() - started
        firsts.append(outcome.seconds.first_audio)
    return {
        "wall_seconds": time.perf_counter() - started,
        "audio_seconds": audio,
        "first_file_seconds": first,
        "line_first_audio_seconds": round(statistics.median(firsts), 3),
    }


def bench_batch(
    synth: Synthesizer,
    texts: list[str],
    sizes: list[int],
    settings: GenerationSettings,
    speaker: str | None = None,
    language: str = "auto",
    seed: int = 0,
    stock: bool = True,
    repeats: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Per batch size B (and per side: rvqtts, stock qwen-tts): medians over `repeats` turns of wall seconds,
    throughput (audio seconds per wall second) and the first file's seconds; the ratios to rvqtts at
    B = 1 and to stock at the same B. Each text is spoken as one piece; the sides take turns."""
    if stock and synth.kind != "custom_voice":
        raise ValueError("stock qwen-tts's batched call is timed on CustomVoice models: give --no-stock")
    speaker = synth.check_voice(speaker, language)
    sides = {"rvqtts": rvqtts_batches} | ({"stock": stock_batches} if stock else {})
    # one warm-up of each side, so no size pays for first calls (kernel choices, packing, compilation)
    warm = GenerationSettings(max_frames=2)
    for run in sides.values():
        run(synth, texts[:2], 2, speaker, language, warm, seed)
    runs: dict[str, dict[int, list[dict]]] = {side: {size: [] for size in sizes} for side in sides}
    total, done = repeats * len(sizes) * len(sides), 0
    for _ in range(repeats):
        for size in sizes:
            for side, run in sides.items():
                runs[side][size].append(run(synth, texts, size, speaker, language, settings, seed))
                done += 1
                if progress:
                    progress(done, total)
    rows = []
    for size in sizes:
        row = {"batch_size": size}
        for side in sides:  # the turns' medians; the audio the first turn's (the same lines and seed each turn)
            turns = runs[side][size]
            medians = {key: statistics.median(turn[key] for turn in turns) for key in turns[0]}
            audio = turns[0]["audio_seconds"]
            row[side] = {key: round(value, 3) for key, value in medians.items()} | {"audio_seconds": round(audio, 3)}
            row[side]["throughput"] = round(audio / medians["wall_seconds"], 4)
        rows.append(row)
    base = rows[0]["rvqtts"] if sizes[0] == 1 else None
    for row in rows:
        if base:
            row["rvqtts"]["throughput_vs_b1"] = round(row["rvqtts"]["throughput"] / base["throughput"], 3)
            row["rvqtts"]["first_file_vs_b1"] = round(
                row["rvqtts"]["first_file_seconds"] / base["first_file_seconds"], 3
            )
        if stock:
            row["rvqtts"]["throughput_vs_stock"] = round(row["rvqtts"]["throughput"] / row["stock"]["throughput"], 3)
    return {
        "lines": len(texts),
        "max_frames": settings.max_frames,
        "seed": seed,
        "repeats": repeats,
        "rows": rows,
        "engine": synth.engine_record(),
    }


def batch_table(result: dict) -> Table:
    """`rvqtts bench batch`: throughput and first files by batch size, rvqtts against stock qwen-tts."""
    engine = result["engine"]
    stock = "stock" in result["rows"][0]
    table = titled_table(
        f"batches of {result['lines']} lines, {engine['device']} {engine['dtype']} {engine['weights']}"
        f", at most {result['max_frames']} frames each, median of {result['repeats']}",
        (
            "B",
            "rvqtts s",
            "audio s / s",
            "vs B = 1",
            "first file s",
            "vs B = 1",
            *(("stock s", "audio s / s", "rvqtts / stock", "first file s") if stock else ()),
        ),
    )
    for row in result["rows"]:
        ours = row["rvqtts"]
        cells = [
            str(row["batch_size"]),
            f"{ours['wall_seconds']:.2f}",
            f"{ours['throughput']:.3f}",
            f"{ours.get('throughput_vs_b1', float('nan')):.2f}",
            f"{ours['first_file_seconds']:.2f}",
            f"{ours.get('first_file_vs_b1', float('nan')):.2f}",
        ]
        if stock:
            theirs = row["stock"]
            cells += [
                f"{theirs['wall_seconds']:.2f}",
                f"{theirs['throughput']:.3f}",
                f"{ours['throughput_vs_stock']:.2f}",
                f"{theirs['first_file_seconds']:.2f}",
            ]
        table.add_row(*cells)
    table.caption = "B = 1: each line alone (rvqtts synth's one-line path); stock: qwen-tts's list-of-texts call"
    return table
