"""Which device `--device auto` picks, and the notice a run on a device rvqtts has never run on prints."""

from __future__ import annotations

import pytest
import torch
from helpers import run_cli

from rvqtts.engine.model.devices import pick_device, unvalidated_notice
from rvqtts.engine.model.kernels import machine_key
from rvqtts.synthesis import loader


@pytest.mark.parametrize("present, picked", [((True, True), "cuda"), ((False, True), "mps"), ((False, False), "cpu")])
def test_auto_picks_cuda_then_mps_then_the_cpu(monkeypatch, present, picked):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present[0])
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: present[1])
    assert pick_device("auto") == picked
    assert (unvalidated_notice(picked) is None) == (picked == "cpu")


def test_a_run_on_an_unvalidated_device_says_so_and_how_to_choose_the_cpu(tiny_dir, monkeypatch, tmp_path):
    """`auto` on a Mac picks MPS, which no rvqtts run has used: the user is told before the model loads (stopped
    here at the load, as this machine has no MPS)."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def stop(*_: object, **__: object) -> None:
        raise ValueError("stopped before the load")

    monkeypatch.setattr(loader, "load_tts", stop)
    result = run_cli("synth", "Hi.", "--model", tiny_dir, "-o", tmp_path / "out.wav", "--dtype", "float32")
    assert result.exit_code == 2 and "stopped before the load" in result.output
    assert "MPS (float16 by default) has not been validated" in result.output
    assert "--device cpu runs the tested CPU path" in result.output
    plain = run_cli("synth", "Hi.", "--model", tiny_dir, "-o", tmp_path / "out.wav", "--device", "cpu")
    assert "has not been validated" not in plain.output


@pytest.fixture
def capped(monkeypatch):
    """Run a test with $RVQTTS_ISA set (`capped("avx2")`), native kernels loaded anew for it and after it."""
    from rvqtts.engine.model import native

    def cap(value: str) -> None:
        monkeypatch.setenv("RVQTTS_ISA", value)
        native._load.cache_clear()

    yield cap
    monkeypatch.delenv("RVQTTS_ISA", raising=False)
    native._load.cache_clear()


def test_rvqtts_isa_avx2_makes_an_avx512_cpu_play_an_avx2_one(capped, monkeypatch):
    """The cap hides AVX-512 and AMX from every choice rvqtts makes by the CPU's flags: the native library's AVX2 build
    (its AVX2 kernels, no AVX-512 one), no bfloat16 instruction for the fixed dtype rule; `avx512` hides AMX alone;
    `none` every native kernel, with the reason."""
    from rvqtts.engine.model import native
    from rvqtts.engine.model.devices import native_bf16_flag

    flags = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}
    cpuinfo = "flags\t\t: " + " ".join(sorted(flags)) + "\n"
    capped("avx2")
    assert native.capped_flags(flags) == {"avx2", "fma"} and native_bf16_flag(cpuinfo) is None
    if native.unavailable() is None:
        assert native.level() == "avx2" and native.supports((1024, 1024), torch.bfloat16, "bf16avx2")
        assert "(capped at avx2 by RVQTTS_ISA)" in native.amx_unavailable()
    assert not native.supports((1024, 1024), torch.bfloat16, "bf16dot")
    capped("none")
    assert native.capped_flags(flags) == set() and native.level() is None
    assert "(capped at none by RVQTTS_ISA)" in native.unavailable() or "x86-64" in native.unavailable()
    assert not native.supports((1024, 1024), torch.bfloat16, "bf16avx2")
    capped("avx512")
    assert native.capped_flags(flags) == flags - {"amx_tile", "amx_bf16"} and native_bf16_flag(cpuinfo) == "avx512_bf16"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # as the suite may itself run capped
    assert machine_key().endswith(" threads | RVQTTS_ISA=avx512 | ATEN_CPU_CAPABILITY=avx2")  # measured apart


def test_an_unknown_rvqtts_isa_says_what_to_set(capped, tiny_dir, tmp_path):
    from rvqtts.engine.model import native

    capped("sse2")
    assert native.unavailable() == "RVQTTS_ISA='sse2': choose avx2 or avx512 or none, or unset it for what the CPU has"
    result = run_cli("synth", "Hi.", "--model", tiny_dir, "-o", tmp_path / "out.wav")
    assert result.exit_code == 2 and "RVQTTS_ISA='sse2': choose avx2 or avx512 or none" in result.output
    assert not (tmp_path / "out.wav").exists()


def test_a_cpu_without_avx2_runs_torchs_kernels_and_says_so(capped, tiny_dir, tmp_path):
    capped("none")
    result = run_cli("synth", "Hi.", "--model", tiny_dir, "--max-frames", "4", "-o", tmp_path / "out.wav")
    assert result.exit_code == 0, result.output
    assert "native CPU kernels do not run here (the CPU " in result.output
    assert "lacks avx2, fma (capped at none by RVQTTS_ISA)" in result.output or "not x86-64" in result.output
    assert (tmp_path / "out.wav").exists()


def test_a_cpu_that_is_not_x86_64_takes_torchs_kernels_without_a_build(capped, monkeypatch):
    """ARM (Apple silicon, Graviton): no native build is attempted, the reason says why, and every map shape gets
    torch's kernels by the same measurement."""
    import platform

    from rvqtts.engine.model import native

    def no_build(*_) -> None:
        raise AssertionError("a native build was attempted on a CPU that is not x86-64")

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(native, "_build", no_build)
    native._load.cache_clear()
    assert native.unavailable() == "the CPU is aarch64, not x86-64" and native.amx_unavailable() is not None
    assert not any(native.supports((1024, 1024), torch.bfloat16, kind) for kind in native.KINDS)
