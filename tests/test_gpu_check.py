"""The GPU check prepared for a lent GPU machine (scripts/gpu-check.sh, issue 46): its install constraints agree with
what qwen-tts and transformers require and with the environment the suite runs in, and its identity checks run and
report on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def constraints() -> dict[str, Requirement]:
    lines = (ROOT / "scripts" / "gpu-constraints.txt").read_text().splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {pin.name.lower(): pin for pin in pins}


def declared(package: str) -> dict[str, Requirement]:
    found = [Requirement(text) for text in requires(package) or [] if "extra ==" not in text]
    return {requirement.name.lower(): requirement for requirement in found}


def test_the_gpu_constraints_are_what_qwen_tts_and_its_transformers_ask_and_leave_torch_alone():
    pins = constraints()
    assert "torch" not in pins  # the image's CUDA torch stays
    qwen, transformers = declared("qwen-tts"), declared("transformers")
    assert pins["transformers"].specifier == qwen["transformers"].specifier
    assert pins["accelerate"].specifier == qwen["accelerate"].specifier
    for name in ("huggingface-hub", "tokenizers"):
        assert pins[name].specifier == transformers[name].specifier, name
    for name, pin in pins.items():  # the suite's own environment is one such install
        assert pin.specifier.contains(version(name), prereleases=True), (name, version(name))


def test_the_wheels_carried_to_the_gpu_are_pinned_and_rvqtts_ones_meet_the_constraints():
    """Each wheel list (scripts/gpu-wheels/) names exact versions, once across the lists; rvqtts's own are a set the
    constraints allow, and faster-qwen3-tts's stay out of rvqtts's environment."""
    groups = {}
    for name in ("common", "rvqtts", "faster"):
        lines = (ROOT / "scripts" / "gpu-wheels" / f"{name}.txt").read_text().splitlines()
        groups[name] = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    pins = [pin for group in groups.values() for pin in group]
    assert all(len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==" for pin in pins)
    assert len({pin.name.lower() for pin in pins}) == len(pins)
    allowed = constraints()
    for pin in groups["rvqtts"] + groups["common"]:
        if pin.name.lower() in allowed:
            assert allowed[pin.name.lower()].specifier.contains(next(iter(pin.specifier)).version), pin
    assert {"qwen-tts", "transformers"} <= {pin.name for pin in groups["rvqtts"]}
    assert "faster-qwen3-tts" in {pin.name for pin in groups["faster"]}


def run_check(out: Path, steps: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.update(DEVICE="cpu", MODEL_DIMS="tiny", FRAMES="4", STEPS=steps, OUT=str(out))
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)


def test_the_gpu_check_runs_its_identity_checks_on_a_cpu_and_reports_a_failing_step(tmp_path):
    done = run_check(tmp_path / "figures", "checkpoints identity")
    summary = (tmp_path / "figures" / "summary.tsv").read_text()
    assert done.returncode == 0, (summary, done.stdout, done.stderr)
    assert [line.split("\t")[:2] for line in summary.splitlines()] == [["checkpoints", "ok"], ["identity", "ok"]]
    log = (tmp_path / "figures" / "identity.log").read_text()
    assert "1 utterance(s): the same codes" in log and "4 utterance(s): the same codes" in log
    failed = run_check(tmp_path / "empty", "identity")  # no checkpoint: the step fails, and the check says so
    assert failed.returncode != 0 and "identity\tfailed" in (tmp_path / "empty" / "summary.tsv").read_text()
