"""Batch files on a Ray cluster: workers that each load the model once make lines' files in memory, and the driver
alone writes them, whole and in a manifest, replacing workers that die (docs/cluster.md). Ray is imported only when a
batch runs (`pip install -e '.[ray]'`)."""

from __future__ import annotations

import copy
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Callable

from rvqtts.engine.model.sampling import NonFiniteError
from rvqtts.engine.speculative.online import keep_learned
from rvqtts.synthesis.batch_files import BatchResult, Manifest, attempt, conclude, describe, to_do
from rvqtts.synthesis.batch_size import choose_batch_size
from rvqtts.synthesis.loader import EngineChoices
from rvqtts.synthesis.settings import Line

INSTALL_HINT = "pip install -e '.[ray]' (from rvqtts's checkout folder; rvqtts is not on PyPI)"
DEATHS_PER_LINE = 3  # a line whose workers died this often is reported failed rather than tried again
START_TIMEOUT = 600.0  # seconds to wait for a first worker the cluster cannot place before giving up
MEASURED_LINES = 64  # what a worker's `--batch-size auto` is chosen for (it speaks many lines)
HEALTH_SECONDS = 5.0  # while waiting for the workers, how often the driver checks that its own Ray node lives


class ClusterError(RuntimeError):
    """The cluster cannot run the batch (no Ray, no cluster, too few resources, a worker that cannot
    load the model); the message says what to do."""


def require_ray():
    """The ray module, or ClusterError with the line that installs it."""
    try:
        import ray
    except ImportError as error:
        raise ClusterError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from error
    return ray


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker loads, as `rvqtts synth` would on its machine; `device="auto"` is cuda where the
    worker was given GPUs, else cpu. `voices`: the batch's cloned voices (rvqtts.qwen.cloning.VoiceSource,
    absolute paths that every node must have, as the model's), encoded while loading so that a voice the
    model cannot use stops the batch with one line."""

    model: str
    choices: EngineChoices = EngineChoices(batch_size=1)  # batch_size None: measured on the worker's machine
    cpus: float = 1.0
    gpus: float = 0.0
    voices: tuple = ()


class SynthesisWorker:
    """One Ray actor: a model loaded once, then one line at a time rendered into its output file's bytes."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.synth = None

    def load(self) -> dict:
        """Load the model; what this worker is (node, pid, device, dtype, versions) and what a local run
        would have told its user, for the driver."""
        import ray
        import torch

        from rvqtts.synthesis.synthesizer import Synthesizer

        spec = self.spec
        torch.set_num_threads(max(1, int(spec.cpus)))  # the CPUs Ray gave this worker, not the whole node's
        device = spec.choices.device
        if device == "auto":
            device = "cuda" if spec.gpus > 0 else "cpu"
        notices: list[str] = []
        self.synth = Synthesizer.load(spec.model, replace(spec.choices, device=device), notices.append)
        for source in spec.voices:
            self.synth.voice_of(source)
        self.rows = spec.choices.batch_size or choose_batch_size(self.synth, MEASURED_LINES)[0]
        engine = self.synth.engine_record()
        return {
            "node": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "device": engine["device"],
            "dtype": engine["dtype"],
            "decoder_dtype": engine["decoder_dtype"],
            "threads": torch.get_num_threads(),
            "rvqtts": version("rvqtts"),
            "torch": torch.__version__,
            "notices": notices,
            "instruct": self.synth.supports_instruct,
            "rows": self.rows,
            "identity": self.synth.identity(),
            "sample_rate": self.synth.sample_rate,
        }

    def render(self, items: list[Line], defaults: Line, chunk_chars: float | None) -> tuple[str, object]:
        """("lines", [(line name, status, value)]): rvqtts.synthesis.batch_files.attempt's answer for each line, the
        lines spoken `rows` at a time; or ("nonfinite", (model, dtype)). A line's failure is an answer, so only a
        worker in trouble raises. What the online tree choice learned is kept after them (Ray ends a worker with
        a kill, which runs no exit handler)."""
        try:
            return "lines", [
                (item.name, status, value)
                for item, (status, value) in attempt(self.synth, items, defaults, chunk_chars, self.rows)
            ]
        except NonFiniteError as error:
            return "nonfinite", (error.model, error.dtype)
        finally:
            keep_learned()


@dataclass
class WorkerRecord:
    """One worker's share of the batch."""

    name: str
    node: str = ""
    pid: int = 0
    device: str = ""
    dtype: str = ""
    threads: int = 0
    rows: int = 1  # lines it speaks together
    lines: int = 0
    failed: int = 0
    audio_seconds: float = 0.0
    busy_seconds: float = 0.0
    alive: bool = True

    def summary(self) -> dict:
        record = {"worker": self.name, **asdict(self), "died": not self.alive}
        del record["name"], record["alive"]
        return record | {key: round(record[key], 3) for key in ("audio_seconds", "busy_seconds")}


@dataclass
class ClusterBatch:
    """A batch's results in line order, and how the cluster did: its workers, wall time and retries."""

    results: list[BatchResult]
    workers: list[WorkerRecord] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # what a local run would have said (tree, --instruct)
    wall_seconds: float = 0.0
    startup_seconds: float = 0.0  # until the first worker had its model loaded
    retried_lines: int = 0
    began: float = 0.0  # perf_counter when the workers were first asked for: set by the driver's loop

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def totals(self) -> dict:
        """Throughput over the whole batch: lines per second and audio seconds per wall second."""
        done = [r.record for r in self.results if r.status == "done"]
        audio = sum(r["audio_seconds"] for r in done)
        wall = self.wall_seconds or float("nan")
        return {
            "lines": len(done),
            "wall_seconds": round(self.wall_seconds, 3),
            "startup_seconds": round(self.startup_seconds, 3),
            "lines_per_second": round(len(done) / wall, 4),
            "audio_seconds": round(audio, 3),
            "audio_seconds_per_wall_second": round(audio / wall, 4),
            "workers": len(self.workers),
            "workers_died": sum(not w.alive for w in self.workers),
            "retried_lines": self.retried_lines,
        }


def connect(address: str) -> bool:
    """Join the Ray cluster at `address` ("auto": $RAY_ADDRESS or the cluster `ray start` made on this
    machine, else a new one here); True when this call started the connection (and so should end it)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    import logging

    try:
        ray.init(address=None if address == "auto" else address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as error:  # Ray raises ConnectionError, RuntimeError, ValueError or a bare Exception
        first = _first_line(error)
        hint = "see `ray status`" if address == "auto" else "check it with `ray status --address` there"
        raise ClusterError(
            f"cannot reach a Ray cluster at {address!r}: {first} ({hint}; `ray start --head` starts one)"
        ) from error
    return True


def _worker_count(ray, spec: WorkerSpec, workers: int | None, lines: int) -> int:
    """`workers`, or as many as the cluster's CPUs (GPUs when each worker takes some) hold; an error
    when the cluster cannot place even one worker, or fewer than asked."""
    resources = ray.cluster_resources()
    fits = [int(resources.get("CPU", 0) // spec.cpus)] if spec.cpus > 0 else []
    if spec.gpus > 0:
        fits.append(int(resources.get("GPU", 0) // spec.gpus))
    room = min(fits) if fits else lines
    have = f"{resources.get('CPU', 0):g} CPUs and {resources.get('GPU', 0):g} GPUs"
    if room < 1 or (workers is not None and workers > room):
        wanted = workers or 1
        raise ClusterError(
            f"the cluster has {have}; {wanted} worker(s) of {spec.cpus:g} CPUs and "
            f"{spec.gpus:g} GPUs need more: use fewer --workers, or smaller --cpus-per-worker "
            "/ --gpus-per-worker"
        )
    return max(1, min(workers or room, lines))


def synthesize_batch_on_ray(
    utterances: list[Line],
    out_dir: Path,
    spec: WorkerSpec,
    defaults: Line,
    chunk_chars: float | None,
    *,
    address: str = "auto",
    workers: int | None = None,
    force: bool = False,
    codes_dir: Path | None = None,
    on_done: Callable[[BatchResult], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> ClusterBatch:
    """Synthesize the utterances whose output is missing from `out_dir` (all with `force`) on Ray workers.

    `defaults` and `chunk_chars`: what every line shares, as for rvqtts.synthesis.batch_files.synthesize_batch.
    `on_start(lines)` is called once the work is known, `on_done(result)` after each line. Raises ClusterError when the
    cluster cannot run the batch and NonFiniteError when the model produced NaN or inf (every line would).
    """
    pending = to_do(utterances, out_dir, force)
    results = {item.name: BatchResult(item, "skipped") for item in utterances}
    manifest = Manifest(out_dir)
    if on_start:
        on_start(len(pending))

    def written(line: Line, status: str, value, worker: WorkerRecord) -> BatchResult:
        return conclude(out_dir, line, status, value, manifest, codes_dir, worker)

    def finished(result: BatchResult) -> None:
        results[result.line.name] = result
        if on_done:
            on_done(result)

    batch = ClusterBatch([])
    if pending:
        batch = render_on_ray(
            pending,
            spec,
            defaults,
            chunk_chars,
            written,
            len(pending),
            address=address,
            workers=workers,
            on_done=finished,
        )
    batch.results = [results[item.name] for item in utterances]
    return batch


def render_on_ray(
    lines: list[Line] | Callable[[dict], list[Line]],
    spec: WorkerSpec,
    defaults: Line,
    chunk_chars: float | None,
    conclude: Callable[[Line, str, object, WorkerRecord], BatchResult],
    most_lines: int,
    *,
    address: str = "auto",
    workers: int | None = None,
    on_done: Callable[[BatchResult], None] | None = None,
) -> ClusterBatch:
    """Lines (each named apart) made by Ray workers: `conclude(line, status, value, worker)` takes each worker's answer
    (rvqtts.synthesis.batch_files.attempt's) where this process keeps it and returns its result, which `on_done`
    hears. `lines` may be a function of the first worker's load answer (its model's identity and sample rate), for
    work planned once the model is known; `most_lines` bounds them (the workers started). Raises ClusterError when
    the cluster cannot run them and NonFiniteError when the model produced NaN or inf (every line would)."""
    ray = require_ray()
    batch = ClusterBatch([])
    started = connect(address)
    try:
        driver = _Driver(ray, lines, spec, defaults, chunk_chars, conclude, on_done, batch)
        driver.drive(workers, most_lines)
    finally:
        if started:
            ray.shutdown()
    return batch


class _Driver:
    """The driver's loop: keep every worker busy with its share of lines (up to its batch size), hand what comes back
    to `conclude`, replace the dead."""

    def __init__(self, ray, lines, spec, defaults, chunk_chars, conclude, on_done, batch):
        self.ray, self.spec, self.conclude = ray, spec, conclude
        self.defaults, self.chunk_chars = defaults, chunk_chars  # what every line shares
        self.on_done, self.batch = on_done, batch
        self.actor_class = ray.remote(SynthesisWorker)
        self.plan = None if isinstance(lines, list) else lines  # called with the first load answer
        self.planned_for: dict | None = None  # the model identity the plan was made for: every worker's
        self.queue = deque(lines if isinstance(lines, list) else [])
        self.deaths: dict[str, int] = {}  # line name -> how often its worker was lost on it
        self.load_deaths = 0
        self.calls: dict = {}  # ObjectRef -> (actor, its record, its lines or None for its load, when it was sent)
        self.idle: list = []
        self.actors: list = []  # every actor started, killed when the batch ends however it ends
        self.wants_instruct = bool(defaults.instruct) or any(item.instruct for item in self.queue)

    def start_worker(self) -> None:
        record = WorkerRecord(f"w{len(self.batch.workers) + 1}")
        self.batch.workers.append(record)
        actor = self.actor_class.options(num_cpus=self.spec.cpus, num_gpus=self.spec.gpus).remote(self.spec)
        self.actors.append(actor)
        self.calls[actor.load.remote()] = (actor, record, None, time.perf_counter())

    def finish(self, result: BatchResult) -> None:
        self.batch.results.append(result)  # as they end
        if result.status == "failed" and result.worker is not None:
            result.worker.failed += 1
        if self.on_done:
            self.on_done(result)

    def failed(self, item: Line, error: str, record: WorkerRecord) -> None:
        """A line failed by the driver's own decision (its worker lost too often, its call raised), concluded as a
        worker's failure is."""
        result = self.conclude(item, "failed", error, record)
        result.worker = record
        self.finish(result)

    def lose(self, actor, record: WorkerRecord, items: list[Line] | None, error) -> None:
        """A worker lost (its process or node died, or Ray gave up on it): its lines go to another."""
        from ray.exceptions import ActorDiedError

        record.alive = False
        self.ray.kill(actor)  # one that is only unreachable must not keep its CPUs and GPUs
        if items is None:
            if isinstance(error, ActorDiedError) and error.actor_init_failed:
                raise ClusterError(
                    f"a worker could not start on {record.node or 'its node'} (is rvqtts "
                    f"installed there?): {_first_line(error)}"
                )
            self.load_deaths += 1
            if self.load_deaths >= DEATHS_PER_LINE:
                raise ClusterError(
                    f"{self.load_deaths} workers died while loading the model (out of memory? see "
                    f"`ray status` and the Ray logs): {_first_line(error)}"
                )
        for item in reversed(items or []):
            if self.deaths.setdefault(item.name, 0) >= DEATHS_PER_LINE - 1:
                error_line = f"its worker was lost {DEATHS_PER_LINE} times ({_first_line(error)})"
                self.failed(item, error_line, record)
            else:
                self.deaths[item.name] += 1
                self.batch.retried_lines += 1
                self.queue.appendleft(item)
        if self.queue or self.plan is not None:
            self.start_worker()

    def dispatch(self) -> None:
        """Give each idle worker its share of the lines left."""
        while self.idle and self.queue:
            actor, record = self.idle.pop()
            alive = sum(worker.alive for worker in self.batch.workers)
            share = min(record.rows, -(-len(self.queue) // max(alive, 1)))  # the last lines spread over the workers
            items = [self.queue.popleft() for _ in range(share)]
            render = actor.render.remote(items, self.defaults, self.chunk_chars)
            self.calls[render] = (actor, record, items, time.perf_counter())

    def receive(self, ready, ours: str) -> None:
        """A call's answer: a worker loaded, lines made (written here) or failed, or a worker lost."""
        from ray.exceptions import RayError, RayTaskError

        actor, record, items, sent = self.calls.pop(ready)
        try:
            answer = _owned(self.ray.get(ready))
        except RayTaskError as error:  # the call itself raised
            if items is None:
                raise ClusterError(
                    f"a worker could not load the model (or a voice of the batch): {describe(error.cause)}"
                ) from error
            for item in items:
                self.failed(item, _first_line(error), record)
            self.idle.append((actor, record))
            return
        except RayError as error:  # the worker died, its node was lost, or Ray could not run it
            self.lose(actor, record, items, error)
            return
        if items is None:
            _loaded(record, answer, ours, self.wants_instruct, self.batch)
            if self.plan is not None:  # the work, now that the model is known
                self.queue.extend(self.plan(answer))
                self.plan, self.planned_for = None, answer["identity"]
            elif self.planned_for is not None and answer["identity"] != self.planned_for:
                raise ClusterError(
                    f"worker {record.name} on {record.node} loaded the model as {answer['identity']['engine']}, the "
                    f"first as {self.planned_for['engine']}: the work was planned for one (give --dtype and "
                    "--decoder-dtype so that every worker runs the same)"
                )
            self.idle.append((actor, record))
            return
        status, value = answer
        record.busy_seconds += time.perf_counter() - sent
        if status == "nonfinite":
            raise NonFiniteError(*value)
        by_name = {item.name: item for item in items}
        for name, status, made in value:
            result = self.conclude(by_name[name], status, made, record)
            result.worker = record
            if result.status == "done":
                record.lines += 1
                record.audio_seconds += result.record["audio_seconds"]
            self.finish(result)
        self.idle.append((actor, record))

    def drive(self, workers: int | None, most_lines: int) -> None:
        """Start the workers (no more than `most_lines` can keep busy) and run the batch to its end; every actor is
        killed however it ends."""
        count = _worker_count(self.ray, self.spec, workers, most_lines)
        ours = version("rvqtts")
        self.batch.began = waiting = time.perf_counter()  # the wall time starts with its workers, after connecting
        try:
            for _ in range(count):
                self.start_worker()
            while True:
                self.dispatch()
                rendering = any(lines is not None for _, _, lines, _ in self.calls.values())
                if not (self.queue or rendering or self.plan):
                    break
                serving = bool(self.idle) or rendering
                ready, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=HEALTH_SECONDS)
                if not ready:  # a node that died takes its calls' answers with it: none would ever come
                    _check_this_node(self.ray)
                    if not serving and time.perf_counter() - waiting >= START_TIMEOUT:
                        raise ClusterError(
                            f"no worker loaded the model in {START_TIMEOUT:g} s: the cluster cannot "
                            f"place a worker of {self.spec.cpus:g} CPUs and {self.spec.gpus:g} GPUs, or the "
                            "load is stuck (see `ray status`)"
                        )
                    continue
                waiting = time.perf_counter()
                self.receive(ready[0], ours)
            self.batch.wall_seconds = self.batch.elapsed()
        finally:
            for actor in self.actors:
                self.ray.kill(actor)


def _check_this_node(ray) -> None:
    """ClusterError where the Ray node this driver runs on has died (its raylet killed or crashed): the
    driver's calls go through it, so their answers would never come."""
    node = ray.get_runtime_context().get_node_id()
    try:
        alive = any(entry["NodeID"] == node and entry["Alive"] for entry in ray.nodes())
    except Exception as error:  # the cluster's control store is gone too
        raise ClusterError(f"lost the Ray cluster ({_first_line(error)})") from error
    if not alive:
        raise ClusterError(
            "the Ray node on this machine died (its raylet stopped), and with it every call of "
            "the batch: start Ray again (or use --ray auto) and rerun the command to make the "
            "rest"
        )


def _owned(answer):
    """A worker's answer copied out of Ray's object store, so that the driver holds nothing of it there.

    Ray hands large answers (a line's audio) back through the shared memory of the driver's node, its arrays
    mapped rather than copied. If that node's raylet dies, Ray ends the driver's process (exit 1, no message)
    when it frees such an array or tries to recover an answer still referenced; holding copies, and no
    reference, the driver lives to notice its node died and say so."""
    return copy.deepcopy(answer)


def _loaded(record: WorkerRecord, answer: dict, ours: str, wants_instruct: bool, batch: ClusterBatch) -> None:
    """A worker's load answer: who it is, a version check, and its notices (each said once)."""
    from rvqtts.synthesis.synthesizer import INSTRUCT_IGNORED

    batch.startup_seconds = batch.startup_seconds or batch.elapsed()
    for key in ("node", "pid", "device", "dtype", "threads", "rows"):
        setattr(record, key, answer[key])
    if answer["rvqtts"] != ours:
        raise ClusterError(
            f"worker {record.name} on {record.node} runs rvqtts {answer['rvqtts']}, this driver "
            f"{ours}: install the same version on every node (their files could differ)"
        )
    notices = list(answer["notices"])
    if wants_instruct and not answer["instruct"]:
        notices.append(INSTRUCT_IGNORED)
    batch.notices.extend(n for n in notices if n not in batch.notices)


def _first_line(error: BaseException) -> str:
    """Ray's errors carry tracebacks and advice over many lines; a user's line needs the first."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
