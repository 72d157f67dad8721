"""rvqtts.support.memory: the resident memory the stats report, and checkpoint pages dropped once the engine has its
copies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rvqtts.support.memory import drop_file_pages

PAGE = 4096


def resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (Linux's smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5 and ":" not in line.split()[0]:
            inside = line.split()[-1] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_peak_resident_memory_counts_what_a_process_touched_at_once():
    """300 MiB written then freed: the peak grows by it and stays; what is resident now falls back. In a child of
    this (large) test process, so that a peak carried over from the parent's fork would show."""
    script = (
        "from rvqtts.support.memory import memory_record as m\n"
        "before = m()\n"
        "block = bytearray(b'x') * (300 << 20)\n"
        "during = m()\n"
        "del block\n"
        "after = m()\n"
        "print(during['peak_rss_mib'] - before['peak_rss_mib'], after['peak_rss_mib'] - during['peak_rss_mib'],"
        " during['rss_mib'] - after['rss_mib'])\n"
    )
    grown, kept, freed = map(float, subprocess.check_output([sys.executable, "-c", script], text=True).split())
    assert grown >= 290 and kept == pytest.approx(0, abs=1) and freed >= 290  # the counters settle in pages


def test_a_checkpoints_pages_are_dropped_and_read_again_from_the_file(tmp_path):
    """A tensor viewing a memory-mapped file (copy-on-write, as safetensors maps a checkpoint): its pages, all read,
    are resident; dropped, they are not, and the tensor still reads the file's values. A heap tensor is left alone."""
    path = tmp_path / "weights.bin"
    values = np.arange(64 * PAGE, dtype=np.float32)
    values.tofile(path)
    tensor = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))
    assert float(tensor.sum()) == float(values.sum()) and resident_kib(path) >= 60 * PAGE * 4 // 1024
    assert drop_file_pages([tensor]) >= 60 * PAGE * 4
    assert resident_kib(path) < 8 * PAGE * 4 // 1024
    assert torch.equal(tensor, torch.from_numpy(values))
    assert drop_file_pages([torch.from_numpy(values.copy())]) == 0


def test_a_tensor_with_a_page_written_since_keeps_its_pages(tmp_path):
    """A page copied on write holds bytes the file does not: dropping it would lose them, so the tensor is left."""
    path = tmp_path / "weights.bin"
    np.zeros(16 * PAGE, dtype=np.float32).tofile(path)
    tensor = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))
    tensor[5 * PAGE] = 7.0
    float(tensor.sum())  # every page read
    assert drop_file_pages([tensor]) == 0 and float(tensor[5 * PAGE]) == 7.0
    assert drop_file_pages([tensor[8 * PAGE :]]) > 0 and float(tensor.sum()) == 7.0  # the part without it may go


@pytest.mark.parametrize("kernel", ["packed", "linear"])
def test_a_stacked_map_keeps_one_copy_of_its_weights(monkeypatch, kernel):
    """q|k|v stacked into one map: where its kernel reads only its packed copy, no stacked copy is kept (the map
    stacks its parts again when asked) and the modules keep their own tensors; where a call reads the stacked
    weight (F.linear), the modules' parameters become views of it. The map computes the same either way."""
    from rvqtts.engine.model import kernels
    from rvqtts.engine.model.transformer import _stacked

    monkeypatch.setattr(
        kernels, "kernel_choice", lambda *args: kernels.KernelChoice(kernels.Kernel(kernel), True, {}, (), "fixed")
    )
    torch.manual_seed(0)
    parts = [torch.nn.Linear(32, 16, bias=False) for _ in range(3)]
    before = [part.weight.detach().clone() for part in parts]
    storages = [part.weight.untyped_storage().data_ptr() for part in parts]
    linear = _stacked(*parts)
    rows = torch.randn(2, 32)
    assert torch.allclose(linear(rows), rows @ torch.cat(before).T, atol=1e-5)
    assert torch.equal(linear.weight, torch.cat(before))
    assert all(torch.equal(part.weight, weight) for part, weight in zip(parts, before))
    kept = [part.weight.untyped_storage().data_ptr() for part in parts]
    if kernel == "packed":
        assert linear._weight is None and kept == storages  # the modules' own tensors, no stacked copy
    else:
        assert linear.reads_weight and set(kept) == {linear.weight.untyped_storage().data_ptr()}


def test_the_caches_a_synthesizer_keeps_are_reported_as_they_grow(tiny_dir):
    from rvqtts.support.memory import tensors_mib
    from rvqtts.synthesis.settings import GenerationSettings
    from rvqtts.synthesis.synthesizer import Synthesizer

    synth = Synthesizer.from_checkpoint(tiny_dir)
    names = {"talker_kv", "predictor_kv", "batch_predictor_kv", "cloned_voices", "primed_voices"}
    assert synth.cache_mib() == dict.fromkeys(names, 0.0)  # nothing is kept before the first utterance
    synth.synthesize("Hello there.", settings=GenerationSettings(max_frames=4))
    caches = synth.cache_mib()
    talker, predictor = synth.runners.talker(), synth.runners.inner_parts().runner
    assert caches["talker_kv"] == tensors_mib([talker.k_cache, talker.v_cache]) > 0
    assert caches["predictor_kv"] == tensors_mib([predictor.k_cache, predictor.v_cache]) > 0
    assert caches["batch_predictor_kv"] == caches["cloned_voices"] == caches["primed_voices"] == 0.0
    talker.reserve(talker.max_len + 1)  # a longer utterance grows the talker's cache: the report follows
    assert synth.cache_mib()["talker_kv"] > caches["talker_kv"]


def test_only_a_model_that_clones_keeps_its_speech_encoder(tiny_dir, base_dir):
    from rvqtts.synthesis.synthesizer import Synthesizer

    synth = Synthesizer.from_checkpoint(tiny_dir)  # CustomVoice: synthesis never encodes audio
    assert synth.model.speech_tokenizer.model.encoder is None
    tokenizer = synth.codec.encoding_tokenizer()  # loaded again where audio must be encoded (offsets from recordings)
    assert tokenizer.model.encoder is not None and synth.codec.encoding_tokenizer() is tokenizer
    noise = np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1
    codes = tokenizer.encode(noise, sr=24000).audio_codes[0]
    assert codes.shape == (13, 16)  # 12.5 frames a second, rounded up
    cloning = Synthesizer.from_checkpoint(base_dir)
    assert cloning.model.speech_tokenizer.model.encoder is not None
    assert cloning.codec.encoding_tokenizer() is cloning.model.speech_tokenizer
