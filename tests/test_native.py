"""rvqtts's native CPU kernels (rvqtts.engine.model.native): what the map kernel computes for bfloat16 and 8-bit
weights, that every row gets the same bits whatever the call's rows and threads, that the kernel choice
offers it, that a layer's norms and RoPE come out as qwen-tts's operations give them, that its draws are torch's, and
that a machine where the library cannot be built says why and runs without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import decode_frames

import rvqtts.engine.model.kernels as kernels
from rvqtts.engine.model import native
from rvqtts.engine.model.kernels import Kernel, KernelChoice, LinearMap, candidates, rows_are_invariant
from rvqtts.engine.model.predictor import PredictorRunner
from rvqtts.engine.model.quantize import dequantized_groups, quantize_groups, quantize_rows
from rvqtts.engine.model.sampling import (
    MIN_TEMPERATURE,
    RowSampling,
    SamplingConfig,
    draw_checked,
    gumbel_noise,
    native_draws,
    noised_scores,
)
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import Speculation
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.synthesis.synthesizer import Synthesizer

needs_kernel = pytest.mark.skipif(
    native.unavailable() is not None, reason=f"rvqtts's kernel does not run here: {native.unavailable()}"
)
needs_avx512 = pytest.mark.skipif(
    native.level() != "avx512", reason=f"rvqtts's AVX-512 kernels are not built here (level {native.level()})"
)
needs_amx = pytest.mark.skipif(
    native.amx_unavailable() is not None, reason=f"rvqtts's AMX kernels do not run here: {native.amx_unavailable()}"
)
# Each of the library's kernels: the AVX2 ones run on every x86-64 CI machine (the AVX-512 build has them too),
# the AVX-512 and AMX ones where the CPU has them.
BF16_KERNELS = [pytest.param("bf16dot", marks=needs_avx512), pytest.param("bf16amx", marks=needs_amx), "bf16avx2"]
INT8_KERNELS = [pytest.param("int8dot", marks=needs_avx512), pytest.param("int8amx", marks=needs_amx), "int8avx2"]
INT4_KERNELS = [pytest.param("int4dot", marks=needs_avx512), "int4avx2"]
# 80 outputs: one group of four 16-channel blocks and one single block; 96 inputs: 48 pairs (torch's own
# int8 kernel, compared below, fails on some odd widths).
SHAPE = (80, 96)


def _sample(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def _within_rounding(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether `out` is x W^T (+ bias) up to its roundings to bfloat16 and the float32 sums of its terms
    (a wrong layout or scale is off by the size of the terms)."""
    exact = x.double() @ weight.double().T
    size = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact, size = exact + bias.double(), size + bias.double().abs()
    return bool(((out.double() - exact).abs() <= exact.abs() * 2**-7 + size * 2**-12).all())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_native_draw_gives_torchs_codes_and_finite_flags_on_every_kind_of_row(dtype):
    """The library's draw against sampling's torch operations, row by row with its own config and noise row: ties,
    a NaN, +inf, a row of -inf and one mostly -inf, greedy rows, top-k from off to past the vocabulary, temperatures
    of 1, a tiny and a huge one; draw_checked takes it on a CPU and leaves top-p to torch."""
    vocab, generator = 300, torch.Generator().manual_seed(7)
    configs = [
        SamplingConfig(temperature, top_k)
        for temperature in (0.9, 1.0, MIN_TEMPERATURE, 1e4, 0.0)
        for top_k in (0, 1, 50, vocab - 1, vocab, vocab + 5)
    ]
    logits = (torch.randn(len(configs), vocab, generator=generator) * 4).to(dtype)
    logits[0, :9] = logits[0, 9]  # ties with the largest
    logits[1, 3], logits[2, [5, 9]], logits[3] = float("nan"), float("inf"), float("-inf")
    logits[4, 20:] = float("-inf")
    logits[::7, 40:60] = logits[::7, 40:41]
    noise = torch.from_numpy(gumbel_noise(5, 0, 0, range(2 * len(configs)), vocab))
    noise_rows = torch.randperm(2 * len(configs), generator=generator)[: len(configs)]
    codes, finite = native.draw(
        logits, noise, [c.temperature if c.do_sample else 0.0 for c in configs], [c.top_k for c in configs], noise_rows
    )
    for r, config in enumerate(configs):
        scores = noised_scores(logits[r], noise[noise_rows[r]], config)
        code = scores.argmax()
        assert (int(codes[r]), bool(finite[r])) == (int(code), bool(torch.isfinite(scores[code]))), (r, config)
    assert finite.tolist().count(False) == 3  # the NaN, +inf and -inf rows
    assert native_draws(logits, noise, configs[0]) and not native_draws(logits, noise, SamplingConfig(top_p=0.9))
    mixed = RowSampling.of(configs, torch.device("cpu"))
    assert torch.equal(draw_checked(logits, noise, mixed, noise_rows)[0], codes)
    temperatures, top_ks = [0.9] * len(configs), [50] * len(configs)
    for short, rows in ((noise[:3], None), (noise, noise_rows + len(configs)), (noise, noise_rows[:-1])):
        with pytest.raises(ValueError, match="does not cover"):  # nothing read outside the noise
            native.draw(logits, short, temperatures, top_ks, rows)


@needs_kernel
@pytest.mark.parametrize("name", BF16_KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 33])
def test_bf16_weights_give_the_product_up_to_rounding(rows, name):
    generator = torch.Generator().manual_seed(rows)
    weight, x = _sample(generator, *SHAPE), _sample(generator, rows, SHAPE[1])
    out = LinearMap(weight, None, Kernel(name))(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, SHAPE[0])
    assert _within_rounding(out, x, weight)


@needs_kernel
@pytest.mark.parametrize("name", INT8_KERNELS)
@pytest.mark.parametrize("rows", [1, 6, 17])
def test_int8_weights_give_the_product_with_the_dequantized_weights_and_the_bias(rows, name):
    generator = torch.Generator().manual_seed(rows)
    weight, x, bias = _sample(generator, *SHAPE), _sample(generator, rows, SHAPE[1]), _sample(generator, SHAPE[0])
    quantized, scales = quantize_rows(weight)
    dequantized = quantized.double() * scales.to(torch.bfloat16).double()[:, None]  # the bf16 scales torch's uses
    out = LinearMap(weight, bias, Kernel(name))(x)
    assert _within_rounding(out, x, dequantized, bias)
    assert not _within_rounding(out, x, weight.double() * 1.02, bias)  # the check tells a 2 % scale error
    torch_int8 = LinearMap(weight, bias, Kernel("int8"))(x)  # the same quantized model through torch's kernel
    assert _within_rounding(torch_int8, x, dequantized, bias)


@needs_avx512
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 11, 17])
def test_int8dot_widens_its_grouped_weights_to_the_values_bf16dot_multiplies(rows):
    """int8dot holds its weights in sign-magnitude groups widened by table lookups; with unit scales it must give
    bf16dot's bits over the same integers held as bfloat16 (every product sequence alike, one rounding at the end),
    over every int8 value, in calls of one pass and of several (the later ones reading the weights kept widened)."""
    generator = torch.Generator().manual_seed(rows)
    integers = torch.randint(-127, 128, SHAPE, generator=generator, dtype=torch.int8)
    integers.view(-1)[:255] = torch.arange(-127, 128, dtype=torch.int8)  # every value a weight may take
    x = _sample(generator, rows, SHAPE[1])
    grouped = native.pack(integers, "int8dot")
    assert not torch.equal(grouped, native.pack(integers))  # its own layout
    out = native.apply("int8dot", x, grouped, torch.ones(SHAPE[0]))
    assert torch.equal(out, native.apply("bf16dot", x, native.pack(integers.to(torch.bfloat16))))


@needs_kernel
@pytest.mark.parametrize("name", INT4_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("shape, group", [((80, 96), 32), ((48, 1024), 128), ((16, 96), 64)])
def test_4bit_kernels_give_the_product_with_the_dequantized_groups(rows, shape, group, name):
    """4-bit groups (the last one short where the group does not divide the inputs: 96 inputs in groups of 64)
    through the 4-bit kernels: the product with the weights they stand for, up to roundings; odd block counts (5, 3,
    1) and row counts that fill no tile or several."""
    generator = torch.Generator().manual_seed(rows)
    weight, x = _sample(generator, *shape), _sample(generator, rows, shape[1])
    values, scales_zeros = quantize_groups(weight, group)
    packed, scales = native.pack_int4(values), native.pack_group_scales(scales_zeros)
    out = native.apply_int4(name, x, packed, scales, group)
    dequantized = dequantized_groups(values, scales_zeros, group).double()
    assert _within_rounding(out, x, dequantized)
    assert not _within_rounding(out, x, dequantized * 1.02)  # the check tells a 2 % scale error
    alone = torch.cat([native.apply_int4(name, row[None], packed, scales, group) for row in x])
    assert torch.equal(out, alone)  # each row's own bits


@needs_kernel
@pytest.mark.parametrize("name", BF16_KERNELS + INT8_KERNELS + INT4_KERNELS)
def test_every_row_gets_its_own_bits_whatever_the_rows_and_threads_of_the_call(name):
    generator = torch.Generator().manual_seed(3)
    linear = LinearMap(_sample(generator, *SHAPE), None, Kernel(name))
    assert rows_are_invariant(linear, generator)
    x = _sample(generator, 13, SHAPE[1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x)
        torch.set_num_threads(2)
        assert torch.equal(linear(x), alone)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_kernel_is_a_candidate_for_the_shapes_and_dtype_it_runs():
    dot, int8 = ("bf16dot", "int8dot") if native.level() == "avx512" else ("bf16avx2", "int8avx2")
    assert Kernel(dot) in candidates(torch.bfloat16, "native", (1024, 3072))
    assert Kernel(int8) in candidates(torch.bfloat16, "int8", (1024, 3072))
    assert (Kernel("int4dot") in candidates(torch.bfloat16, "int4", (1024, 3072))) == (native.level() == "avx512")
    assert candidates(torch.bfloat16, "int4", (1024, 48))[0] == Kernel("int8")  # no 4-bit group divides 48 inputs
    assert Kernel(dot) not in candidates(torch.float32, "native", (1024, 3072))
    assert Kernel(dot) not in candidates(torch.bfloat16, "native", (1000, 3072))  # not 16 a block
    if native.level() == "avx512":  # built there for the tests, but never a candidate (4x the instructions)
        assert Kernel("bf16avx2") not in candidates(torch.bfloat16, "native", (1024, 3072))
    linear = LinearMap(torch.zeros(32, 64, dtype=torch.bfloat16), None, Kernel(int8))
    assert sum(t.numel() * t.element_size() for t in linear.reads()) == 32 * 64 + 32 * 4  # int8 and scales


@needs_amx
def test_the_amx_kernels_are_candidates_where_the_inputs_fill_their_tiles():
    assert Kernel("bf16amx") in candidates(torch.bfloat16, "native", (1024, 3072))
    assert Kernel("int8amx") in candidates(torch.bfloat16, "int8", (1024, 3072))
    assert Kernel("bf16amx") not in candidates(torch.bfloat16, "native", (1024, 3056))  # not 32 an input tile
    assert Kernel("bf16dot") in candidates(torch.bfloat16, "native", (1024, 3056))


def test_a_machine_that_cannot_build_it_says_why_and_offers_the_other_kernels(tmp_path):
    script = (
        "import torch; from rvqtts.engine.model import kernels, native; print(native.unavailable()); "
        "print([k.name for k in kernels.candidates(torch.bfloat16, 'native', (64, 64))])"
    )
    env = {**os.environ, "CXX": "/bin/false", "RVQTTS_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    reason, names = result.stdout.strip().splitlines()
    assert reason.startswith("the CPU") or "could not build native.cpp" in reason
    assert "bf16dot" not in names and "packed" in names or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert "bf16avx2" not in names
    assert not list(tmp_path.glob("build/*.so"))  # nothing half-built is left to load


def test_a_kernel_that_cannot_run_here_is_refused_with_the_reason_not_run():
    """A kernel this level does not build, or whose instructions this CPU lacks (AMX), raises instead of running
    (an illegal instruction would kill the process)."""
    rows, packed = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 16, 16, 2, dtype=torch.bfloat16)
    for kind in ["no-such-kernel", *(kind for kind in native.KINDS if not native.runs(kind))]:
        with pytest.raises(ValueError, match=f"rvqtts's {kind} kernel does not run here"):
            native.apply(kind, rows, packed)


def _native_outputs(path: str) -> None:
    """What the library built here computes for fixed inputs (maps by the AVX2 kernels, every row-wise step),
    saved to `path`."""
    generator = torch.Generator().manual_seed(6)
    weight = _sample(generator, *SHAPE)
    x = _sample(generator, 17, SHAPE[1]) * 3
    outputs = {
        f"{name}/{rows}": LinearMap(weight, None, Kernel(name))(x[:rows])
        for name in ("bf16avx2", "int8avx2")
        for rows in (1, 2, 3, 5, 17)
    }
    norm = _sample(generator, SHAPE[1])
    outputs["rms_norm"] = native.rms_norm(x, norm, 1e-6)
    outputs["silu_times_up"] = native.silu_times_up(x)
    k_cache, v_cache, q = _sample(generator, 2, 40, 32), _sample(generator, 2, 40, 32), _sample(generator, 4, 7, 32)
    outputs["attend"] = native.attend(q, k_cache, v_cache, 30)
    cos, sin = _sample(generator, 5, 32), _sample(generator, 5, 32)
    qkv = _sample(generator, 5, 8 * 32)
    outputs["queries"] = native.attention_inputs(
        qkv, 4, 2, norm[:32], norm[32:64], cos, sin, 1e-6, k_cache, v_cache, slice(3, 8)
    )
    outputs["keys"], outputs["values"] = k_cache, v_cache
    torch.save({key: value.clone() for key, value in outputs.items()}, path)


@needs_kernel
def test_an_avx512_machine_capped_at_avx2_builds_and_runs_the_avx2_library_and_its_bits(tmp_path):
    """RVQTTS_ISA=avx2 loads the AVX2 build, which offers its FMA kernels; its maps and row-wise steps give the
    bits this process's library gives (the AVX-512 build's copies of the AVX2 kernels where this CPU has AVX-512);
    RVQTTS_ISA=none leaves torch's kernels and says why."""
    script = (
        "import sys, torch; sys.path.insert(0, 'tests'); from test_native import _native_outputs; "
        "from rvqtts.engine.model import kernels, native; print(native.level()); "
        "print(' '.join(k.name for k in kernels.candidates(torch.bfloat16, 'native', (64, 64)))); "
        "_native_outputs(sys.argv[1])"
    )
    env = {**os.environ, "RVQTTS_ISA": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "avx2.pt")], capture_output=True, text=True, env=env, check=True
    )
    built, names = result.stdout.strip().splitlines()
    assert built == "avx2" and "bf16avx2" in names.split() and "bf16dot" not in names.split()
    _native_outputs(str(tmp_path / "here.pt"))
    theirs, ours = torch.load(tmp_path / "avx2.pt"), torch.load(tmp_path / "here.pt")
    assert theirs.keys() == ours.keys()
    assert [key for key in ours if not torch.equal(theirs[key], ours[key])] == []
    none = subprocess.run(
        [sys.executable, "-c", "from rvqtts.engine.model import native; print(native.unavailable())"],
        capture_output=True,
        text=True,
        env={**os.environ, "RVQTTS_ISA": "none"},
        check=True,
    )
    assert "lacks avx2, fma (capped at none by RVQTTS_ISA)" in none.stdout


@needs_kernel
@pytest.mark.parametrize("rows", [1, 17])
def test_a_layers_norms_and_rope_run_natively_as_qwen_tts_rounds_them(rows, released_06_dir):
    """The native q/k norms and RoPE against the module's own operations on the released predictor's
    first layer: the same bits, bar the norm's float32 sum in another order (a bfloat16 step at most);
    keys and values land in the cache slots asked for, each row as it lands alone."""
    runner = PredictorRunner(Synthesizer.from_checkpoint(released_06_dir, dtype="bfloat16").code_predictor, 40)
    assert runner.native_rows
    generator = torch.Generator().manual_seed(rows)
    x = _sample(generator, rows, runner.hidden_size) * 4
    positions = torch.arange(rows) + 3
    cos, sin = runner.cos[positions][None], runner.sin[positions][None]
    slots = torch.randperm(40, generator=generator)[:rows]
    with torch.inference_mode():
        q = runner.native_attention_inputs(0, x, cos, sin, slots)
        ours = q, runner.k_cache[0][:, slots], runner.v_cache[0][:, slots]
        theirs = runner.attention_inputs(0, x, cos, sin)
        norm = runner.layers[0].input_layernorm
        assert torch.equal(native.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape
            assert (a.float() - b.float()).abs().max() <= b.float().abs().max() * 2**-7
            assert (a == b).float().mean() > 0.99
        runner.allocate(40)
        for r in range(rows):  # one row a call, at slots given as a slice
            alone = runner.native_attention_inputs(
                0, x[r : r + 1], cos[:, r : r + 1], sin[:, r : r + 1], slice(int(slots[r]), int(slots[r]) + 1)
            )
            assert torch.equal(alone[:, 0], q[:, r])
        assert torch.equal(runner.k_cache[0][:, slots], ours[1]) and torch.equal(runner.v_cache[0][:, slots], ours[2])


@needs_kernel
def test_attention_over_the_cache_is_float32_attention_of_the_visible_slots_query_by_query():
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, length, head_dim, rows, width = 4, 2, 40, 32, 7, 12
    k_cache, v_cache = _sample(generator, kv_heads, length, head_dim), _sample(generator, kv_heads, length, head_dim)
    q = _sample(generator, heads, rows, head_dim)
    slots = torch.randint(0, length, (rows, width), generator=generator)
    visible = torch.rand(rows, width, generator=generator) < 0.5
    visible[:, 0] = True
    out = native.attend(q, k_cache, v_cache, width, slots, visible)
    for r in range(rows):  # float64 attention of query r over its own visible slots
        seen = slots[r][visible[r]]
        keys = k_cache[:, seen].double().repeat_interleave(heads // kv_heads, 0)
        values = v_cache[:, seen].double().repeat_interleave(heads // kv_heads, 0)
        weights = (q[:, r : r + 1].double() @ keys.transpose(1, 2) * head_dim**-0.5).softmax(-1)
        expected = (weights @ values)[:, 0]
        assert ((out[:, r].double() - expected).abs() <= expected.abs() * 2**-8 + 2**-12).all()
    alone = torch.cat(
        [
            native.attend(q[:, r : r + 1], k_cache, v_cache, width, slots[r : r + 1], visible[r : r + 1])
            for r in range(rows)
        ],
        dim=1,
    )
    assert torch.equal(out, alone)
    # Without slots, query r sees the first `width` slots (where visible: a causal prefill's mask).
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    first = native.attend(q, k_cache, v_cache, rows, None, causal)
    assert torch.equal(first, native.attend(q, k_cache, v_cache, rows, torch.arange(rows).expand(rows, -1), causal))
    assert torch.equal(first[:, :1], native.attend(q[:, :1], k_cache, v_cache, 1))


@needs_kernel
def test_a_slot_outside_the_caches_is_refused_before_anything_is_written():
    """Every native call that writes or reads cache slots by index checks them first: a layout built for larger
    caches (a batch's rows) raises, and the caches are as they were, instead of a write past them."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, length, head_dim, rows = 4, 2, 16, 32, 3
    k_cache, v_cache = _sample(generator, kv_heads, length, head_dim), _sample(generator, kv_heads, length, head_dim)
    before = k_cache.clone(), v_cache.clone()
    qkv = _sample(generator, rows, (heads + 2 * kv_heads) * head_dim)
    norm, cos, sin = (
        torch.ones(head_dim, dtype=torch.bfloat16),
        _sample(generator, rows, head_dim),
        _sample(generator, rows, head_dim),
    )
    for write in (torch.tensor([3, 9, length]), torch.tensor([-1, 2, 3]), slice(length - 2, length + 1)):
        with pytest.raises(IndexError, match=f"outside a cache of {length} slots"):
            native.attention_inputs(qkv, heads, kv_heads, norm, norm, cos, sin, 1e-6, k_cache, v_cache, write)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    q = _sample(generator, heads, rows, head_dim)
    with pytest.raises(IndexError, match="outside a cache"):
        native.attend(q, k_cache, v_cache, 2, torch.tensor([[0, 1], [2, 3], [4, length + 40]]))
    with pytest.raises(IndexError, match="outside a cache"):
        native.attend(q, k_cache, v_cache, length + 1)


@pytest.fixture(params=[pytest.param("dot", marks=needs_avx512), pytest.param("amx", marks=needs_amx), "avx2"])
def own_kernel(monkeypatch, request):
    """Every CPU map runs one of the library's kernels (bfloat16 or 8-bit; AVX512 dot products, AMX tiles or
    AVX2 FMA), whatever this machine would measure."""

    def choice(shape, dtype, weights="native", device=torch.device("cpu")):
        name = ("int8" if weights == "int8" else "bf16") + request.param
        return KernelChoice(Kernel(name), True, {}, (), "measured")

    monkeypatch.setattr(kernels, "kernel_choice", choice)


@needs_kernel
@pytest.mark.parametrize("weights", ["native", "int8"])
def test_a_whole_layer_in_one_call_gives_the_step_by_step_bits_and_the_plain_codes(
    released_06_dir, own_kernel, weights
):
    """With every map on the library's kernel a layer runs in one native call: its states and cache
    equal the step-by-step calls' bit for bit (a round's rows and a causal prefill), and a tree's codes
    are the plain loop's at the released 0.6B layout."""
    synth = Synthesizer.from_checkpoint(released_06_dir, dtype="bfloat16", weights=weights)
    runner = PredictorRunner(synth.code_predictor, 40, weights)
    assert runner.native_layers is not None
    generator = torch.Generator().manual_seed(5)
    x = _sample(generator, 17, runner.hidden_size)
    cos, sin = runner.cos[torch.arange(17) + 3][None], runner.sin[torch.arange(17) + 3][None]
    slots = torch.randint(0, 20, (17, 32), generator=generator)
    visible = torch.rand(17, 32, generator=generator) < 0.5
    visible[:, 0] = True
    causal = torch.ones(17, 17, dtype=torch.bool).tril()
    calls = [dict(write=slice(3, 20), span=32, rows=(slots, visible)), dict(write=slice(0, 17), span=17, mask=causal)]
    with torch.inference_mode():
        for call in calls:
            results = []
            for layers in (runner.native_layers, None):
                runner.native_layers, saved = layers, runner.native_layers
                runner.allocate(40)
                results.append((runner.run_layers(x, cos, sin, **call), runner.k_cache.clone(), runner.v_cache.clone()))
                runner.native_layers = saved if layers is None else layers
            assert all(torch.equal(a, b) for a, b in zip(*results))
    offsets = Offsets(torch.randn(3, synth.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5)
    plain, _ = decode_frames(synth, None, 12)  # (random weights: drafts are first accepted in the tenth frame)
    spec, stats = decode_frames(synth, Speculation(resolve_tree("15"), offsets), 12)
    assert np.array_equal(plain, spec) and stats.accepted_per_depth[0] > 0


@needs_avx512
def test_4bit_maps_on_int4dot_keep_a_trees_codes_the_plain_loops(released_06_dir, monkeypatch):
    """Every map of the code predictor on int4dot (the released 0.6B layout, groups of 128): no whole-layer call
    (that one knows no 4-bit weights), and a tree's codes are the plain loop's."""
    monkeypatch.setattr(
        kernels, "kernel_choice", lambda *_, **__: KernelChoice(Kernel("int4dot"), True, {}, (), "measured")
    )
    synth = Synthesizer.from_checkpoint(released_06_dir, dtype="bfloat16", weights="int4")
    runner = PredictorRunner(synth.code_predictor, 40, "int4")
    assert runner.native_layers is None and {runner.qkv[0].kernel, runner.down[0].kernel} == {Kernel("int4dot")}
    offsets = Offsets(torch.randn(3, synth.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5)
    plain, _ = decode_frames(synth, None, 12)
    spec, stats = decode_frames(synth, Speculation(resolve_tree("15"), offsets), 12)
    assert np.array_equal(plain, spec) and stats.accepted_per_depth[0] > 0


@needs_kernel
def test_a_first_batch_runs_the_native_kernels_within_their_bounds_under_address_sanitizer(tiny_dir, tmp_path):
    """The library built with AddressSanitizer (RVQTTS_SANITIZE=address) and its runtime preloaded: a first batch on
    an empty cache (kernels, batch sizes and call costs measured in the run), tree rounds of three rows a call in
    bfloat16, runs the map kernels, norms, attention inputs and attention with no read or write out of bounds (any
    aborts the process with its place)."""
    compiler = os.environ.get("CXX") or "g++"
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True)
    runtime = found.stdout.strip()
    if found.returncode or not os.path.isabs(runtime):
        pytest.skip(f"{compiler} has no AddressSanitizer runtime")
    lines = tmp_path / "lines.txt"
    lines.write_text("The first line.\nA second, longer line of the batch.\nThree.\n")
    environment = {
        **os.environ,
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0",
        native.SANITIZE_VARIABLE: "address",
        "RVQTTS_CACHE": str(tmp_path / "cache"),
        "RVQTTS_CHOICES": "measured",
    }
    command = [sys.executable, "-m", "rvqtts.cli", "synth", "--model", tiny_dir, "--dtype", "bfloat16", "--tree", "4"]
    command += ["--batch-size", "3", "--max-frames", "8", "-f", lines, "--out-dir", tmp_path / "out"]
    command += ["--stats-json", tmp_path / "stats.json"]
    run = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=environment, timeout=600)
    assert run.returncode == 0 and "AddressSanitizer" not in run.stderr, run.stderr[-4000:]
    assert [p.name for p in (tmp_path / "cache" / "build").glob("native-*.so")], "no sanitized library was built"
    kernels = json.loads((tmp_path / "stats.json").read_text())["utterances"][0]["engine"]["kernels"]
    assert kernels["predictor"]["native"] and kernels["talker"]["native"], kernels
    assert any(name.startswith("bf16") for name in kernels["predictor"]["maps"]), "no native map kernel ran"
