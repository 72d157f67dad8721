"""Kernels chosen by measurement (rvqtts.engine.model.kernels) and the dtype picked from them
(rvqtts.engine.model.devices): what each kernel computes, the rule that picks one (only row-invariant kernels, the
fastest), the cache that makes it a one-time cost, `rvqtts tune`, and what a run records."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import decode_frames, linear_maps_are_row_invariant
from helpers import run_cli as run
from helpers import run_cli_json as run_json

import rvqtts.engine.model.devices
import rvqtts.engine.model.kernels as kernels
import rvqtts.engine.model.native
from rvqtts.engine.model.attention import row_attention_exact
from rvqtts.engine.model.kernels import Kernel, LinearMap, kernels_used
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.support.report import _engine_summary
from rvqtts.synthesis.synthesizer import Synthesizer


@pytest.fixture
def unmeasured(monkeypatch):
    """Measured choices, starting from nothing measured in this process (and an empty cache: user_cache)."""
    monkeypatch.setenv("RVQTTS_CHOICES", "measured")
    kernels._chosen.clear()
    yield
    kernels._chosen.clear()


def test_kernel_names_read_back():
    for kernel in (Kernel("linear"), Kernel("packed", 2), Kernel("packed", one_row_mv=True), Kernel("int8", 8)):
        assert Kernel.parse(kernel.name) == kernel
    assert Kernel("packed", 2, True).name == "mv+packed/pad2"


@pytest.mark.parametrize("name", ["linear", "mv+linear", "packed", "mv+packed/pad2", "linear/pad4"])
def test_every_kernel_computes_the_map_with_its_bias_over_any_number_of_rows(name):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(3, 35, 40, generator=generator)  # 35 rows a call: two chunks, the second of 3 rows
    for b in (None, bias):
        linear = LinearMap(weight, b, Kernel.parse(name))
        expected = torch.nn.functional.linear(x, weight, b)
        assert (linear(x) - expected).abs().max() < 1e-4
        assert (linear(x[0, 0]) - expected[0, 0]).abs().max() < 1e-4  # one 1-D row


def test_kernels_that_make_a_call_alike_share_its_timing():
    """A one-row call through torch.mv is the same call for every mv+ kernel, and a 17-row call the same with or
    without mv+ and padding: each is timed once, so kernels that make it alike get the same figure."""
    found = [
        Kernel("linear", one_row_mv=True),
        Kernel("packed", 2, one_row_mv=True),
        Kernel("linear"),
        Kernel("packed"),
    ]
    timings = kernels.time_kernels(torch.randn(64, 32), found)
    assert timings["mv+linear"][1] == timings["mv+packed/pad2"][1]
    assert timings["mv+linear"][17] == timings["linear"][17] and timings["mv+packed/pad2"][17] == timings["packed"][17]


def test_the_fastest_row_invariant_kernel_wins_and_a_faster_variant_one_is_passed_over(unmeasured, monkeypatch):
    costs = {"mv+linear": 3.0, "linear": 1.0, "mv+packed": 2.0, "packed": 1.5}
    invariant = {"mv+linear": 1, "linear": None, "mv+packed": 1, "packed": 2}
    monkeypatch.setattr(kernels, "invariant_pad", lambda weight, kernel: invariant[kernel.name])
    monkeypatch.setattr(
        kernels,
        "time_kernels",
        lambda weight, found, rows=(1, 17): {
            k.name: {count: costs[k.name.split("/pad")[0]] for count in rows} for k in found
        },
    )
    monkeypatch.setattr(kernels, "packing_available", lambda dtype: True)
    choice = kernels.measure_choice((8, 8), torch.float32, "native")
    assert choice.kernel == Kernel("packed", pad=2) and choice.row_invariant is True
    assert set(choice.invariant) == {"mv+linear", "mv+packed", "packed/pad2"}
    # Where no kernel's rows are invariant, the fastest runs and the choice says so.
    monkeypatch.setattr(kernels, "invariant_pad", lambda weight, kernel: None)
    choice = kernels.measure_choice((8, 8), torch.float32, "native")
    assert choice.kernel == Kernel("linear") and choice.row_invariant is False and not choice.invariant


def test_one_row_cost_decides_then_17_rows_and_a_prompt_runs_f_linear_where_that_is_faster(unmeasured, monkeypatch):
    """Steps are one-row calls: the fastest kernel there wins unless another is within STEP_TIE of it and
    cheaper at 17 rows; a prompt's rows go through F.linear where it measured faster at PROMPT_ROWS."""
    costs = {
        "mv+linear": {1: 1.0, 17: 9.0},
        "linear": {1: 2.0, 17: 2.0, 64: 4.0},
        "mv+packed": {1: 1.04, 17: 3.0, 64: 10.0},
        "packed": {1: 1.5, 17: 1.0},
    }
    monkeypatch.setattr(kernels, "invariant_pad", lambda weight, kernel: 1)
    monkeypatch.setattr(
        kernels,
        "time_kernels",
        lambda weight, found, rows=(1, 17): {k.name: {count: costs[k.name][count] for count in rows} for k in found},
    )
    monkeypatch.setattr(kernels, "packing_available", lambda dtype: True)
    choice = kernels.measure_choice((8, 8), torch.float32, "native")
    assert choice.kernel == Kernel("packed", one_row_mv=True) and choice.bulk == Kernel("linear")
    assert kernels.KernelChoice.from_record(choice.record()).bulk == Kernel("linear")
    weight, x = torch.randn(8, 8), torch.randn(70, 8)
    linear = kernels.LinearMap(weight, None, choice.kernel, True, choice.bulk)
    assert torch.equal(linear.many(x), torch.nn.functional.linear(x, weight))
    costs["linear"][64] = 20.0  # slower for a prompt: the prompt keeps the kernel
    assert kernels.measure_choice((8, 8), torch.float32, "native").bulk == choice.kernel


def test_choices_are_measured_once_then_read_from_the_users_cache(unmeasured, monkeypatch, user_cache):
    shapes = [(64, 32), (96, 32)]
    first = kernels.choose_kernels(shapes, torch.float32)
    assert all(c.source == "measured" and c.row_invariant is not None for c in first.values())
    stored = json.loads((user_cache / "kernels.json").read_text())
    assert set(stored["records"][kernels.machine_key()]) == {"float32/native/64x32", "float32/native/96x32"}
    kernels._chosen.clear()  # a new process: the file answers, nothing is timed

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "measure_choice", no_measuring)
    again = kernels.choose_kernels(shapes, torch.float32)
    assert {s: c.kernel for s, c in again.items()} == {s: c.kernel for s, c in first.items()}
    assert all(c.source == "cache" for c in again.values())
    # forget_choices (tune --again) drops them, in the file too.
    kernels.forget_choices(torch.float32, "native")
    assert not json.loads((user_cache / "kernels.json").read_text())["records"][kernels.machine_key()]
    with pytest.raises(AssertionError, match="measured again"):
        kernels.choose_kernels(shapes, torch.float32)


def test_a_damaged_cache_is_measured_over(unmeasured, user_cache):
    user_cache.mkdir(parents=True)
    (user_cache / "kernels.json").write_text("{not json")
    choice = kernels.choose_kernels([(16, 16)], torch.float32)[(16, 16)]
    assert choice.source == "measured"
    assert json.loads((user_cache / "kernels.json").read_text())["format"] == "rvqtts-kernels"


def test_fixed_choices_time_nothing(monkeypatch):
    monkeypatch.setenv("RVQTTS_CHOICES", "fixed")
    choice = kernels.kernel_choice((64, 64), torch.bfloat16)
    assert choice.source == "fixed" and choice.kernel.one_row_mv and choice.row_invariant is None
    assert kernels.kernel_choice((64, 64), torch.float32, "int8").kernel == Kernel("int8")


@pytest.mark.parametrize("cheaper", ["bfloat16", "float32"])
def test_dtype_auto_on_a_cpu_is_the_cheaper_measured_frame(unmeasured, monkeypatch, cheaper, tiny_dir):
    from rvqtts.qwen.checkpoints import model_config

    costs = {"bfloat16": 10.0, "float32": 20.0} if cheaper == "bfloat16" else {"bfloat16": 30.0, "float32": 20.0}
    monkeypatch.setattr(
        rvqtts.engine.model.devices,
        "frame_map_ms",
        lambda config, dtype, weights, progress, rows: costs[str(dtype).removeprefix("torch.")],
    )
    dtype, reason = rvqtts.engine.model.devices.pick_dtype("auto", "cpu", model_config(tiny_dir).talker_config)
    assert dtype == cheaper and f"{costs[cheaper]:.1f} ms in {cheaper}" in reason and "--dtype" in reason
    assert rvqtts.engine.model.devices.pick_dtype("float32", "cpu", None) == ("float32", None)


def test_dtype_auto_prices_a_batchs_rows(unmeasured, monkeypatch, tiny_dir):
    """bfloat16 cheaper at one row and dearer at 17 (torch's kernels without native bfloat16): one line a call
    runs bfloat16, 8 lines float32, each map priced straight between its 1- and 17-row timings."""
    from rvqtts.engine.model.kernels import KernelChoice
    from rvqtts.qwen.checkpoints import model_config

    timed = {torch.bfloat16: {1: 1.0, 17: 41.0}, torch.float32: {1: 2.0, 17: 10.0}}

    def choose(shapes, dtype, weights, progress):
        return {
            shape: KernelChoice(Kernel("linear"), True, {"linear": timed[dtype]}, ("linear",), "cache")
            for shape in shapes
        }

    monkeypatch.setattr(rvqtts.engine.model.devices, "choose_kernels", choose)
    config = model_config(tiny_dir).talker_config
    maps = sum(count for _, _, count in rvqtts.engine.model.devices.frame_maps(config))
    assert rvqtts.engine.model.devices.frame_map_ms(config, torch.bfloat16, rows=8) == pytest.approx(
        maps * (1 + 40 * 7 / 16)
    )
    assert rvqtts.engine.model.devices.pick_dtype("auto", "cpu", config)[0] == "bfloat16"
    dtype, reason = rvqtts.engine.model.devices.pick_dtype("auto", "cpu", config, rows=8)
    assert dtype == "float32" and "for 8 lines a call" in reason


def test_frame_maps_count_what_one_frame_applies(released_06_dir):
    from rvqtts.qwen.checkpoints import model_config

    config = model_config(released_06_dir).talker_config
    config.num_hidden_layers, config.code_predictor_config.num_hidden_layers = 3, 2  # the released widths, deeper
    maps = rvqtts.engine.model.devices.frame_maps(config)
    assert ("talker", (4096, 1024), 3) in maps and ("talker", (3072, 1024), 1) in maps  # 3 layers; codec head
    assert ("predictor", (1024, 3072), 2 * 15) in maps and ("predictor", (2048, 1024), 15) in maps


def test_tune_shows_each_shapes_kernel_and_the_dtype_auto_picks(unmeasured, tiny_dir, tmp_path):
    result, report = run_json(tmp_path / "tune.json", "tune", "--model", tiny_dir)
    assert set(report["dtypes"]) == {"bfloat16", "float32"} and report["auto"] in report["dtypes"]
    for measured_dtype in report["dtypes"].values():
        assert measured_dtype["frame_map_ms"] > 0
        for row in measured_dtype["maps"]:
            assert row["kernel"] in row["ms"] and row["loop"] in ("talker", "predictor")
            assert row["row_invariant"] == (row["kernel"] in row["invariant"])
    words = " ".join(result.output.split())  # the caption folds where the terminal is narrow
    assert "--dtype auto picks" in words and "rvqtts's native kernels" in words
    assert report["decoder_dtype"] in ("float32", "bfloat16")  # measured apart (tests/test_decoder_dtype.py)
    assert f"speech decoder in {report['decoder_dtype']}: a frame takes" in words
    assert report["native"] == rvqtts.engine.model.native.unavailable()  # None where they run, else why not
    assert report["native_level"] == rvqtts.engine.model.native.level()  # avx2 or avx512 where they run
    bad = run("tune", "--model", tiny_dir, "--dtype", "float16")
    assert bad.exit_code == 2 and "rvqtts tune measures CPU kernels" in bad.output


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measured_kernels_keep_speculative_codes_equal_to_plain_codes(measured, released_06_kernels, dtype):
    """Whatever kernels the measurement picks (all row-invariant where any is: both dtypes on the CPUs
    measured so far, float32 included), every frame of a tree run equals the plain run's."""
    synth = Synthesizer.from_checkpoint(released_06_kernels, dtype=dtype)
    speculation = Speculation(
        resolve_tree("15"), Offsets(torch.randn(3, 1024, generator=torch.Generator().manual_seed(3)) * 0.5)
    )
    plain, _ = decode_frames(synth, None, 20)
    spec, stats = decode_frames(synth, speculation, 20)
    if linear_maps_are_row_invariant(synth.code_predictor):
        assert np.array_equal(plain, spec)
    else:
        assert (plain != spec).any(axis=1).sum() <= 2
    assert stats.accepted_per_depth[0] > 0


def test_a_run_records_its_device_dtype_and_kernels(tiny_dir, tmp_path):
    result = run(
        "synth",
        "Hi.",
        "--model",
        tiny_dir,
        "-o",
        tmp_path / "a.wav",
        "--max-frames",
        "3",
        "--dtype",
        "float32",
        "--stats-json",
        tmp_path / "s.json",
    )
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "s.json").read_text())
    engine = stats["utterances"][0]["engine"]
    assert engine["device"] == "cpu" and engine["dtype"] == "float32" and engine["weights"] == "native"
    assert engine["torch"] == torch.__version__ and engine["cpu"]
    layers = 2 * 4  # the tiny talker's and predictor's two layers, four maps each
    assert sum(engine["kernels"]["talker"]["maps"].values()) == layers + 1  # and the codec head
    assert sum(engine["kernels"]["predictor"]["maps"].values()) == layers + 15  # and the 15 LM heads
    config = Synthesizer.from_checkpoint(tiny_dir).code_predictor.config  # what this machine's start-up check finds:
    exact = row_attention_exact(config, torch.device("cpu"), torch.float32)
    assert engine["kernels"]["predictor"]["attention"] == ("rows" if exact else "gathered")
    summary = _engine_summary(engine)
    assert ("row attention" if exact else "gathered attention") in summary and summary.startswith("float32 on cpu")
    assert stats["total"]["engine"] == engine
    assert engine["kernels"]["talker"]["native"] is None and "native" not in summary  # float32 runs torch's
    engine["kernels"]["predictor"]["native"] = "layers"
    assert "native layers" in _engine_summary(engine)


@pytest.mark.parametrize("count", [1, 31, 32, 33, 70])
def test_in_row_chunks_calls_at_one_row_count_and_keeps_every_rows_result(count):
    x = torch.randn(count, 3, 8, generator=torch.Generator().manual_seed(count))
    seen = []

    def doubled(chunk: torch.Tensor) -> torch.Tensor:
        seen.append(chunk.shape)
        return chunk * 2

    assert torch.equal(kernels.in_row_chunks(doubled, x), x * 2)
    assert seen == [(kernels.CHUNK, 3, 8)] * -(-count // kernels.CHUNK)


def test_the_gpu_paths_one_row_count_run_on_the_cpu_keeps_tree_codes_equal_to_plain_codes(tiny_dir, monkeypatch):
    """Off the CPU every map call is F.linear over exactly CHUNK rows and every norm runs in CHUNK-row calls, the maps
    probed for row invariance on the device (rvqtts.engine.model.kernels.device_choice): that path, run here on the CPU
    with emulated CUDA graphs, pads every call of the inner loop to one row count, and its tree rounds give the plain
    steps' codes."""
    from rvqtts.engine.model import transformer
    from rvqtts.engine.model.graphs import StaticCalls

    monkeypatch.setenv("RVQTTS_CHOICES", "measured")
    monkeypatch.setattr(kernels, "_device_chosen", {})
    for module in (kernels, transformer):
        monkeypatch.setattr(module, "one_row_count", lambda device: True)
    synth = Synthesizer.from_checkpoint(tiny_dir, dtype="float32")
    speculation = Speculation(resolve_tree("15"), Offsets(torch.zeros(3, synth.code_predictor.config.hidden_size)))
    linear, rows = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: rows.append(x.shape[0]) or linear(x, w, b))
    plain, _ = decode_frames(synth, None, 8, StaticCalls("emulated"))
    spec, stats = decode_frames(synth, speculation, 8, StaticCalls("emulated"))
    assert np.array_equal(plain, spec) and stats.accepted_per_depth[0] > 0
    assert set(rows) == {kernels.CHUNK}
    predictor = synth.runners.inner_parts().runner
    assert predictor.norms_in_chunks
    assert kernels_used(predictor.linear_maps()) == {
        "maps": {f"linear/pad{kernels.CHUNK}": len(predictor.linear_maps())},
        "row_invariant": True,
    }
    assert predictor.rounds_exact
    predictor.device = torch.device("cuda")  # off the CPU, only row attention measured exact there keeps rounds exact
    predictor.row_attention = True
    assert predictor.rounds_exact
    predictor.row_attention = False
    assert not predictor.rounds_exact
    # what its measurements (call costs, batch sizes) are kept under: the GPU, not this CPU
    assert kernels.device_key(torch.device("cpu")) == kernels.machine_key()
    assert kernels.device_key(torch.device("mps")).startswith("mps | torch ")
