"""Shared fixtures: tiny checkpoints built once per test session with rvqtts's own builder."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Kernels and dtype by the fixed rules, not by a timing that could flip between processes (a Ray worker against its
# driver): tests that exercise measured choices set RVQTTS_CHOICES=measured themselves.
os.environ.setdefault("RVQTTS_CHOICES", "fixed")

import pytest

from rvqtts.synthesis import Synthesizer
from rvqtts.tuning.tiny import build_tiny_model


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """An empty per-test cache folder: choices a user saved (`rvqtts bench speedup --save`) never steer tests."""
    monkeypatch.setenv("RVQTTS_CACHE", str(tmp_path / "rvqtts-cache"))
    return tmp_path / "rvqtts-cache"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The default tiny checkpoint: 16 code groups, codebook 2048."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory):
    """Three residual codes over an 8-entry codebook: the joint distribution is enumerable (512 outcomes)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "small", codebook=8, code_groups=4)


@pytest.fixture(scope="session")
def narrow(tmp_path_factory):
    """16 code groups over a 16-entry codebook: drafts are often right, so deep acceptance paths run."""
    return Synthesizer.load(build_tiny_model(tmp_path_factory.mktemp("models") / "narrow", codebook=16))


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory):
    """A tiny Base checkpoint (voice cloning): a speaker encoder, no speakers."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "base", kind="base")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return Synthesizer.load(tiny_dir)


@pytest.fixture(scope="session")
def small(small_dir):
    return Synthesizer.load(small_dir)


@pytest.fixture(scope="session")
def released_06_dir(tmp_path_factory):
    """The released 0.6B layout, shallow: real widths, heads, codec ids and speakers; two layers each."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "released-0.6b", dims="0.6b", shallow=True)


@pytest.fixture(scope="session")
def released_17_dir(tmp_path_factory):
    """The released 1.7B layout, shallow: a 2048-wide talker in front of the projected 1024-wide predictor."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "released-1.7b", dims="1.7b", shallow=True)


@pytest.fixture(scope="session")
def released_06(released_06_dir):
    return Synthesizer.load(released_06_dir)


@pytest.fixture(scope="session")
def released_17(released_17_dir):
    return Synthesizer.load(released_17_dir)
