"""Which device `--device auto` picks, and the notice a run on a device rvqtts has never run on prints."""

from __future__ import annotations

import pytest
import torch
from helpers import run_cli

from rvqtts.engine.devices import pick_device, unvalidated_notice
from rvqtts.synthesis import Synthesizer


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

    monkeypatch.setattr(Synthesizer, "load", stop)
    result = run_cli("synth", "Hi.", "--model", tiny_dir, "-o", tmp_path / "out.wav", "--dtype", "float32")
    assert result.exit_code == 2 and "stopped before the load" in result.output
    assert "MPS (float16 by default) has not been validated" in result.output
    assert "--device cpu runs the tested CPU path" in result.output
    plain = run_cli("synth", "Hi.", "--model", tiny_dir, "-o", tmp_path / "out.wav", "--device", "cpu")
    assert "has not been validated" not in plain.output
