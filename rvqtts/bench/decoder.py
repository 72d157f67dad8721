"""`rvqtts bench decoder`: the speech decoder's cost per frame as an utterance grows, qwen-tts's `decode()`
beside rvqtts's (rvqtts.engine.model.speech_decoder) offline and streamed; and several streams' pieces decoded one by
one beside together (a server's rows)."""

from __future__ import annotations

import statistics
from functools import partial

import torch
from rich.console import Group
from rich.table import Table

from rvqtts.bench.harness import interleaved_ms
from rvqtts.engine.model.speech_decoder import StreamingDecoder, push_together
from rvqtts.support.report import figures_table


def bench_decoder(
    tts: object, lengths: list[int], repeats: int = 3, seed: int = 0, stream_frames: int = 4, streams: int = 8
) -> dict:
    """What the speech decoder costs per frame as an utterance grows, on random codes of each length (its cost
    does not depend on the codes), every length and way interleaved: qwen-tts's `decode()` (past 300 frames in
    chunks of 300 with 25 frames of left context), rvqtts's offline decode (pieces of PIECE_FRAMES) and its
    streaming decoder pushed `stream_frames` frames at a time. Then `streams` streams' pieces of one frame (a first
    piece) and of `stream_frames`, pushed one by one and together (`push_together`), interleaved."""
    tokenizer = tts.model.speech_tokenizer
    decoder = tokenizer.model.decoder
    device = next(tokenizer.model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    groups = tts.model.config.talker_config.num_code_groups
    vocab = tts.model.config.talker_config.code_predictor_config.vocab_size
    codes = {n: torch.randint(0, vocab, (n, groups), generator=generator).to(device) for n in lengths}
    ways = {
        "stock": lambda n: partial(tokenizer.decode, [{"audio_codes": codes[n]}]),
        "rvqtts": lambda n: partial(StreamingDecoder(decoder).decode, codes[n]),
        "streamed": lambda n: partial(StreamingDecoder(decoder).decode, codes[n], stream_frames),
    }
    with torch.inference_mode():
        times = interleaved_ms(
            {f"{way}/{n}": call(n) for n in lengths for way, call in ways.items()}, device, warmup=1, repeats=repeats
        )
        piece_frames = sorted({1, stream_frames})
        passes = {}
        for n in piece_frames:
            pieces = torch.randint(0, vocab, (streams, n, groups), generator=generator).to(device)
            alone, together = ([StreamingDecoder(decoder) for _ in range(streams)] for _ in range(2))
            passes[f"one by one/{n}"] = partial(_one_by_one, alone, pieces)
            passes[f"together/{n}"] = partial(push_together, together, pieces)
        pass_times = interleaved_ms(passes, device, warmup=1, repeats=repeats)
    rows = []
    for n in lengths:
        row: dict = {"frames": n}
        for way in ways:
            ms = statistics.median(times[f"{way}/{n}"])
            row[f"{way}_ms"], row[f"{way}_ms_per_frame"] = round(ms, 1), round(ms / n, 2)
        row["ratio"] = round(row["rvqtts_ms"] / row["stock_ms"], 3)
        rows.append(row)
    together_rows = []
    for n in piece_frames:
        one_by_one, together = (statistics.median(pass_times[f"{way}/{n}"]) for way in ("one by one", "together"))
        together_rows.append(
            {
                "frames": n,
                "one_by_one_ms": round(one_by_one, 1),
                "together_ms": round(together, 1),
                "ratio": round(together / one_by_one, 3),
            }
        )
    return {
        "rows": rows,
        "together": together_rows,
        "streams": streams,
        "repeats": repeats,
        "stream_frames": stream_frames,
        "device": str(device),
        "dtype": str(next(tokenizer.model.parameters()).dtype).removeprefix("torch."),
    }


def _one_by_one(streams: list[StreamingDecoder], codes: torch.Tensor) -> None:
    """Each stream's piece (codes [streams, n, quantizers]) pushed alone, one after another."""
    for stream, piece in zip(streams, codes):
        stream.push(piece)


def decoder_table(result: dict) -> Group:
    """`rvqtts bench decoder`: the speech decoder's cost per frame by utterance length, qwen-tts's and rvqtts's; and
    several streams' pieces one by one and together."""
    together = figures_table(
        f"{result['streams']} streams' pieces, median of {result['repeats']}, ms for all",
        ("frames a piece", "one by one", "together", "together / one by one"),
        ("{frames}", "{one_by_one_ms:.1f}", "{together_ms:.1f}", "{ratio:.3f}"),
        result["together"],
    )
    return Group(_lengths_table(result), together)


def _lengths_table(result: dict) -> Table:
    return figures_table(
        f"speech decoder, {result['device']} {result['dtype']}, median of {result['repeats']}, ms per frame",
        ("frames", "stock", "rvqtts", "rvqtts / stock", f"streamed by {result['stream_frames']}"),
        (
            "{frames}",
            "{stock_ms_per_frame:.2f}",
            "{rvqtts_ms_per_frame:.2f}",
            "{ratio:.3f}",
            "{streamed_ms_per_frame:.2f}",
        ),
        result["rows"],
    )
