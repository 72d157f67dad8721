"""Core ML export: the traced graphs handed to the converter give the engine's codes; packages export for
the tiny checkpoint and at the real 0.6B predictor dimensions; the package's declared inputs and outputs
are what the host feeds and reads (checked by running the host side against the traced graphs); and the
backend refuses clearly where Core ML cannot run. Prediction itself needs macOS (tests marked so)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from helpers import random_contexts, random_prefix, run_cli

from rvqtts.bench.harness import random_code_predictor
from rvqtts.engine.backends.coreml import (
    FIRST_INPUT,
    FUNCTIONS,
    INPUTS,
    OUTPUTS,
    CoreMLError,
    PackageKey,
    check_package,
    export_package,
    load_loop,
    package_calls,
    read_package,
    trace_calls,
)
from rvqtts.engine.backends.fused import FusedCalls, FusedLoop
from rvqtts.engine.loop.inner_loop import InnerLoop, count_frame
from rvqtts.engine.model.sampling import SamplingConfig, gumbel_noise
from rvqtts.engine.speculative.offsets import Offsets
from rvqtts.engine.speculative.speculation import LoopStats, Speculation
from rvqtts.engine.speculative.tree import resolve_tree
from rvqtts.synthesis.settings import GenerationSettings
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.contexts import save_contexts

macos = pytest.mark.skipif(sys.platform != "darwin", reason="Core ML prediction needs macOS")


def random_drafting(synth) -> Speculation:
    """Tree N = 8 with random nonzero offsets, so the drafts depend on them."""
    generator = torch.Generator().manual_seed(5)
    return Speculation(resolve_tree("8"), Offsets(torch.randn(3, synth.hidden_size, generator=generator) * 0.5))


def exported_drafting(synth) -> Speculation:
    """What `tiny_package` was exported for: tree N = 8 and zero offsets (none are shipped for tiny)."""
    return Speculation(resolve_tree("8"), Offsets.zeros(3, synth.hidden_size))


def package_path(tiny_package) -> Path:
    result, _ = tiny_package
    assert result.exit_code == 0, result.output
    return Path(result.output.strip().splitlines()[-1])


def codes_agreement(
    loop: FusedLoop, synth, speculation: Speculation, sampling: SamplingConfig, frames: int = 24
) -> tuple[int, int]:
    """Codes the fused loop and the engine agree on over the same frames and noise, and codes compared."""
    engine = InnerLoop(synth.code_predictor, speculation, seed=3)
    same = total = 0
    for frame in range(frames):
        prefix = random_prefix(synth, seed=frame)
        ours = loop.frame(prefix, frame_noise(frame, synth.code_predictor.config.vocab_size)).codes
        theirs = engine.frame(prefix, sampling, 0, frame)
        same += sum(a == b for a, b in zip(ours, theirs))
        total += len(theirs)
    return same, total


def frame_noise(frame: int, vocab: int) -> torch.Tensor:
    return torch.from_numpy(gumbel_noise(3, 0, frame, np.arange(1, 16), vocab))


def emulated_predictors(traced: FusedCalls, signatures) -> dict:
    """Core ML's `predict` stood in for by the traced graph the package was converted from: it gets the
    package's own named inputs (float16 arrays, int32 codes) and answers with its output names and types."""

    def predictor(module, signature):
        def predict(feed: dict) -> dict:
            args = [
                torch.from_numpy(feed[name]).to(torch.long if dtype == np.int32 else torch.float32)
                for name, _, dtype in signature.inputs
            ]
            outputs = module(*args)
            return {
                name: value.numpy().astype(np.int32 if value.dtype == torch.long else np.float16)
                for name, value in zip(signature.outputs, outputs)
            }

        return predict

    return {name: predictor(getattr(traced, name), signatures[name]) for name in FUNCTIONS}


@pytest.fixture(scope="module")
def tiny_package(tiny_dir, tmp_path_factory):
    """The tiny checkpoint exported in float16 for a tree of N = 8, through the CLI."""
    out = tmp_path_factory.mktemp("packages")
    result = run_cli("export-coreml", "--model", tiny_dir, "--out", out, "--tree", "8", "--precision", "fp16")
    return result, out


@pytest.mark.parametrize("which", ["tiny", "narrow", "released_17"])
def test_the_traced_graphs_give_the_engines_codes(which, request):
    synth = request.getfixturevalue(which)
    speculation, sampling = random_drafting(synth), SamplingConfig()
    traced, _ = trace_calls(synth.code_predictor, speculation.tree, speculation.offsets.vectors, sampling)
    assert all(isinstance(getattr(traced, name), torch.jit.ScriptModule) for name in FUNCTIONS)
    decoder = FusedLoop(traced, speculation.tree, sampling)
    engine = InnerLoop(synth.code_predictor, speculation, seed=3)
    plain = InnerLoop(synth.code_predictor, None, seed=3)
    stats, plain_stats = LoopStats(), LoopStats()
    vocab = synth.code_predictor.config.vocab_size
    frames = 8 if which == "released_17" else 24  # the wide layout's frames cost the most and prove the same
    for frame in range(frames):
        prefix = random_prefix(synth, seed=100 + frame)
        done = decoder.frame(prefix, frame_noise(frame, vocab))
        count_frame(stats, done)
        assert done.codes == engine.frame(prefix, sampling, 0, frame)
        if frame < 6:
            done = decoder.plain_frame(prefix, frame_noise(frame, vocab))
            count_frame(plain_stats, done)
            assert done.codes == plain.frame(prefix, sampling, 0, frame)
    assert stats == engine.stats and plain_stats == plain.stats
    if which == "narrow":
        assert sum(engine.stats.accepted_per_depth) > 20  # drafts from the traced graphs were accepted


def test_export_writes_a_package_with_the_declared_interface(tiny, tiny_package, tiny_dir):
    _, out = tiny_package
    path = package_path(tiny_package)
    assert path.parent == out and path.name.startswith("rvqtts-n8-fp16-") and path.is_dir()
    key, signatures = read_package(path)
    assert key == PackageKey.build(tiny.code_predictor, exported_drafting(tiny), SamplingConfig(), "fp16", "macOS15")
    for name in FUNCTIONS:
        assert [item[0] for item in signatures[name].inputs] == [FIRST_INPUT[name], *INPUTS]
        assert signatures[name].outputs == OUTPUTS[name]
    queries = {name: dict((n, s) for n, s, _ in signatures[name].inputs)["noise"][0] for name in FUNCTIONS}
    assert queries == {"prefill": 2, "round": 9, "step": 1}
    assert dict((n, t) for n, _, t in signatures["round"].inputs) == {
        "codes": np.int32,
        "index": np.int32,
        "k_cache": np.float16,
        "v_cache": np.float16,
        "mask": np.float16,
        "noise": np.float16,
    }
    again = run_cli("export-coreml", "--model", tiny_dir, "--out", out, "--tree", "8", "--precision", "fp16")
    assert again.exit_code == 0 and "already exported" in again.output


def test_the_host_runs_the_package_interface(tiny, tiny_package):
    """The host side of the Core ML backend (feeds built from the package's own declarations, outputs read
    back, fused frames decoded), with the traced graphs answering for Core ML: the engine's codes, up to
    float16 rounding of the cache and noise that the package's inputs impose."""
    speculation, sampling = exported_drafting(tiny), SamplingConfig()
    signatures = check_package(
        package_path(tiny_package), PackageKey.build(tiny.code_predictor, speculation, sampling, "w8a16", "macOS15")
    )
    traced, _ = trace_calls(tiny.code_predictor, speculation.tree, speculation.offsets.vectors, sampling)
    decoder = FusedLoop(package_calls(signatures, emulated_predictors(traced, signatures)), speculation.tree, sampling)
    assert decoder.k_cache.dtype == torch.float16
    same, total = codes_agreement(decoder, tiny, speculation, sampling)
    assert same / total >= 0.97, f"{same} of {total} codes agree"


def test_a_package_for_another_setup_is_refused(tiny, tiny_package):
    path = package_path(tiny_package)
    speculation = exported_drafting(tiny)
    hotter = PackageKey.build(tiny.code_predictor, speculation, SamplingConfig(temperature=1.2), "fp16", "macOS15")
    with pytest.raises(CoreMLError, match="sampling"):
        check_package(path, hotter)
    bigger = Speculation(resolve_tree("15"), speculation.offsets)
    with pytest.raises(CoreMLError, match="tree"):
        check_package(path, PackageKey.build(tiny.code_predictor, bigger, SamplingConfig(), "fp16", "macOS15"))
    with pytest.raises(CoreMLError, match="not a package rvqtts exported|no Core ML package"):
        read_package(path.parent / "missing.mlpackage")


def test_export_at_the_real_predictor_dimensions(tmp_path):
    """Random weights at the 0.6B predictor's widths (one of its five layers: each is exported alike, and the
    tiny checkpoint's packages have several), W8A16: about one byte per weight."""
    predictor = random_code_predictor("0.6b", torch.float32, "cpu", layers=1)
    weights = sum(p.numel() for p in predictor.parameters())
    exported = export_package(
        predictor,
        Speculation(resolve_tree("15"), Offsets.zeros(3, 1024)),
        SamplingConfig(),
        tmp_path,
        precision="w8a16",
    )
    assert 0.8 < exported.bytes / weights < 1.2, (exported.bytes, weights)
    key, signatures = read_package(exported.path)
    assert key.precision == "w8a16" and len(key.tree) == 15
    assert dict((n, s) for n, s, _ in signatures["round"].inputs)["k_cache"] == (1, 8, 17, 128)


def test_export_refuses_what_the_graph_cannot_do(tiny_dir, tmp_path):
    for options, message in [
        (["--top-k", "50", "--precision", "int4"], "unknown precision"),
        (["--min-target", "macOS14"], "macOS15 or later"),
        (["--temperature", "-1"], "temperature must be 0 (greedy) or positive"),
    ]:
        result = run_cli("export-coreml", "--model", tiny_dir, "--out", tmp_path / "out", *options)
        assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(CoreMLError, match="top-p"):
        export_package(None, None, SamplingConfig(top_p=0.9), tmp_path)
    with pytest.raises(CoreMLError, match="top-p"):  # nor is a given package run with it
        PackageKey.build(None, None, SamplingConfig(top_p=0.9), "fp16", "macOS15")


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_the_coreml_backend_needs_macos(tiny_dir, tmp_path):
    result = run_cli("synth", "Hello.", "--model", tiny_dir, "-o", tmp_path / "a.wav", "--backend", "coreml")
    assert result.exit_code == 2 and "Core ML runs only on macOS" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "a.wav").exists()
    with pytest.raises(CoreMLError, match="only on macOS"):
        load_loop(tmp_path, None, None, SamplingConfig())


@macos
def test_package_predictions_match_pytorch(tiny, tiny_package):
    speculation, sampling = exported_drafting(tiny), SamplingConfig()
    key = PackageKey.build(tiny.code_predictor, speculation, sampling, "fp16", "macOS15")
    decoder = load_loop(package_path(tiny_package), key, speculation.tree, sampling, "cpu_only")
    same, total = codes_agreement(decoder, tiny, speculation, sampling)
    assert same / total >= 0.95, f"{same} of {total} codes agree"


@macos
def test_synth_with_coreml_gives_the_torch_codes(tiny_dir, tmp_path):
    runs = {}
    for backend in ("torch", "coreml"):
        wav, codes = tmp_path / f"{backend}.wav", tmp_path / f"{backend}.npy"
        result = run_cli(
            "synth",
            "Hello there, how are you?",
            "--model",
            tiny_dir,
            "-o",
            wav,
            "--backend",
            backend,
            "--tree",
            "8",
            "--max-frames",
            "12",
            "--seed",
            "4",
            "--codes-out",
            codes,
            "--device",
            "cpu",
            "--compute-units",
            "cpu_only",
        )
        assert result.exit_code == 0, result.output
        assert soundfile.info(str(wav)).frames > 0
        runs[backend] = np.load(codes)
    assert runs["torch"].shape == runs["coreml"].shape
    assert (runs["torch"] == runs["coreml"]).mean() >= 0.9


def test_synthesis_runs_its_inner_loop_on_a_package(tiny_dir, tiny_package):
    """Synthesizer.using(fused=...) routes every frame to the package's calls (speculative, or the plain step without
    a speculation), and frames asking for other sampling than the package's are refused."""
    path = package_path(tiny_package)
    synth = Synthesizer.from_checkpoint(tiny_dir)
    synth = synth.using(exported_drafting(synth))
    settings = GenerationSettings(max_frames=12)

    def run(**options):
        return synth.synthesize("Hello there, how are you?", "ryan", "english", seed=4, **options)

    reference = run(settings=settings)
    signatures = read_package(path)[1]
    traced, _ = trace_calls(
        synth.code_predictor, synth.speculation.tree, synth.speculation.offsets.vectors, SamplingConfig()
    )
    package = FusedLoop(
        package_calls(signatures, emulated_predictors(traced, signatures)), synth.speculation.tree, SamplingConfig()
    )
    synth, drafting = synth.using(synth.speculation, package), synth
    spec = run(settings=settings)
    assert spec.codes.shape == reference.codes.shape and (spec.codes == reference.codes).mean() >= 0.9
    assert spec.stats.calls < spec.stats.codes  # tree rounds ran on the package
    synth = drafting.using(None, package)
    plain = run(settings=settings)
    assert plain.stats.calls == plain.stats.codes == 15 * plain.codes.shape[0]
    assert (plain.codes == spec.codes).mean() >= 0.9
    synth = drafting.using(drafting.speculation, package)
    with pytest.raises(ValueError, match="export a package for these settings"):
        run(settings=GenerationSettings(temperature=1.3, max_frames=2))


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS, PyTorch float16 stands in for the package")
def test_bench_coreml_measures_agreement_with_the_float32_engine(tiny, tiny_dir, tmp_path):
    save_contexts(random_contexts(tiny, 12), tmp_path / "frames.npz")
    result = run_cli(
        "bench",
        "coreml",
        "--model",
        tiny_dir,
        "--contexts",
        tmp_path / "frames.npz",
        "--tree",
        "8",
        "--frames",
        "10",
        "--json",
        tmp_path / "agreement.json",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "agreement.json").read_text())
    assert figures["candidate"] == "pytorch float16 (proxy)" and figures["frames"] == 10
    # every call gives a code at least, and the candidate's tree rounds on the same frames accept what the float32
    # engine's accept, near ties aside
    assert figures["tree_nodes"] == 8 and figures["codes_per_call"] >= 1 and figures["engine_codes_per_call"] >= 1
    assert figures["codes_per_call"] == pytest.approx(figures["engine_codes_per_call"], rel=0.1)
    for mode in ("spec", "plain"):  # float16 flips a few near ties at most; miswired calls would agree by chance
        codes, frames = figures[f"{mode}_code_agreement"], figures[f"{mode}_frame_agreement"]
        assert codes >= 0.9 and figures[f"{mode}_ms_per_frame"] > 0
        # a whole number of the 10 frames; a frame agrees when its 15 codes all do, and each code that
        # differs spoils one frame at most
        assert 10 * frames == pytest.approx(round(10 * frames), abs=1e-3)
        assert 1 - 15 * (1 - codes) - 1e-3 <= frames <= codes + 1e-3, (mode, codes, frames)
