"""The speech decoder's dtype, chosen apart from the loops' (rvqtts.qwen.decoder_dtype): forced by --decoder-dtype or
--dtype, else measured once per machine on a CPU, the cheaper of float32 and bfloat16 with a tie to float32."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import run_cli

import rvqtts.qwen.decoder_dtype as decoder_dtype
from rvqtts.engine.model.speech_decoder import StreamingDecoder
from rvqtts.qwen.checkpoints import unpin_checkpoint
from rvqtts.qwen.decoder_dtype import pick_decoder_dtype
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.synthesizer import Synthesizer


def priced(monkeypatch, costs: dict[str, float], invariant: dict[str, bool] | None = None) -> list[str]:
    """decoder_frame_ms answering `costs` per dtype, decoder_thread_invariant `invariant` (default: neither dtype);
    the dtypes timed, in order."""
    asked: list[str] = []

    def frame_ms(speech_tokenizer, dtype: str, frames: int = 2) -> float:
        asked.append(dtype)
        return costs[dtype]

    monkeypatch.setattr(decoder_dtype, "decoder_frame_ms", frame_ms)
    monkeypatch.setattr(decoder_dtype, "decoder_thread_invariant", lambda _, dtype: (invariant or {}).get(dtype, False))
    return asked


@pytest.mark.parametrize(
    "forced, dtype, device, choices, expected",
    [
        ("float16", "auto", "cpu", "measured", "float16"),  # --decoder-dtype forces it
        ("auto", "bfloat16", "cpu", "measured", "bfloat16"),  # so does --dtype, for every component
        ("auto", "auto", "cuda", "measured", "float32"),  # off the CPU: the loops' dtype
        ("auto", "auto", "cpu", "fixed", "float32"),  # RVQTTS_CHOICES=fixed: the loops' dtype
    ],
)
def test_a_forced_dtype_or_an_unmeasured_device_measures_nothing(
    tiny_dir, monkeypatch, forced, dtype, device, choices, expected
):
    monkeypatch.setenv("RVQTTS_CHOICES", choices)
    asked = priced(monkeypatch, {})
    loops = dtype if dtype != "auto" else "float32"
    assert pick_decoder_dtype(forced, dtype, loops, device, str(tiny_dir)) == (expected, None)
    assert asked == []


@pytest.mark.parametrize(
    "costs, invariant, expected",
    [
        ({"float32": 33.0, "bfloat16": 1020.0}, {}, "float32"),  # the AVX2-only EPYC's ratio (31x)
        ({"float32": 30.0, "bfloat16": 20.0}, {"float32": True}, "bfloat16"),  # invariance decides ties only
        ({"float32": 30.0, "bfloat16": 29.0}, {}, "float32"),  # within 5 %: float32, the decoder's stored bits
        ({"float32": 29.0, "bfloat16": 30.0}, {"bfloat16": True}, "bfloat16"),  # a tie: thread-invariant samples
    ],
)
def test_auto_on_a_cpu_takes_the_cheaper_dtype_measured_once(tiny_dir, monkeypatch, costs, invariant, expected):
    monkeypatch.setenv("RVQTTS_CHOICES", "measured")
    asked = priced(monkeypatch, costs, invariant)
    lines: list[str] = []
    chosen, reason = pick_decoder_dtype("auto", "auto", "bfloat16", "cpu", str(tiny_dir), lines.append)
    assert chosen == expected and asked == ["float32", "bfloat16"]
    other = "bfloat16" if expected == "float32" else "float32"
    assert f"speech decoder in {expected}" in reason and f"--decoder-dtype {other} overrides" in reason
    assert f"{costs[expected]:.1f} ms in {expected} against {costs[other]:.1f} ms in {other}" in reason
    depends = "do not depend" if invariant.get(expected) else "depend"
    assert f"on this CPU; its samples {depends} on the thread count (measured once" in reason
    assert lines == [f"measuring the speech decoder in {name} on this CPU (once)" for name in ("float32", "bfloat16")]
    again = pick_decoder_dtype("auto", "auto", "bfloat16", "cpu", str(tiny_dir))
    assert again == (chosen, reason) and asked == ["float32", "bfloat16"]  # read from the cache, not measured


def test_a_frame_of_decoding_is_timed_and_probed_across_thread_counts_on_a_copy(tiny, monkeypatch):
    parameter = next(tiny.model.speech_tokenizer.model.decoder.parameters())
    before, threads = parameter.dtype, torch.get_num_threads()
    for name in ("float32", "bfloat16"):
        ms = decoder_dtype.decoder_frame_ms(tiny.model.speech_tokenizer, name, frames=2)
        assert math.isfinite(ms) and ms > 0
        assert decoder_dtype.decoder_thread_invariant(tiny.model.speech_tokenizer, name) in (True, False)
    assert next(tiny.model.speech_tokenizer.model.decoder.parameters()).dtype == before
    assert torch.get_num_threads() == threads
    seen = []  # a decoder whose samples follow the thread count is caught
    original = StreamingDecoder.push

    def by_threads(self, codes):
        seen.append(torch.get_num_threads())
        return original(self, codes) + torch.get_num_threads()

    monkeypatch.setattr(StreamingDecoder, "push", by_threads)
    assert decoder_dtype.decoder_thread_invariant(tiny.model.speech_tokenizer, "float32") is False
    assert len(set(seen)) == 2 and torch.get_num_threads() == threads


def test_the_loops_and_the_decoder_run_in_their_own_dtypes(released_06_dir):
    """The released layout, stored in bfloat16 as the released models are: its decoder in float32 beside loops in
    bfloat16 computes what a float32 load's decoder does, bit for bit."""
    synth = Synthesizer.from_checkpoint(released_06_dir, dtype="bfloat16", decoder_dtype="float32")
    assert synth.code_predictor.lm_head[0].weight.dtype == torch.bfloat16 and synth.codec.dtype == "float32"
    result = synth.synthesize("Hello there.", seed=2, settings=GenerationSettings(max_frames=5))
    assert result.engine["dtype"] == "bfloat16" and result.engine["decoder_dtype"] == "float32"
    assert result.audio.dtype == np.float32 and np.isfinite(result.audio).all() and result.audio.size == 5 * 1920
    float32 = Synthesizer.from_checkpoint(released_06_dir, dtype="float32")
    assert np.array_equal(
        float32.codec.decode(result.codes), synth.codec.decode(result.codes)
    )  # the same decoder's bits
    with pytest.raises(ValueError, match="unknown decoder dtype 'int8'"):
        synth.codec.use_dtype("int8")
    synth.codec.use_dtype("bfloat16")  # loaded again from the checkpoint, as a bfloat16 load has it
    bfloat16 = Synthesizer.from_checkpoint(released_06_dir, dtype="bfloat16")
    assert synth.codec.dtype == "bfloat16"
    assert np.array_equal(bfloat16.codec.decode(result.codes), synth.codec.decode(result.codes))


def test_synth_takes_decoder_dtype_and_says_what_ran(tiny_dir, tmp_path):
    stats = tmp_path / "stats.json"
    common = ("synth", "Hi.", "--model", tiny_dir, "--max-frames", 3)
    result = run_cli(
        *common, "--dtype", "bfloat16", "--decoder-dtype", "float32", "-o", tmp_path / "a.wav", "--stats-json", stats
    )
    assert result.exit_code == 0, result.output
    engine = json.loads(stats.read_text())["utterances"][0]["engine"]
    assert engine["dtype"] == "bfloat16" and engine["decoder_dtype"] == "float32"
    refused = run_cli(*common, "--decoder-dtype", "int8", "-o", tmp_path / "b.wav")
    assert refused.exit_code == 2 and "unknown --decoder-dtype 'int8': choose auto, " in refused.output
    assert not (tmp_path / "b.wav").exists()


def test_a_converted_speech_tokenizer_leaves_its_checkpoint_file_unmapped(tiny_dir):
    """Loaded in bfloat16 from its float32 file, no tensor stays a view of that file (one-element buffers of the
    encoder's codebooks kept the whole file mapped and resident, rvqtts.qwen.checkpoints.unpin_checkpoint): in a fresh
    process (this one's fixtures hold the file), its mappings are gone once the load is done. Linux's maps."""
    import subprocess
    import sys

    script = (
        "import gc\n"
        "import rvqtts.synthesis.synthesizer\n"
        "from rvqtts.qwen.checkpoints import load_speech_tokenizer\n"
        f"tokenizer = load_speech_tokenizer({str(tiny_dir)!r}, dtype='bfloat16')\n"
        "gc.collect()\n"
        "print(sum('speech_tokenizer/model.safetensors' in line for line in open('/proc/self/maps')))\n"
    )
    assert subprocess.check_output([sys.executable, "-c", script], text=True).split()[-1] == "0"


def test_unpinning_copies_small_tensors_and_leaves_weights_as_they_are():
    module = torch.nn.Linear(128, 64)
    flat = torch.zeros(64 * 128 + 1)  # one storage, as a memory-mapped file is: the weight and a flag view it
    module.weight = torch.nn.Parameter(flat[: 64 * 128].view(64, 128))
    module.register_buffer("initialized", flat[-1:])
    unpin_checkpoint(module)
    shared = flat.untyped_storage().data_ptr()
    assert module.weight.untyped_storage().data_ptr() == shared and isinstance(module.weight, torch.nn.Parameter)
    assert module.initialized.untyped_storage().data_ptr() != shared and module.bias.requires_grad
