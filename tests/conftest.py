"""Shared fixtures: tiny checkpoints built once per test run with rvqtts's own builder.

The README's test command runs two pytest-xdist workers (`-n 2 --dist loadfile`): each test module runs whole on
one worker, so its module fixtures (a Ray cluster, the stand-in, a trained drafter) are built once; the slowest
modules start first, so that the two workers end together; checkpoints are built once for both."""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Kernels and dtype by the fixed rules, not by a timing that could flip between processes (a Ray worker against its
# driver): tests that exercise measured choices set RVQTTS_CHOICES=measured themselves.
os.environ.setdefault("RVQTTS_CHOICES", "fixed")

from pathlib import Path

import pytest
import torch
from filelock import FileLock

from rvqtts.support.measurements import KERNELS
from rvqtts.synthesis.synthesizer import Synthesizer
from rvqtts.tuning.tiny import SHALLOW_LAYERS, build_tiny_model

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    # Each worker is a whole process: one thread each, so two workers share two cores instead of four threads
    # fighting over them; subprocesses inherit the count through the environment.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def run_folder(tmp_path_factory) -> Path:
    """The temporary folder every worker of this test run shares."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if WORKER else root


def built_once(tmp_path_factory, name: str, **options) -> Path:
    """A checkpoint built by `build_tiny_model(**options)` into a folder every worker of this run shares: the
    first worker to ask builds it, under a lock; the others wait and read it."""
    shared = run_folder(tmp_path_factory) / "models"
    shared.mkdir(exist_ok=True)
    folder, done = shared / name, shared / f"{name}.built"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            build_tiny_model(folder, **options)
            done.touch()
    return folder


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """An empty per-test cache folder: choices a user saved (`rvqtts bench speedup --save`) never steer tests."""
    monkeypatch.setenv("RVQTTS_CACHE", str(tmp_path / "rvqtts-cache"))
    return tmp_path / "rvqtts-cache"


def kernels_folder(tmp_path_factory) -> Path:
    """The run's shared cache of measured kernels (its kernels.json), which `measured` tests start from."""
    folder = run_folder(tmp_path_factory) / "kernels"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture
def measured(monkeypatch, user_cache, tmp_path_factory):
    """Kernels chosen by measurement, as users run, each shape timed once per test run: the test's cache starts
    with what the run has measured so far (as a user's second run reads their own cache) and what it measures is
    handed on. (The measurement itself is tested from an empty cache in tests/test_kernels.py.)"""
    monkeypatch.setenv("RVQTTS_CHOICES", "measured")
    folder = kernels_folder(tmp_path_factory)
    shared, mine = folder / KERNELS.file, KERNELS.path
    if shared.exists():  # written whole (write_json), so read without the lock
        mine.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared, mine)
    yield
    measured_here = KERNELS.read()
    if measured_here:
        with monkeypatch.context() as patch:  # merged into the run's store under rvqtts's own lock
            patch.setenv("RVQTTS_CACHE", str(folder))
            with KERNELS.update() as machines:
                for machine, records in measured_here.items():
                    machines[machine] = {**machines.get(machine, {}), **records}


@pytest.fixture(scope="session")
def released_06_kernels(released_06_dir, tmp_path_factory) -> Path:
    """The released 0.6B layout's folder, its kernels measured in bfloat16 and float32 into the run's shared cache
    first (half a minute a dtype on two vCPUs): tests of measured kernels at the released shapes ask for it with
    `measured`, so both workers do not time the same shapes at once."""
    from rvqtts.engine.loop.inner_loop import InnerLoop

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RVQTTS_CHOICES", "measured")
        patch.setenv("RVQTTS_CACHE", str(kernels_folder(tmp_path_factory)))  # measured under rvqtts's own lock
        for dtype in ("bfloat16", "float32"):
            synth = Synthesizer.from_checkpoint(released_06_dir, dtype=dtype)
            synth.runners.talker()
            InnerLoop(synth.code_predictor, None, seed=0)
    return released_06_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The default tiny checkpoint: 16 code groups, codebook 2048."""
    return built_once(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory):
    """Three residual codes over an 8-entry codebook: the joint distribution is enumerable (512 outcomes)."""
    return built_once(tmp_path_factory, "small", codebook=8, code_groups=4)


@pytest.fixture(scope="session")
def narrow_dir(tmp_path_factory):
    """16 code groups over a 16-entry codebook: drafts are often right, so deep acceptance paths run."""
    return built_once(tmp_path_factory, "narrow", codebook=16)


@pytest.fixture(scope="session")
def narrow(narrow_dir):
    return Synthesizer.from_checkpoint(narrow_dir)


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    """A tiny Base checkpoint (voice cloning): a speaker encoder, no speakers."""
    return built_once(tmp_path_factory, "base", kind="base")


@pytest.fixture(scope="session")
def voice_design_dir(tmp_path_factory):
    """A tiny VoiceDesign checkpoint (1.7B kind): it speaks the voice its instruction describes."""
    return built_once(tmp_path_factory, "voice-design", kind="voice-design")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return Synthesizer.from_checkpoint(tiny_dir)


@pytest.fixture(scope="session")
def small(small_dir):
    return Synthesizer.from_checkpoint(small_dir)


@pytest.fixture(scope="session")
def released_06_dir(tmp_path_factory):
    """The released 0.6B layout, shallow: real widths, heads, codec ids and speakers; one layer each in the talker and
    the code predictor (what a layer does at these widths, a second repeats: multi-layer caches are the tiny
    checkpoints' two layers)."""
    return built_once(tmp_path_factory, "released-0.6b", dims="0.6b", layers=1)


@pytest.fixture(scope="session")
def released_17_dir(tmp_path_factory):
    """The released 1.7B layout, shallow: a 2048-wide talker in front of the projected 1024-wide predictor."""
    return built_once(tmp_path_factory, "released-1.7b", dims="1.7b", layers=1)


@pytest.fixture(scope="session")
def paper_dir(tmp_path_factory):
    """The released 0.6B layout (two layers that barely act) whose code predictor drafts about as well as the paper
    reports for the released model (`make-tiny-model --acceptance paper`, docs/acceptance.md): deep acceptance at
    the released widths, where exactness is hard."""
    return built_once(tmp_path_factory, "paper-0.6b", dims="0.6b", layers=SHALLOW_LAYERS, acceptance="paper")


@pytest.fixture(scope="session")
def released_06(released_06_dir):
    return Synthesizer.from_checkpoint(released_06_dir)


@pytest.fixture(scope="session")
def released_17(released_17_dir):
    return Synthesizer.from_checkpoint(released_17_dir)


# The slowest modules, slowest first (seconds on two workers, 2026-12-03): started first, so that the workers end
# together (pyproject's --no-loadscope-reorder keeps this order; xdist's default orders modules by test count).
SLOW_MODULES = (
    "test_cluster",  # 186
    "test_coreml",  # 107
    "test_inner_loop",  # 73
    "test_kernels",  # 59
    "test_released",  # 58
    "test_exactness",  # new, 2026-12-04: about 60
    "test_faults",  # new, 2026-12-04: about 45
    "test_first_run",  # new, 2026-12-06: about 70 (every variant measured from an empty cache)
    "test_batch_rows",  # 55
    "test_server",  # about 90 since 2026-12-05 (a 500-request fuzz)
    "test_server_limits",  # new, 2026-12-06: about 55
    "test_server_chaos",  # new, 2026-12-06: about 36
    "test_standin",  # 35
    "test_cli",  # 32
    "test_cloning",  # 26
    "test_page",  # new, 2026-12-08: about 30 (a browser and four servers)
    "test_gpu_check",  # new, 2026-12-05: about 35
    "test_reading",  # new, 2026-12-07: about 35 (a kill -9 and a resume in a subprocess)
    "test_replicas",  # new, 2026-12-07: about 45 (two servers in their own processes)
)


def pytest_collection_modifyitems(items: list) -> None:
    """The slowest modules first, each in its own order (a stable sort; every worker collects the same)."""
    rank = {name: index for index, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(SLOW_MODULES)))
