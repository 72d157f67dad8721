"""8-bit and 4-bit weights (W8A16, W4A16): the quantization rules, the maps, exactness of speculation within the
quantized model, and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import random_prefix
from helpers import run_cli as run
from helpers import run_cli_json as run_json

from rvqtts.engine.loop.inner_loop import InnerLoop, LoopParts
from rvqtts.engine.model.kernels import Kernel, LinearMap
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.quantize import check_weights, dequantized_groups, group_size, quantize_groups, quantize_rows
from rvqtts.engine.model.sampling import SamplingConfig
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.synthesis.synthesizer import Synthesizer


def test_rows_round_to_the_nearest_step_of_their_own_scale():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 40, generator=generator) * torch.tensor([1e-3, 0.1, 1, 10, 100, 0.0])[:, None]
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q.abs().amax(dim=1)[:5], torch.full((5,), 127, dtype=torch.int8))  # each row's peak
    error = (q.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(q[5], torch.zeros(40, dtype=torch.int8))  # an all-zero row stays zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_map_applies_its_dequantized_weights_and_gives_rows_the_same_bits_in_any_call(dtype):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(96, 64, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    linear = LinearMap(weight, bias, Kernel("int8"))
    x = torch.randn(20, 64, generator=generator).to(dtype)
    q, scales = quantize_rows(weight)
    expected = x.float() @ (q.float() * scales.to(dtype).float()[:, None]).T + bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    assert (linear(x).float() - expected).abs().max() <= tolerance
    alone = torch.stack([linear(row) for row in x])  # 1-D rows, as plain steps map them
    for rows in (1, 2, 5, 16, 20):
        assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_maps_of_the_released_shapes_give_rows_the_same_bits_in_calls_of_up_to_65_rows(released_06_dir, dtype):
    """The claim speculation's exactness rests on, at the shapes that run (a 64-node round has 65 rows)."""
    runner = PredictorRunner(
        Synthesizer.from_checkpoint(released_06_dir, dtype=dtype).code_predictor, 2, weights="int8"
    )
    generator = torch.Generator().manual_seed(4)
    for linear in (runner.qkv[0], runner.gate_up[0], runner.out[0], runner.down[0], runner.heads[0]):
        x = torch.randn(65, linear.weight.shape[1], generator=generator).to(getattr(torch, dtype))
        alone = torch.cat([linear(x[i : i + 1]) for i in range(65)])
        for rows in (2, 17, 33, 65):
            assert torch.equal(linear(x[:rows]), alone[:rows]), f"{tuple(linear.weight.shape)}, {rows} rows"


def test_quantized_weights_are_refused_off_the_cpu_and_unknown_formats_everywhere():
    with pytest.raises(ValueError, match="8-bit weights run on CPUs only"):
        check_weights("int8", torch.device("cuda"))
    with pytest.raises(ValueError, match="4-bit weights run on CPUs only.*use --weights native"):
        check_weights("int4", torch.device("mps"))
    with pytest.raises(ValueError, match="choose native, int8 or int4"):
        check_weights("int2", torch.device("cpu"))


def test_4bit_groups_round_to_the_nearest_step_of_their_own_range():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=generator) * torch.tensor([1e-3, 0.1, 1, 100] * 12)[:, None]
    weight[5, 32:64] = 0.0  # an all-zero group
    values, scales_zeros = quantize_groups(weight, 32)
    assert values.dtype == torch.int32 and values.min() >= 0 and values.max() <= 15
    assert scales_zeros.shape == (48, 3, 2)
    error = (dequantized_groups(values, scales_zeros, 32) - weight).abs().reshape(48, 3, 32)
    assert (error <= scales_zeros[..., :1] / 2 * (1 + 1e-5) + 1e-30).all()  # within half its group's step
    assert torch.equal(dequantized_groups(values, scales_zeros, 32)[5, 32:64], torch.zeros(32))  # zeros stay zero
    assert torch.equal(quantize_groups(weight[:7], 32)[0], values[:7])  # each row alone


def test_a_4bit_group_is_the_largest_of_128_64_and_32_that_divides_the_inputs():
    assert [group_size(shape) for shape in ((96, 1024), (96, 64), (96, 96), (96, 48), (100, 128))] == [
        128, 64, 32, None, None
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (48, 96), (16, 1024)])
def test_an_int4_map_applies_its_dequantized_weights_and_gives_rows_the_same_bits_in_any_call(dtype, shape):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(*shape, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype)
    linear = LinearMap(weight, bias, Kernel("int4"))
    x = torch.randn(33, shape[1], generator=generator).to(dtype)
    group = group_size(shape)
    values, scales_zeros = quantize_groups(weight, group)
    expected = x.float() @ dequantized_groups(values, scales_zeros.to(dtype).float(), group).T + bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.05 * shape[1] ** 0.5 / 8
    assert (linear(x).float() - expected).abs().max() <= tolerance
    alone = torch.stack([linear(row) for row in x])
    for rows in (1, 2, 5, 16, 33):
        assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows"


def test_a_map_4bit_groups_cannot_hold_keeps_8bit_weights():
    weight = torch.randn(96, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(LinearMap(weight, None, Kernel("int4"))(x), LinearMap(weight, None, Kernel("int8"))(x))


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_codes_equal_plain_codes_within_the_quantized_model(tiny_dir, dtype, weights):
    """torch's int8 and int4 kernels give a row the same bits whatever the call's row count, so a tree round's
    rows are what plain steps compute: every frame agrees, in float32 too (unlike float32's own maps)."""
    synth = Synthesizer.from_checkpoint(tiny_dir, dtype=dtype)
    predictor = synth.code_predictor
    offsets = Offsets(torch.randn(3, synth.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5)
    frames = {}
    for name, speculation in (("plain", None), ("tree", Speculation(resolve_tree("15"), offsets))):
        loop = InnerLoop(predictor, speculation, seed=7, parts=LoopParts.build(predictor, speculation, False, weights))
        prefixes = [random_prefix(synth, seed=f).to(getattr(torch, dtype)) for f in range(25)]
        frames[name] = np.array([loop.frame(p, SamplingConfig(), 0, f) for f, p in enumerate(prefixes)])
        if speculation:
            assert loop.stats.accepted_per_depth[0] > 0  # drafts were accepted
    native = InnerLoop(predictor, None, seed=7)
    unquantized = np.array(
        [
            native.frame(random_prefix(synth, seed=f).to(getattr(torch, dtype)), SamplingConfig(), 0, f)
            for f in range(25)
        ]
    )
    assert np.array_equal(frames["plain"], frames["tree"])
    assert not np.array_equal(frames["plain"], unquantized)  # the runner did quantize


def test_synth_with_quantized_weights_and_its_refusals(tiny_dir, tmp_path):
    for weights in ("int8", "int4"):
        out, stats = tmp_path / f"{weights}.wav", tmp_path / f"{weights}.json"
        options = ("--weights", weights, "--max-frames", "5", "-o", out, "--stats-json", stats)
        result = run("synth", "--model", tiny_dir, *options, "Hello there.")
        assert result.exit_code == 0, result.output
        assert out.stat().st_size > 44 and json.loads(stats.read_text())["utterances"][0]["weights"] == weights
        coreml = run("synth", "--model", tiny_dir, "--weights", weights, "--backend", "coreml", "-o", out, "Hi.")
        assert coreml.exit_code == 2 and "torch backend" in coreml.output
    assert (tmp_path / "int8.wav").read_bytes() != (tmp_path / "int4.wav").read_bytes()  # 4 bits are not 8
    bad = run("synth", "--model", tiny_dir, "--weights", "int2", "-o", tmp_path / "b.wav", "Hello.")
    assert bad.exit_code == 2 and "choose native, int8 or int4" in bad.output and not (tmp_path / "b.wav").exists()


def test_bench_talker_reads_fewer_bytes_with_int8_weights(tiny_dir, tmp_path):
    reports = {}
    for weights in ("native", "int8"):
        _, reports[weights] = run_json(
            tmp_path / f"{weights}.json",
            "bench",
            "talker",
            "--model",
            tiny_dir,
            "--contexts",
            "8",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--weights",
            weights,
            "-q",
        )
    # float32 maps become one byte a weight plus a float32 scale per row: about a quarter of the bytes.
    ratio = reports["int8"]["weights_mb"] / reports["native"]["weights_mb"]
    assert 0.2 < ratio < 0.35 and reports["int8"]["weight_format"] == "int8"


def test_bench_dtype_compares_int8_weights_with_the_dtypes_own(tiny_dir, tmp_path):
    result, report = run_json(
        tmp_path / "dtype.json",
        "bench",
        "dtype",
        "--model",
        tiny_dir,
        "--dtype",
        "float32",
        "--weights",
        "int8",
        "--frames",
        "6",
    )
    assert (report["dtype"], report["reference_dtype"], report["weights"]) == ("float32", "float32", "int8")
    # 8-bit weights change a draw now and then; a broken comparison would agree on about 1 code in 50.
    assert 0.8 < report["teacher_forced_code_agreement"] < 1
    assert "float32 with int8 weights vs float32" in result.output


def test_rows_quantized_in_blocks_equal_the_whole_matrix_at_once():
    """quantize_rows works QUANTIZED_ROWS rows at a time (its float32 temporaries stay small): each row alone, so
    the int8 weights and scales are those of the whole matrix at once."""
    from rvqtts.engine.model.quantize import QUANTIZED_ROWS, quantize_rows

    weight = torch.randn(2 * QUANTIZED_ROWS + 37, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    values = weight.float()
    scales = values.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    expected = torch.round(values / scales[:, None]).clamp(-127, 127).to(torch.int8)
    quantized, got = quantize_rows(weight)
    assert torch.equal(quantized, expected) and torch.equal(got, scales) and quantized.is_contiguous()
