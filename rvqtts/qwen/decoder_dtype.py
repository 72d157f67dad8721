"""The speech decoder's dtype, chosen apart from the loops': qwen-tts's decoder (convolutions and a small
transformer) has costs per dtype of its own; on an AVX2-only AMD EPYC one dtype for all made the default 5x slower
than `--dtype float32` (docs/benchmarks.md). `--decoder-dtype` forces it, `--dtype` forces every component; under
`--dtype auto` on a CPU it is measured once per machine and decoder shape, kept in the kernels cache
(docs/usage.md, "Choices measured on your machine")."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import timeit
from pathlib import Path
from typing import Callable

import torch

from rvqtts.engine.model.kernels import cached_records, measured_choices
from rvqtts.engine.model.speech_decoder import StreamingDecoder
from rvqtts.qwen.checkpoints import load_speech_tokenizer, resolve_model
from rvqtts.support.measurements import KERNELS

DECODER_DTYPES = ("float32", "bfloat16")  # what a CPU decoder is measured in
MEASURED_FRAMES = 2  # frames each pass decodes (the whole choice's time: docs/usage.md)
# A dtype within 5 % of the cheaper counts as tied; a tie goes to the one whose samples do not depend on the thread
# count (Ray workers then write a local run's bytes), then to float32 (the decoder's stored bits).
TIE = 1.05
RUNNER = "pieces-1"  # how rvqtts runs the decoder (rvqtts.engine.model.speech_decoder); a new way is measured anew


def decoder_shape_key(model: str) -> str:
    """What a checkpoint's decoder costs depend on: its configuration (not its weights) and how rvqtts runs it
    (RUNNER), hashed."""
    folder = Path(resolve_model(model)) / "speech_tokenizer"
    config = json.loads((folder / "config.json").read_text()).get("decoder_config", {})
    return hashlib.sha256(json.dumps([config, RUNNER], sort_keys=True).encode()).hexdigest()[:16]


def _decoder_and_codes(speech_tokenizer: object, dtype: str, frames: int) -> tuple[Callable, torch.Tensor]:
    """The decode of a copy of qwen-tts's decoder in `dtype` (as rvqtts runs it, rvqtts.engine.model.speech_decoder),
    and fixed codes [frames, quantizers] to decode."""
    decoder = copy.deepcopy(speech_tokenizer.model.decoder).to(getattr(torch, dtype))
    config = speech_tokenizer.model.config.decoder_config
    shape = (frames, config.num_quantizers)  # codes the model's codebook holds
    codes = torch.randint(0, config.codebook_size, shape, generator=torch.Generator().manual_seed(0))
    return lambda part: StreamingDecoder(decoder).decode(part), codes


@torch.inference_mode()
def decoder_frame_ms(speech_tokenizer: object, dtype: str, frames: int = MEASURED_FRAMES) -> float:
    """Milliseconds per frame of qwen-tts's decoder in `dtype` as rvqtts runs it on this CPU (a copy, fixed codes): the
    better of two passes over `frames` frames, after a one-frame warm-up (first-call allocations and kernel
    selection)."""
    decode, codes = _decoder_and_codes(speech_tokenizer, dtype, frames)
    decode(codes[:1])
    return min(timeit.repeat(lambda: decode(codes), repeat=2, number=1)) * 1e3 / frames


@torch.inference_mode()
def decoder_thread_invariant(speech_tokenizer: object, dtype: str, frames: int = MEASURED_FRAMES) -> bool:
    """Whether the decoder in `dtype` makes the same samples on this process's thread count as on another (one
    thread, or two where this process runs one): where it does, a Ray worker writes a local run's bytes whatever
    threads it was given (docs/cluster.md)."""
    decode, codes = _decoder_and_codes(speech_tokenizer, dtype, frames)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (threads, 2 if threads == 1 else 1):
            torch.set_num_threads(count)
            outputs.append(torch.from_numpy(decode(codes)))
    finally:
        torch.set_num_threads(threads)
    return torch.equal(*outputs)


def pick_decoder_dtype(
    decoder_dtype: str,
    dtype: str,
    loops_dtype: str,
    device: str,
    model: str,
    progress: Callable[[str], None] | None = None,
) -> tuple[str, str | None]:
    """The decoder's dtype and, where it was chosen here, why. `decoder_dtype` (--decoder-dtype) forces it;
    else a forced `dtype` (--dtype) holds for the decoder too; else, on a CPU whose choices are measured, the
    cheaper of float32 and bfloat16 for a frame of `model`'s decoder (TIE); elsewhere the loops'."""
    if decoder_dtype != "auto":
        return decoder_dtype, None
    if dtype != "auto" or device.split(":")[0] != "cpu" or not measured_choices():
        return loops_dtype, None
    shape = decoder_shape_key(model)
    tokenizer = functools.cache(lambda: load_speech_tokenizer(model, "cpu", "float32"))  # only if one is measured

    def measure(key: str) -> dict:
        name = key.rpartition("/")[2]
        if progress:
            progress(f"measuring the speech decoder in {name} on this CPU (once)")
        return {
            "ms_per_frame": round(decoder_frame_ms(tokenizer(), name), 3),
            "thread_invariant": decoder_thread_invariant(tokenizer(), name),
        }

    records = cached_records([f"decoder/{shape}/{name}" for name in DECODER_DTYPES], measure)
    found = {name: records[f"decoder/{shape}/{name}"] for name in DECODER_DTYPES}
    costs = {name: record["ms_per_frame"] for name, record in found.items()}
    invariant = {name: record.get("thread_invariant") for name, record in found.items()}
    tied = [name for name in DECODER_DTYPES if costs[name] <= min(costs.values()) * TIE]
    chosen = min(tied, key=lambda name: (invariant[name] is not True, name != "float32"))
    other = "bfloat16" if chosen == "float32" else "float32"
    note = {True: "do not depend", False: "depend"}.get(invariant[chosen])
    threads = f"; its samples {note} on the thread count" if note else ""
    return chosen, (
        f"speech decoder in {chosen}: a frame takes {costs[chosen]:.1f} ms in {chosen} against {costs[other]:.1f} ms "
        f"in {other} on this CPU{threads} (measured once, {KERNELS.kept}); "
        f"--decoder-dtype {other} overrides"
    )
