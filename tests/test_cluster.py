"""`rvqtts synth -f --ray` on a local Ray cluster this module starts (2 CPUs, the tiny checkpoint): the same
files as a local run, a failing line, a worker killed in the middle of a line, a driver killed in the middle of a
line and resumed, no Ray; a document read on the cluster (`rvqtts read --ray`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from faults import FAULTS, arm, disarm, failing_prompts, wait_for_stall
from helpers import TIMINGS, run_cli

import rvqtts.synthesis.pipeline as pipeline
from rvqtts.serving.cluster import ClusterError, WorkerSpec, synthesize_batch_on_ray
from rvqtts.synthesis.batch_files import MANIFEST, read_batch
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.text import MAX_CHUNK_WEIGHT

LINES = [
    {"text": "One."},
    {"text": "Break."},
    {"text": "Three.", "speaker": "ryan"},
    {"text": "Four.", "out": "four.flac"},
    {"text": "Five.", "language": "german"},
]
OUTPUTS = ["0001.wav", "0003.wav", "0005.wav", "four.flac"]  # line 2 fails, everywhere
FRAMES = 12  # --max-frames: short lines keep the module fast
RUN = Line(speaker="vivian", settings=GenerationSettings(max_frames=FRAMES))  # what `rvqtts synth --max-frames 12` runs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 2-CPU Ray cluster on this machine whose workers fail the line "Break." and stall where a test armed a
    fault (tests/faults.py); yields its address and the job's runtime environment (for a second driver)."""
    here = str(Path(__file__).parent)
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
        "RVQTTS_CACHE": str(tmp_path_factory.mktemp("worker-cache")),
        "HF_HUB_OFFLINE": "1",
        FAULTS: str(tmp_path_factory.mktemp("faults")),
    }
    runtime_env = {"env_vars": env, "worker_process_setup_hook": "faults.break_lines"}
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR, runtime_env=runtime_env
    )
    yield ray.get_runtime_context().gcs_address, runtime_env
    ray.shutdown()


@pytest.fixture
def faults(cluster) -> Path:
    """The folder the workers' faults are armed in; a fault no worker took is disarmed after the test."""
    folder = Path(cluster[1]["env_vars"][FAULTS])
    yield folder
    disarm(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "lines.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


@pytest.fixture(scope="module")
def local(corpus, tiny_dir):
    """What a local run writes, with the workers' one torch thread (float32 audio depends on the count)."""
    out = corpus.parent / "local"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline, "line_prompts", failing_prompts(pipeline.line_prompts))
            result = run_cli("synth", "-f", corpus, "--out-dir", out, "--model", tiny_dir, "--max-frames", FRAMES)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 1 and "lines.jsonl:2: failed" in result.output, result.output
    return out


def manifest(folder: Path) -> list[dict]:
    """The manifest's entries without their timings, in the file's order."""
    entries = [json.loads(line) for line in (folder / MANIFEST).read_text().splitlines()]
    return [{k: v for k, v in entry.items() if k not in TIMINGS} for entry in entries]


def assert_same_outputs(folder: Path, local: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted([*OUTPUTS, MANIFEST])  # no partial files
    for name in OUTPUTS:
        assert (folder / name).read_bytes() == (local / name).read_bytes(), name
    assert manifest(folder) == manifest(local)
    assert [entry["line"] for entry in manifest(folder)] == [1, 3, 4, 5]


def test_a_ray_batch_writes_a_local_runs_files_and_reports_its_failing_line(cluster, corpus, local, tiny_dir, tmp_path):
    out, stats = tmp_path / "out", tmp_path / "stats.json"
    result = run_cli(
        "synth",
        "-f",
        corpus,
        "--out-dir",
        out,
        "--model",
        tiny_dir,
        "--max-frames",
        FRAMES,
        "--ray",
        "auto",
        "--workers",
        2,
        "--stats-json",
        stats,
    )
    assert result.exit_code == 1, result.output
    assert "lines.jsonl:2: failed: RuntimeError: simulated failure" in result.output
    assert "4 written, 0 skipped" in result.output and "1 failed" in result.output
    assert_same_outputs(out, local)
    report = json.loads(stats.read_text())
    workers = report["workers"]
    assert len(workers) == 2 and sum(w["lines"] for w in workers) == 4 and sum(w["failed"] for w in workers) == 1
    loaded = [w for w in workers if w["pid"]]  # (a worker may still be loading when the last line is done)
    assert loaded and {w["threads"] for w in loaded} == {1} and len({w["pid"] for w in loaded}) == len(loaded)
    assert report["cluster"]["lines"] == 4 and report["cluster"]["lines_per_second"] > 0


def test_a_worker_killed_mid_line_has_the_line_made_by_another(cluster, faults, corpus, local, tiny_dir, tmp_path):
    """The batch's one worker is SIGKILLed while it makes line 3 (stalled at its start: tests/faults.py): the line
    goes to the worker started in its place, which makes it and the rest, the files a local run's."""
    marker = arm(faults, "synthesize-3")
    killed = []

    def kill_the_stalled_worker() -> None:
        try:
            killed.append(wait_for_stall(marker))
            os.kill(killed[0], signal.SIGKILL)
        except AssertionError as error:  # said by the test's assertion below
            killed.append(error)

    killer = threading.Thread(target=kill_the_stalled_worker, daemon=True)
    killer.start()
    out = tmp_path / "out"
    batch = synthesize_batch_on_ray(
        read_batch(corpus), out, WorkerSpec(str(tiny_dir)), RUN, MAX_CHUNK_WEIGHT, workers=1
    )
    killer.join(timeout=60)
    assert killed and isinstance(killed[0], int), killed
    assert [r.status for r in batch.results] == ["done", "failed", "done", "done", "done"]
    assert_same_outputs(out, local)
    totals = batch.totals()
    assert totals["workers_died"] == 1 and totals["retried_lines"] == 1 and totals["workers"] == 2
    first, second = batch.workers
    assert (first.pid, first.alive, second.alive) == (killed[0], False, True)
    assert [r.worker for r in batch.results] == [first, first, second, second, second]  # line 3: the new worker's


DRIVER = """
import json, sys
from pathlib import Path
import ray
from rvqtts.synthesis.batch_files import read_batch
from rvqtts.serving.cluster import WorkerSpec, synthesize_batch_on_ray
from rvqtts.synthesis.settings import GenerationSettings, Line
from rvqtts.synthesis.text import MAX_CHUNK_WEIGHT

address, runtime_env, corpus, out, model, frames = sys.argv[1:]
ray.init(address=address, runtime_env=json.loads(runtime_env), log_to_driver=False)
run = Line(speaker="vivian", settings=GenerationSettings(max_frames=int(frames)))
synthesize_batch_on_ray(read_batch(corpus), Path(out), WorkerSpec(model), run, MAX_CHUNK_WEIGHT, workers=1)
"""


def test_a_driver_killed_mid_line_leaves_whole_files_and_a_rerun_finishes_the_batch(
    cluster, faults, corpus, local, tiny_dir, tmp_path
):
    """The driver (a second process on this cluster) is SIGKILLed while its worker makes line 3 (stalled at its
    start: tests/faults.py): line 1's file and entry are there, nothing partial; a rerun makes the rest, the files
    a local run's."""
    address, runtime_env = cluster
    out = tmp_path / "out"
    marker = arm(faults, "synthesize-3")
    arguments = [address, json.dumps(runtime_env), str(corpus), str(out), str(tiny_dir), str(FRAMES)]
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        worker = wait_for_stall(marker, driver, timeout=240)
        driver.kill()
        _, stderr = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    try:
        os.kill(worker, signal.SIGKILL)  # Ray ends a dead driver's workers; this one must not hold a CPU until then
    except ProcessLookupError:
        pass
    assert driver.returncode == -signal.SIGKILL, stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["0001.wav", MANIFEST]  # whole files only
    assert (out / "0001.wav").read_bytes() == (local / "0001.wav").read_bytes()
    assert manifest(out) == manifest(local)[:1]
    resumed = run_cli(
        "synth",
        "-f",
        corpus,
        "--out-dir",
        out,
        "--model",
        tiny_dir,
        "--max-frames",
        FRAMES,
        "--ray",
        "auto",
        "--workers",
        1,
    )
    assert resumed.exit_code == 1 and "3 written, 1 skipped" in resumed.output, resumed.output
    assert_same_outputs(out, local)


def test_a_model_that_overflows_or_does_not_load_stops_the_batch_with_one_line(cluster, tiny_dir, tmp_path):
    overflow = tmp_path / "overflow.txt"
    overflow.write_text("Overflow.\n")
    result = run_cli(
        "synth", "-f", overflow, "--out-dir", tmp_path / "out", "--model", tiny_dir, "--ray", "auto", "--workers", 1
    )
    assert result.exit_code == 1, result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .startswith("rvqtts: error: the talker produced NaN or inf values in float16")
    )
    with pytest.raises(ClusterError, match="a worker could not load the model .*: ModelLoadError: .*missing"):
        synthesize_batch_on_ray(
            read_batch(overflow),
            tmp_path / "out",
            WorkerSpec(str(tmp_path / "missing")),
            RUN,
            MAX_CHUNK_WEIGHT,
            workers=1,
        )
    assert not list((tmp_path / "out").glob("*"))  # nothing written


def test_ray_options_are_checked_before_anything_runs(tmp_path, tiny_dir, monkeypatch):
    lines = tmp_path / "lines.txt"
    lines.write_text("One.\n")
    out = tmp_path / "out"
    batch = ["synth", "-f", lines, "--out-dir", out, "--model", tiny_dir]
    cases = [
        ([*batch, "--workers", 2], "--workers, --cpus-per-worker and --gpus-per-worker are for --ray"),
        (["synth", "Hi.", "-o", tmp_path / "a.wav", "--ray", "auto"], "--ray is for batch files"),
        ([*batch, "--ray", "auto", "--workers", 0], "--workers must be at least 1"),
        ([*batch, "--ray", "auto", "--device", "cuda"], "needs GPUs for the workers"),
        ([*batch, "--ray", "auto", "--device", "cuda:1", "--gpus-per-worker", 1], "choose auto, cpu or cuda"),
        ([*batch, "--ray", "auto", "--tree", tmp_path / "none.json"], "no such tree file"),
        ([*batch, "--ray", "auto", "--dtype", "float8"], "unknown --dtype"),
    ]
    for arguments, message in cases:
        result = run_cli(*arguments)
        assert result.exit_code == 2 and message in result.output, (arguments, result.output)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    result = run_cli(*batch, "--ray", "auto")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "rvqtts: error: --ray needs Ray, which is not installed: pip install -e '.[ray]' "
        "(from rvqtts's checkout folder; rvqtts is not on PyPI)"
    )
    assert not out.exists()


def test_a_ray_batch_speaks_cloned_voices_as_a_local_run_does(cluster, base_dir, tmp_path):
    import numpy as np
    import soundfile

    from rvqtts.qwen.cloning import ClonedVoice, VoiceError, VoiceSource, save_voice
    from rvqtts.serving.cluster import SynthesisWorker

    base = base_dir
    samples = np.random.default_rng(0).standard_normal(30000).astype(np.float32) * 0.1
    soundfile.write(tmp_path / "ref.wav", samples, 24000)
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "One."}\n{"text": "Two.", "ref_audio": "ref.wav", "x_vector_only": true}\n')
    batch = [
        "synth",
        "-f",
        lines,
        "--model",
        base,
        "--max-frames",
        6,
        "--ref-audio",
        tmp_path / "ref.wav",
        "--ref-text",
        "Hello there.",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' thread count (float32 audio depends on it)
    try:
        here = run_cli(*batch, "--out-dir", tmp_path / "here")
    finally:
        torch.set_num_threads(threads)
    there = run_cli(*batch, "--out-dir", tmp_path / "there", "--ray", "auto", "--workers", 1)
    assert here.exit_code == 0 and there.exit_code == 0, (here.output, there.output)
    for name in ("0001.wav", "0002.wav"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes(), name
    assert manifest(tmp_path / "here") == manifest(tmp_path / "there")
    # a worker encodes the batch's voices while it loads: a voice it cannot use fails its load (which the
    # driver turns into one line, as for a model that does not load: the test above)
    save_voice(ClonedVoice(torch.zeros(64), None, None, "0" * 16, "elsewhere.wav"), tmp_path / "other.safetensors")
    worker = SynthesisWorker(WorkerSpec(str(base), voices=(VoiceSource(voice=tmp_path / "other.safetensors"),)))
    try:
        with pytest.raises(VoiceError, match="another model's speaker encoder"):
            worker.load()
    finally:
        torch.set_num_threads(threads)  # load() gives this process the worker's thread count


def test_a_driver_whose_ray_node_dies_stops_with_one_line_and_keeps_its_files(tiny_dir, tmp_path):
    """The raylet of the cluster `--ray auto` started is killed mid-batch: the driver stops within seconds
    (it had waited forever), exit 1, saying what happened; the files written stay whole."""
    import psutil

    out = tmp_path / "out"
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Line {n} of the batch.\n" for n in range(1, 9)))
    env = {
        **os.environ,
        "RAY_ADDRESS": "local",  # a cluster of its own, not this module's
        # Ray's health checks quickened, so the node is marked dead within a second or two of its raylet (Ray's
        # default waits about 15 s): the driver noticing that it died is what this test is about
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "2",
    }
    driver = subprocess.Popen(
        [
            shutil.which("rvqtts"),
            "synth",
            "-f",
            str(lines),
            "--out-dir",
            str(out),
            "--model",
            str(tiny_dir),
            "--max-frames",
            "60",
            "--ray",
            "auto",
            "--workers",
            "1",
            "-q",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("*.wav")) and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
        raylets = [p for p in psutil.Process(driver.pid).children(recursive=True) if "raylet" in " ".join(p.cmdline())]
        assert len(raylets) == 1 and driver.poll() is None, (
            raylets,
            driver.poll(),
            sorted(p.name for p in out.glob("*")),
        )
        raylets[0].kill()
        _, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 1 and "the Ray node on this machine died" in stderr, stderr[-2000:]
    written = [p for p in out.iterdir() if p.suffix == ".wav"]
    assert written and len(manifest(out)) == len(written), (written, manifest(out))  # whole files, each with its entry


def test_a_worker_speaks_its_lines_together_as_each_alone(cluster, tiny_dir, measured):
    """A worker given several lines speaks them `rows` at a time (measured kernels, row-invariant): each
    line's file is the one it makes alone."""
    from rvqtts.serving.cluster import SynthesisWorker
    from rvqtts.synthesis.batch_files import attempt

    worker = SynthesisWorker(WorkerSpec(str(tiny_dir), EngineChoices(batch_size=3)))
    assert worker.load()["rows"] == 3
    texts = ["One.", "A second line, longer.", "3."]
    items = [Line(text=text, utterance=n, name=f"{n:04d}.wav") for n, text in enumerate(texts, 1)]
    status, answers = worker.render(items, RUN, MAX_CHUNK_WEIGHT)
    assert status == "lines" and [line for line, _, _ in answers] and {s for _, s, _ in answers} == {"done"}
    made = {line: value for line, _, value in answers}
    for item in items:
        ((_, (_, alone)),) = attempt(worker.synth, [item], RUN, MAX_CHUNK_WEIGHT, 1)
        assert made[item.name].audio == alone.audio and made[item.name].record["batch_rows"] == 3


def test_workers_take_shares_of_lines_up_to_their_batch_size(cluster, tiny_dir, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Line {n}.\n" for n in range(1, 8)))
    out = tmp_path / "out"
    batch = synthesize_batch_on_ray(
        read_batch(lines), out, WorkerSpec(str(tiny_dir), EngineChoices(batch_size=3)), RUN, MAX_CHUNK_WEIGHT, workers=2
    )
    assert [r.status for r in batch.results] == ["done"] * 7
    assert sorted(p.name for p in out.glob("*.wav")) == [f"{n:04d}.wav" for n in range(1, 8)]
    loaded = [w for w in batch.workers if w.pid]
    assert loaded and {w.rows for w in loaded} == {3} and sum(w.lines for w in batch.workers) == 7
    assert [e["line"] for e in manifest(out)] == list(range(1, 8))


def test_a_document_read_on_ray_writes_a_local_readings_files(cluster, tiny_dir, tmp_path):
    book = tmp_path / "book.md"
    book.write_text("# Book\n\n## One\n\nFirst words. More words.\n\nA second paragraph.\n\n## Two\n\nLast words.\n")
    arguments = ("read", book, "--model", tiny_dir, "--max-frames", 6, "--seed", 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: the speech decoder's last bits depend on it
    try:
        here = run_cli(*arguments, "--out-dir", tmp_path / "here")
    finally:
        torch.set_num_threads(threads)
    assert here.exit_code == 0, here.output
    on_ray = run_cli(*arguments, "--out-dir", tmp_path / "ray", "--ray", "auto", "--workers", 1)
    assert on_ray.exit_code == 0 and "2 chapters made" in on_ray.output, on_ray.output
    for folder in ("", ".chunks"):
        made = sorted(p.name for p in (tmp_path / "ray" / folder).iterdir() if p.suffix != ".json")
        assert made == sorted(p.name for p in (tmp_path / "here" / folder).iterdir() if p.suffix != ".json")
        for name in made:
            if (tmp_path / "ray" / folder / name).is_file():
                assert (tmp_path / "ray" / folder / name).read_bytes() == (
                    tmp_path / "here" / folder / name
                ).read_bytes()


class _FakeRay:
    """Just enough of Ray for the driver's loop, run in this process: each worker's load and render answered from a
    script of outcomes (an answer, or an exception to raise from `get`), in the order the calls were made."""

    def __init__(self, loads: list, renders: list):
        self.loads, self.renders, self.started = list(loads), list(renders), 0
        self.answers: dict[int, object] = {}

    def remote(self, _cls):
        ray = self

        class Actor:
            def load(self_):
                return ray.call(ray.loads.pop(0))

            def render(self_, items, defaults, chunk_chars):
                outcome = ray.renders.pop(0)
                return ray.call(outcome(items) if callable(outcome) else outcome)

        class Handle:
            def __init__(self_):
                self_.load = type("M", (), {"remote": lambda _: Actor().load()})()
                self_.render = type("M", (), {"remote": lambda _, *a: Actor().render(*a)})()

        class Maker:
            def options(self_, **_):
                return self_

            def remote(self_, _spec):
                ray.started += 1
                return Handle()

        return Maker()

    def call(self, outcome) -> int:
        ref = self.calls = getattr(self, "calls", 0) + 1
        self.answers[ref] = outcome
        return ref

    def wait(self, refs, num_returns, timeout):
        return refs[:1], refs[1:]

    def get(self, ref):
        outcome = self.answers.pop(ref)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def kill(self, actor):
        pass

    def cluster_resources(self):
        return {"CPU": 2}


def _load_answer(identity: dict) -> dict:
    from importlib.metadata import version

    return {"node": "n", "pid": 1, "device": "cpu", "dtype": "float32", "decoder_dtype": "float32", "threads": 1,
            "rows": 2, "rvqtts": version("rvqtts"), "notices": [], "instruct": True, "identity": identity,
            "sample_rate": 24000}  # fmt: skip


def test_a_planned_drivers_dead_loader_is_replaced_and_its_own_failures_are_concluded():
    """A driver whose lines are planned at the first load (rvqtts read --ray): a worker that dies loading is replaced
    before there is any line to give it, lines whose workers die three times are concluded as failed by the caller's
    `conclude` (a document's chapter fails with them), and a worker that loads the model otherwise than the one the
    work was planned for stops the run."""
    from ray.exceptions import RayActorError

    from rvqtts.serving.cluster import ClusterBatch, _Driver
    from rvqtts.synthesis.batch_files import BatchResult

    identity, lost = {"engine": {"dtype": "float32"}}, RayActorError()
    lines = [Line(text="A.", name="a.wav"), Line(text="B.", name="b.wav")]
    fake = _FakeRay([lost, *[_load_answer(identity)] * 3], [lost] * 3)
    concluded, planned = [], []

    def conclude(line, status, value, worker):
        concluded.append((line.name, status))
        return BatchResult(line, status, {"audio_seconds": 1.0}, error=value)

    driver = _Driver(
        fake,
        lambda answer: planned.append(answer) or lines,
        WorkerSpec("m"),
        RUN,
        240,
        conclude,
        None,
        ClusterBatch([]),
    )
    driver.drive(1, 2)
    assert len(planned) == 1 and fake.started == 4  # the dead loader replaced; then a worker per loss of the lines
    assert sorted(concluded) == [("a.wav", "failed"), ("b.wav", "failed")]
    assert all(result.worker is not None for result in driver.batch.results)

    def made(items):
        return "lines", [(item.name, "done", None) for item in items]

    other = _FakeRay([_load_answer(identity), _load_answer({"engine": {"dtype": "bfloat16"}})], [made])
    driver = _Driver(other, lambda answer: lines, WorkerSpec("m"), RUN, 240, conclude, None, ClusterBatch([]))
    with pytest.raises(ClusterError, match="the work was planned for one"):
        driver.drive(2, 2)
